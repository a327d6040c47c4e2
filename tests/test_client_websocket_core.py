"""The served WebSocket mode's pure core: client messages, the HTTP body a
create becomes, the mode's events and error texts (PROTOCOL_FACTS C8–C13),
the socket's memory and its bounds, and a session's lanes, driven by a real
``websockets`` client against the loopback server with a stand-in upstream."""

from __future__ import annotations

import asyncio
import json

import pytest
from stateful_responses.client_websocket import protocol
from stateful_responses.client_websocket.protocol import (
    Ignored,
    Invalid,
    Memory,
    Remembered,
    Steer,
    framed,
    http_body,
    read_message,
)
from stateful_responses.client_websocket.server import PATH_PREFIX, LoopbackServer, Posted, Session
from websockets.asyncio.client import connect


def create(**fields) -> bytes:
    return json.dumps({"type": "response.create", "model": "m", **fields}).encode()


def test_unknown_messages_are_ignored_and_steering_is_read():
    assert isinstance(read_message(b'{"type":"response.processed","response_id":"resp_1"}'), Ignored)
    assert isinstance(read_message(b'{"type":"response.append","input":[]}'), Ignored)
    steer = read_message(b'{"type":"response.steer","previous_response_id":"resp_1","input":"x"}')
    assert isinstance(steer, Steer) and steer.previous == "resp_1"


@pytest.mark.parametrize("lane", ["", "a b", "x" * 257, 7])
def test_a_stream_id_out_of_the_rules_is_refused_with_the_guides_text(lane):
    with pytest.raises(Invalid) as refused:
        read_message(create(input="x", stream_id=lane))
    assert refused.value.status == 400 and refused.value.error["code"] == "invalid_stream_id"
    assert refused.value.error["message"].startswith("The 'stream_id' field must be a non-empty string with at most 256")


def test_background_is_refused_on_its_lane():
    with pytest.raises(Invalid) as refused:
        read_message(create(input="x", background=True, stream_id="a"))
    assert refused.value.error["param"] == "background" and refused.value.lane == "a"


def test_the_http_body_has_no_websocket_field_and_streams():
    message = read_message(create(input="hi", stream_id="a", generate=True, store=False))
    body, whole = http_body(message, None)
    sent = json.loads(body)
    assert sent == {"model": "m", "input": "hi", "store": False, "stream": True}
    assert [json.loads(item) for item in whole] == [{"role": "user", "content": "hi"}]  # a string is one message


def test_a_parent_in_memory_becomes_its_items_then_the_new_ones():
    message = read_message(create(input=[{"role": "user", "content": "2"}], previous_response_id="resp_1"))
    parent = [b'{"role":"user","content":"1"}', b'{"type":"message","role":"assistant","content":[]}']
    body, whole = http_body(message, parent)
    sent = json.loads(body)
    assert "previous_response_id" not in sent and sent["input"] == [json.loads(i) for i in parent] + [
        {"role": "user", "content": "2"}]
    assert whole == [*parent, b'{"role": "user", "content": "2"}']


def test_a_parent_only_the_upstream_holds_goes_by_id():
    body, whole = http_body(read_message(create(input="x", previous_response_id="resp_1")), None)
    assert json.loads(body)["previous_response_id"] == "resp_1" and whole is None


def test_named_lane_events_carry_their_stream_id_and_default_lane_events_do_not():
    event = '{"type":"response.created","sequence_number":0}'
    assert json.loads(framed(event, "a")) == {"stream_id": "a", "type": "response.created", "sequence_number": 0}
    assert framed(event, None) == event.encode()


def test_the_error_texts_are_the_guides():
    assert json.loads(protocol.not_found("resp_abc", "main")) == {
        "type": "error", "status": 400, "stream_id": "main", "error": {
            "type": "invalid_request_error", "code": "previous_response_not_found",
            "message": "Previous response with id 'resp_abc' not found.", "param": "previous_response_id"}}
    assert json.loads(protocol.lane_limit("agent_33"))["error"]["message"] == (
        "This WebSocket connection has reached its maximum number of distinct stream IDs (32). Reuse an existing "
        "stream_id or open a new WebSocket connection.")
    limit = json.loads(protocol.lifetime_limit(None))
    assert limit["status"] == 400 and limit["error"]["code"] == "websocket_connection_limit_reached"
    assert limit["error"]["message"] == ("Responses websocket connection limit reached (60 minutes). Create a new "
                                         "websocket connection to continue.")
    refused = json.loads(protocol.upstream_error(502, b"<html>bad gateway</html>", None))
    assert refused["status"] == 502 and refused["error"]["type"] == "server_error"


def test_memory_counts_shared_items_once_and_drops_the_oldest_past_its_bounds():
    memory = Memory(max_responses=3, max_bytes=100)
    first = [b"a" * 30]
    memory.put("r1", Remembered(first, None, False))
    memory.put("r2", Remembered([*first, b"b" * 30], None, False))  # shares r1's item
    assert memory.bytes == 60
    memory.put("r3", Remembered([*first, b"c" * 30], None, False))
    assert memory.bytes == 90 and len(memory) == 3
    memory.put("r4", Remembered([b"d" * 30], None, False))  # 120 bytes: the oldest go
    assert memory.get("r1") is None and memory.bytes <= 100
    memory.forget("r4")
    memory.forget("r3")
    memory.forget("r2")
    assert memory.bytes == 0


class Upstream:
    """A stand-in for the addon's HTTP turn: each body answered with a streamed response, in order."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.bodies: list[dict] = []
        self.running = self.most = 0
        self.hold = hold

    def post(self, body: bytes, n: int, create) -> Posted:
        parts: asyncio.Queue = asyncio.Queue()
        self.bodies.append(json.loads(body))
        asyncio.get_running_loop().create_task(self._answer(parts, len(self.bodies)))
        return Posted(parts, lambda: None)

    async def _answer(self, parts: asyncio.Queue, n: int) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0.01)
        response = {"id": f"resp_{n}", "status": "completed", "store": False,
                    "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                     "text": f"answer {n}"}]}]}
        parts.put_nowait(("head", 200))
        for seq, kind in enumerate(("response.created", "response.completed")):
            event = json.dumps({"type": kind, "sequence_number": seq, "response": response})
            parts.put_nowait(("data", f"event: {kind}\ndata: {event}\n\n".encode()))
        self.running -= 1
        parts.put_nowait(("end", None))


async def serve(session: Session):
    server = LoopbackServer(lambda token: session if token == "t" else None)
    await server.start()
    return server, f"ws://127.0.0.1:{server.port}{PATH_PREFIX}t"


async def until(ws, kind: str, count: int = 1) -> list[dict]:
    got = []
    while sum(e["type"] == kind for e in got) < count:
        got.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    return got


def test_lanes_run_at_once_creates_on_one_lane_queue_and_the_33rd_lane_is_refused():
    async def go():
        upstream = Upstream()
        session = Session(upstream.post)
        server, url = await serve(session)
        async with connect(url) as ws:
            for lane in ("a", "a", "b"):
                await ws.send(create(input=f"on {lane}", stream_id=lane, store=False).decode())
            events = await until(ws, "response.completed", 3)
            assert sorted(e["stream_id"] for e in events if e["type"] == "response.completed") == ["a", "a", "b"]
            # lane b did not wait for lane a's queue: its create ran beside a's first
            assert upstream.most >= 2
            # on lane a, the second create ran after the first: its answer is the later of the two
            done_a = [e["response"]["id"] for e in events if e["type"] == "response.completed" and e["stream_id"] == "a"]
            assert done_a == sorted(done_a, key=lambda i: int(i.split("_")[1]))
            for n in range(30):
                await ws.send(create(input="x", stream_id=f"lane{n}", generate=False).decode())
            await until(ws, "response.completed", 30)
            await ws.send(create(input="x", stream_id="one_too_many").decode())
            [refused] = await until(ws, "error")
            assert refused["error"]["code"] == "websocket_stream_limit_reached" and refused["stream_id"] == "one_too_many"
            await ws.send(create(input="x", stream_id="a", generate=False).decode())  # a known lane still works
            await until(ws, "response.completed")
        server.close()
    asyncio.run(go())


def test_at_most_sixteen_responses_run_at_once_and_the_rest_wait():
    async def go():
        hold = asyncio.Event()
        upstream = Upstream(hold)
        server, url = await serve(Session(upstream.post))
        async with connect(url) as ws:
            for n in range(20):
                await ws.send(create(input="x", stream_id=f"l{n}").decode())
            await asyncio.sleep(0.3)
            assert len(upstream.bodies) == 16  # the other four wait for a free place
            hold.set()
            await until(ws, "response.completed", 20)
        assert upstream.most == 16
        server.close()
    asyncio.run(go())


def test_a_socket_continues_its_own_responses_store_false_included_and_no_other():
    async def go():
        upstream = Upstream()
        server, url = await serve(Session(upstream.post))
        async with connect(url) as ws:
            await ws.send(create(input="one", store=False).decode())
            [*_, done] = await until(ws, "response.completed")
            await ws.send(create(input="two", store=False, previous_response_id=done["response"]["id"]).decode())
            await until(ws, "response.completed")
            assert [len(b["input"]) if isinstance(b["input"], list) else 1 for b in upstream.bodies] == [1, 3]
            await ws.send(create(input="x", store=False, previous_response_id="resp_elsewhere").decode())
            [refused] = await until(ws, "error")
            assert refused["error"]["code"] == "previous_response_not_found" and "stream_id" not in refused
            assert len(upstream.bodies) == 2  # never sent
        server.close()
    asyncio.run(go())


def test_past_its_lifetime_a_socket_refuses_creates_with_the_limit_error():
    async def go():
        upstream = Upstream()
        server, url = await serve(Session(upstream.post, lifetime_s=0.0))
        async with connect(url) as ws:
            await ws.send(create(input="late").decode())
            [refused] = await until(ws, "error")
            assert refused["error"]["code"] == "websocket_connection_limit_reached" and refused["status"] == 400
            assert not upstream.bodies
        server.close()
    asyncio.run(go())


def test_an_unknown_token_is_refused_at_the_upgrade():
    async def go():
        server, url = await serve(Session(Upstream().post))
        with pytest.raises(Exception, match="404"):
            async with connect(url.replace("/t", "/nobody")):
                pass
        server.close()
    asyncio.run(go())


def test_an_idle_socket_is_closed_normally_and_a_busy_one_is_not(monkeypatch):
    from stateful_responses.client_websocket import server as server_module

    monkeypatch.setattr(server_module, "WATCH_S", 0.05)

    async def go():
        hold = asyncio.Event()
        upstream = Upstream(hold)
        session = Session(upstream.post, idle_s=0.2)
        server, url = await serve(session)
        async with connect(url) as ws:
            await ws.send(create(input="slow").decode())
            await asyncio.sleep(0.6)  # idle of messages, but its turn runs: kept open
            hold.set()
            await until(ws, "response.completed")
            with pytest.raises(Exception):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 1000
        await asyncio.wait_for(session.closed.wait(), 5)  # the server's side ends just after the client saw it
        assert len(session.memory) == 0  # its memory went with it
        server.close()
    asyncio.run(go())


def test_an_internal_error_is_the_turns_error_event_and_the_socket_goes_on():
    async def go():
        upstream = Upstream()
        calls = []

        def post(body: bytes, n: int, create) -> Posted:
            calls.append(n)
            if n == 0:
                raise RuntimeError("a prompt could be quoted here")
            return upstream.post(body, n, create)

        server, url = await serve(Session(post))
        async with connect(url) as ws:
            await ws.send(create(input="breaks").decode())
            [failed] = await until(ws, "error")
            assert failed["status"] == 500 and "prompt" not in json.dumps(failed)
            await ws.send(create(input="works").decode())
            await until(ws, "response.completed")
        assert calls == [0, 1]
        server.close()
    asyncio.run(go())


@pytest.mark.skipif(not hasattr(asyncio, "eager_task_factory"), reason="eager tasks came with Python 3.12")
def test_a_lane_whose_turn_needed_no_wait_takes_its_next_create_under_eager_tasks():
    """mitmproxy 12 runs tasks eagerly: a warm-up the proxy answers can finish its lane before create_task
    returns. The next create on that lane must still be served (it hung: the finished worker was kept)."""
    async def go():
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        upstream = Upstream()
        session = Session(upstream.post)
        server, url = await serve(session)
        async with connect(url) as ws:
            await ws.send(create(input="warm", generate=False, store=False).decode())
            warm = next(e for e in await until(ws, "response.completed") if e["type"] == "response.completed")
            await ws.send(create(input="then", previous_response_id=warm["response"]["id"], store=False).decode())
            await until(ws, "response.completed")
        assert len(upstream.bodies) == 1
        server.close()
    asyncio.run(go())
