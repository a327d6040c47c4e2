"""The WebSocket bridge's pure core: the messages it sends, the events it
reads, the socket memory it matches turns against, the pool's bounds, and the
relay's retries and bounds, with a socket that plays back scripted events;
then its glue in-process: where a flow's socket goes, and that a flow is let go."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from urllib.parse import urlsplit

import msgspec
import pytest
from driver import httpx
from mitmproxy import http
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHeadersHook, HttpResponseHook
from mitmproxy.test import tflow, tutils
from stateful_responses.flows import BRIDGED
from stateful_responses.items import item_digest
from stateful_responses.request_reader import Reader, Reading, Request
from stateful_responses.answer_reader import SSEParser
from stateful_responses.websocket.addon import target_of
from stateful_responses.websocket.connect import COMPRESS_UP_TO, FRAGMENT, Refused, Target, TLSOptions, open_socket
from stateful_responses.websocket.loopback import Answer
from stateful_responses.websocket.messages import (
    Tip,
    error_answer,
    MAX_REMEMBERED_OUTPUTS,
    OUTPUT_ENTRY,
    output_key,
    read_event,
    retried_on_a_socket,
    retried_over_http,
    socket_message,
    sse_event,
    tip_after,
)
from stateful_responses.websocket.pool import LIVE_GAPS, LIVE_S, ROTATE_AFTER, Choice, Declined, Pool
from stateful_responses.websocket.relay import Turn, relay
from websockets.exceptions import ConnectionClosedError

URL = "https://api.example.test/v1/responses"
ROOT = b"r" * 32


def read(body: dict | bytes) -> tuple[bytes, Reading]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reading = Reader().read(Request("POST", URL, {"authorization": "Bearer sk"}, data))
    assert isinstance(reading, Reading)
    return data, reading


# -- messages ---------------------------------------------------------------------------------------


def test_a_full_message_is_the_clients_body_with_a_type_and_without_stream():
    body, reading = read(b'{"model": "m", "stream": true, "store": false,\n "input": [{"role": "user", "content": "hi"}]}')
    message = socket_message(body, reading.fields)
    assert json.loads(message) == {"type": "response.create", "model": "m", "store": False,
                                   "input": [{"role": "user", "content": "hi"}]}
    assert b'[{"role": "user", "content": "hi"}]' in message  # the client's own bytes


def test_a_continuation_carries_only_the_new_items_and_the_previous_id():
    body, reading = read({"model": "m", "store": False, "instructions": "be brief",
                          "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                    {"role": "user", "content": "c"}]})
    message = json.loads(socket_message(body, reading.fields, reading.raw_items[2:], "resp_1"))
    assert message == {"type": "response.create", "model": "m", "store": False, "instructions": "be brief",
                       "input": [{"role": "user", "content": "c"}], "previous_response_id": "resp_1"}


def test_events_are_read_for_what_the_bridge_acts_on():
    error = read_event(b'{"type": "error", "status": 400, "error": {"type": "invalid_request_error", '
                       b'"code": "previous_response_not_found", "message": "gone", "param": null}}')
    assert (error.type, error.status, error.error_code, error.terminal) == ("error", 400, "previous_response_not_found",
                                                                            True)
    flat = read_event(b'{"type": "error", "code": "server_error", "message": "boom", "sequence_number": 3}')
    assert flat.error_code == "server_error" and flat.status is None
    done = read_event(b'{"type": "response.completed", "response": {"id": "resp_1"}, "sequence_number": 9}')
    assert done.terminal and bytes(done.response) == b'{"id": "resp_1"}'
    assert read_event(b'{"type": "response.created", "response": null}').response is None
    assert read_event(b"not json").type is None and read_event(b"[1]").type is None


def test_each_event_is_framed_as_the_apis_sse_and_reads_back_as_it_came():
    texts = [b'{"type": "response.created", "response": {"id": "r"}}', b'{"type": "x",\n "a": 1}', b'{"b": 2}']
    framed = b"".join(sse_event(json.loads(t).get("type"), t) for t in texts)
    assert framed.startswith(b"event: response.created\ndata: {")
    parser = SSEParser()
    events = parser.feed(framed[:17]) + parser.feed(framed[17:])
    assert [(name, json.loads(data)) for name, data in events] == [
        ("response.created", {"type": "response.created", "response": {"id": "r"}}),
        ("x", {"type": "x", "a": 1}), ("", {"b": 2})]


@pytest.mark.parametrize("event,status,body", [
    (b'{"type": "error", "status": 429, "error": {"type": "rate_limit_error", "code": "rate_limit_exceeded"}}', 429,
     {"error": {"type": "rate_limit_error", "code": "rate_limit_exceeded"}}),
    (b'{"type": "error", "error": {"type": "server_error", "code": "server_error", "message": "x"}}', 500,
     {"error": {"type": "server_error", "code": "server_error", "message": "x"}}),
    (b'{"type": "error", "status": 7, "code": "odd"}', 500,
     {"error": {"type": "server_error", "code": "odd", "message": "", "param": None}}),
])
def test_an_error_event_becomes_the_http_status_and_body_of_the_api(event, status, body):
    answered = error_answer(read_event(event))
    assert answered[0] == status and json.loads(answered[2]) == body


@pytest.mark.parametrize("event,status", [
    ({"status_code": 429, "error": {"code": "x"}}, 429),  # the spelling codex-rs also reads
    ({"status_code": 400, "error": {"code": "x"}}, 400),
    ({"error": {"code": "rate_limit_exceeded"}}, 429),  # no status: its code or type tells
    ({"error": {"type": "invalid_request_error", "code": "previous_response_not_found"}}, 400),
    ({"error": {"type": "invalid_request_error", "code": "odd"}}, 400),
    ({"error": {"type": "server_error"}}, 500),
    ({"error": {"code": "server_is_overloaded"}}, 503),
    ({"error": {"code": "who_knows"}}, 500),
    ({"code": "rate_limit_exceeded"}, 429),  # the flat form
    ({"status": True, "error": {"code": "x"}}, 500),
])
def test_an_error_events_status_is_its_own_or_the_one_its_code_names(event, status):
    assert read_event(json.dumps({"type": "error", **event})).http_status == status


def test_an_error_events_retry_after_reaches_the_client_from_either_place():
    top = read_event(json.dumps({"type": "error", "status": 429, "error": {"code": "x"},
                                 "headers": {"Retry-After": 7, "x-request-id": "req_1", "x-ratelimit-reset": "1s"}}))
    nested = read_event(json.dumps({"type": "error", "status": 429,
                                    "error": {"code": "x", "headers": {"retry-after-ms": "900", "bad": "\r\nx"}}}))
    assert error_answer(top)[1] == [(b"content-type", b"application/json"), (b"retry-after", b"7"),
                                    (b"x-ratelimit-reset", b"1s")]
    assert error_answer(nested)[1][1:] == [(b"retry-after-ms", b"900")]


def test_a_socket_limit_named_by_the_errors_type_is_a_state_error():
    event = read_event(json.dumps({"type": "error", "error": {"type": "websocket_connection_limit_reached"}}))
    assert event.error_code == "websocket_connection_limit_reached" and retried_on_a_socket(event, False)


@pytest.mark.parametrize("event,continued,on_a_socket,over_http", [
    ({"status": 400, "error": {"code": "previous_response_not_found"}}, True, True, True),
    ({"status": 400, "error": {"code": "websocket_connection_limit_reached"}}, False, True, True),
    ({"status": 400, "error": {"code": "invalid_value"}}, True, True, True),  # a refused continuation
    ({"status": 400, "error": {"code": "invalid_value"}}, False, False, True),  # the client's own request
    ({"status": 429, "error": {"code": "rate_limit_exceeded"}}, True, False, False),
    ({"status": 500, "error": {"code": "server_error"}}, True, True, False),  # the change may be why: whole again
    ({"status": 503, "error": {"code": "server_error"}}, True, False, False),  # unavailable, whatever is sent
    ({"status": 500, "error": {"code": "server_error"}}, False, False, False),
    ({"error": {"code": "server_error"}}, False, False, False),
    ({"status_code": 400, "error": {"code": "invalid_value"}}, True, True, True),
    ({"status_code": 429, "error": {"code": "x"}}, True, False, False),
    ({"error": {"type": "invalid_request_error", "code": "invalid_value"}}, True, True, True),
    ({"error": {"code": "rate_limit_exceeded"}}, True, False, False),
])
def test_which_refusals_are_retried_and_how(event, continued, on_a_socket, over_http):
    parsed = read_event(json.dumps({"type": "error", **event}))
    assert retried_on_a_socket(parsed, continued) is on_a_socket
    assert retried_over_http(parsed) is over_http


def test_a_sockets_memory_of_output_ids_is_bounded_and_packed():
    """A long conversation's socket keeps the latest MAX_REMEMBERED_OUTPUTS output item ids for item
    references, packed: 24 bytes each, not a pair of Python objects (about 200 bytes)."""
    tip = None
    for n in range(MAX_REMEMBERED_OUTPUTS + 100):
        output = [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": f"x{n}", "annotations": []}]}]
        tip = tip_after(ROOT, [], msgspec.Raw(json.dumps({"id": f"resp_{n}", "status": "completed",
                                                          "output": output}).encode()), {}, tip)
    assert len(tip.outputs) == MAX_REMEMBERED_OUTPUTS * OUTPUT_ENTRY == 24 * 1024
    named = tip.named()
    assert output_key(f"msg_{MAX_REMEMBERED_OUTPUTS + 99}") in named and output_key("msg_99") not in named
    assert output_key("msg_100") in named  # the oldest kept


# -- the socket's memory ----------------------------------------------------------------------------

OUTPUT = [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
          {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}',
           "status": "completed"}]
RESPONSE = {"id": "resp_1", "status": "completed", "output": OUTPUT}
HISTORY = [{"role": "user", "content": "hi"}]


def digests(items) -> list[bytes]:
    return [item_digest(i) for i in items]


def tip_of(response=RESPONSE, history=HISTORY, done=None) -> Tip | None:
    raw = msgspec.Raw(json.dumps(response).encode())
    return tip_after(ROOT, digests(history), raw, done or {}, None)


def test_a_completed_response_is_remembered_as_its_input_then_its_output():
    tip = tip_of()
    assert (tip.length, tip.response_id, tip.named().keys()) == (3, "resp_1", {output_key("msg_1"), output_key("fc_1")})
    echo = HISTORY + [{"role": "assistant", "content": "hello"},  # an easy message echoes the typed one
                      {**OUTPUT[1], "arguments": '{"a":1}', "status": None}]  # re-serialized, a null added
    assert tip.extended_by(ROOT, digests(echo + [{"type": "function_call_output", "call_id": "call_1",
                                                  "output": "2"}]), {})
    assert not tip.extended_by(ROOT, digests(echo), {})  # the same history again: nothing new, no continuation
    assert not tip.extended_by(b"o" * 32, digests(echo + HISTORY), {})  # another model or credential
    edited = [{"role": "user", "content": "hi!"}] + echo[1:] + HISTORY
    assert not tip.extended_by(ROOT, digests(edited), {})


def test_an_item_reference_to_an_output_item_equals_that_item():
    tip = tip_of()
    sent = HISTORY + [{"type": "item_reference", "id": "msg_1"}, {"type": "item_reference", "id": "fc_1"},
                      {"role": "user", "content": "more"}]
    sent_digests = digests(sent)
    references = {sent_digests[1]: "msg_1", sent_digests[2]: "fc_1"}
    assert tip.extended_by(ROOT, sent_digests, references)
    assert not tip.extended_by(ROOT, sent_digests, {})


@pytest.mark.parametrize("response", [
    {**RESPONSE, "status": "failed"}, {**RESPONSE, "status": "incomplete"}, {"status": "completed", "output": []},
])
def test_anything_but_a_completed_response_leaves_the_socket_remembering_nothing(response):
    assert tip_of(response) is None


def test_an_answer_other_parsers_read_differently_is_not_built_on():
    raw = msgspec.Raw(b'{"id": "resp_1", "id": "resp_2", "status": "completed", "output": []}')
    assert tip_after(ROOT, digests(HISTORY), raw, {}, None) is None


def test_an_empty_output_is_filled_from_the_done_events():
    done = {i: msgspec.Raw(json.dumps(item).encode()) for i, item in enumerate(OUTPUT)}
    assert tip_of({**RESPONSE, "output": []}, done=done) == tip_of()


def test_an_empty_output_whose_done_events_miss_an_item_is_not_built_on():
    """The socket holds every item; a memory without the missed one would send the client's copy of it again."""
    done = {i: msgspec.Raw(json.dumps(item).encode()) for i, item in enumerate(OUTPUT + OUTPUT[:1])}
    del done[1]
    assert tip_of({**RESPONSE, "output": []}, done=done) is None


# -- the pool ---------------------------------------------------------------------------------------


class Connection:
    def __init__(self) -> None:
        self.open = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(max_per_scope: int = 3, idle_s: float = 300, max_total: int = 100) -> tuple[Pool, Clock]:
    clock = Clock()
    return Pool(clock, max_per_scope, idle_s, max_total), clock


def opened(p: Pool, scope: str = "s", tip: Tip | None = None):
    choice = p.choose(scope, ROOT, digests(HISTORY), {})
    p.opened(choice.held, Connection())
    p.release(choice.held, tip)
    return choice.held


def test_a_turn_takes_the_socket_whose_memory_it_extends_else_a_new_one_else_http():
    p, clock = pool(max_per_scope=2)
    tip = tip_of()
    remembering = opened(p, tip=tip)
    clock.now += 1
    other = opened(p)
    assert len(p) == 2
    nxt = digests(HISTORY + OUTPUT + [{"role": "user", "content": "next"}])
    choice = p.choose("s", ROOT, nxt, {})
    assert (choice.held, choice.continued, choice.fresh) == (remembering, tip, False)
    # two turns of one branch at once: the second cannot continue on the busy socket, takes the other one
    second = p.choose("s", ROOT, nxt, {})
    assert (second.held, second.continued, second.fresh) == (other, None, False)
    assert p.choose("s", ROOT, nxt, {}) == Declined("busy")  # all busy at the cap: HTTP
    new_scope = p.choose("t", ROOT, nxt, {})
    assert new_scope.fresh and len(p) == 3


def test_a_full_turn_prefers_a_new_socket_to_taking_another_branchs_memory():
    p, _ = pool(max_per_scope=2)
    remembering = opened(p, tip=tip_of())
    choice = p.choose("s", ROOT, digests([{"role": "user", "content": "another conversation"}]), {})
    assert choice.fresh and choice.held is not remembering and remembering.tip is not None


def conversation(n: int, turns: int) -> tuple[list, Tip]:
    """Conversation ``n`` after ``turns`` answered turns: its history and the tip of its latest answer."""
    history: list = []
    tip = None
    for t in range(turns):
        history.append({"role": "user", "content": f"conversation {n} turn {t}"})
        response = {"id": f"resp_{n}_{t}", "status": "completed",
                    "output": [{"type": "message", "id": f"msg_{n}_{t}", "status": "completed", "role": "assistant",
                                "content": [{"type": "output_text", "text": f"answer {n} {t}", "annotations": []}]}]}
        tip = tip_of(response, history)
        history = history + response["output"]
    return history, tip


def test_a_socket_given_back_unused_keeps_its_memory_as_stale_as_it_was():
    """A turn that took a stale memory's socket and then went elsewhere gives it back as it was: the
    conversation that ended does not look live again (a release would stamp it as just used)."""
    p, clock = pool(max_per_scope=1)
    held = opened(p, tip=tip_of())
    clock.now += LIVE_S + 1  # the conversation it remembers ended
    newcomer = digests([{"role": "user", "content": "another conversation"}])
    choice = p.choose("s", ROOT, newcomer, {})
    assert choice.held is held and choice.continued is None
    p.give_back(choice.held)
    assert held.tip == tip_of() and not held.busy  # its memory kept
    clock.now += 1
    assert p.choose("s", ROOT, newcomer, {}).held is held  # still stale: the newcomer gets it at once


def test_more_conversations_than_sockets_never_take_a_live_conversations_memory():
    """Six conversations in turn over four sockets: replacing the least recently used memory would make
    every turn whole (each evicts what the next one needs); the four that hold sockets keep them and
    stay continued, the other two go over HTTP every turn; a conversation that stays away three times its
    pace (one of unknown pace: LIVE_S) gives its socket to a new one."""
    p, clock = pool(max_per_scope=4)
    held: dict[int, object] = {}
    for turns in range(1, 5):
        for n in range(6):
            history, tip = conversation(n, turns)
            clock.now += 1
            choice = p.choose("s", ROOT, digests(history[:-1] + [{"role": "user", "content": "next"}]), {})
            if n >= 4:
                assert choice == Declined("live")
                continue
            assert isinstance(choice, Choice)
            if turns == 1:
                assert choice.fresh and choice.continued is None
                p.opened(choice.held, Connection())
                held[n] = choice.held
            else:
                assert choice.held is held[n] and choice.continued is not None
            p.release(choice.held, tip)
    # each conversation came back every 6 s: a socket unused for three times that holds one that ended
    newcomer = digests([{"role": "user", "content": "another conversation"}])
    clock.now += LIVE_GAPS * 6 - 6  # conversation 0 last answered 5 s before the loop's end
    assert p.choose("s", ROOT, newcomer, {}) == Declined("live")
    clock.now += 1
    choice = p.choose("s", ROOT, newcomer, {})
    assert isinstance(choice, Choice) and choice.held is held[0] and choice.continued is None
    # its newcomer has shown no pace yet: its memory is live for LIVE_S
    p.release(choice.held, tip_of())
    clock.now += LIVE_GAPS * 6
    assert p.choose("s", ROOT, newcomer, {}).held is held[1]
    p.release(held[1], None)
    clock.now += LIVE_S - LIVE_GAPS * 6 - 1
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a third"}]), {}).held is held[1]
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a fourth"}]), {}).held is held[2]
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a fifth"}]), {}).held is held[3]
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a sixth"}]), {}) == Declined("live")
    clock.now += 1
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a sixth"}]), {}).held is held[0]


def test_idle_sockets_close():
    p, clock = pool(idle_s=300)
    idle = opened(p)
    clock.now += 299
    assert p.sweep() == [] and len(p) == 1
    clock.now += 1
    assert p.sweep() == [idle.connection] and len(p) == 0


def test_sockets_rotate_before_their_sixty_minutes():
    p, clock = pool(idle_s=2 * ROTATE_AFTER)
    busy = p.choose("s", ROOT, digests(HISTORY), {}).held
    p.opened(busy, Connection())
    clock.now += ROTATE_AFTER
    assert p.sweep() == [] and busy.retired  # running a turn: no new one starts on it
    assert p.release(busy, tip_of()) is busy.connection and len(p) == 0  # closed once its turn is over
    young = opened(p)
    clock.now += ROTATE_AFTER - 1
    assert p.choose("s", ROOT, digests(HISTORY), {}).held is young
    p.release(young, None)
    clock.now += 1
    choice = p.choose("s", ROOT, digests(HISTORY), {})
    assert choice.fresh and p.take_closing() == [young.connection]


def test_a_socket_the_upstream_closed_while_idle_is_never_chosen():
    p, _ = pool()
    held = opened(p, tip=tip_of())
    held.connection.open = False
    choice = p.choose("s", ROOT, digests(HISTORY + OUTPUT + HISTORY), {})
    assert choice.fresh and p.take_closing() == [held.connection]


def test_the_total_bound_holds_across_scopes():
    p, _ = pool(max_per_scope=5, max_total=2)
    opened(p, "a")
    opened(p, "b")
    assert p.choose("c", ROOT, digests(HISTORY), {}) == Declined("busy")
    assert len(p.close_all()) == 2 and len(p) == 0


# -- the connection ---------------------------------------------------------------------------------


async def test_a_large_message_goes_uncompressed_and_small_ones_compressed_on_one_context():
    """Compressing runs on the event loop: a message over the bound is sent as it is (RSV1 clear), and the
    compressor's context, used for the small ones before and after it, stays valid on both sides. A message
    over ``FRAGMENT`` goes in frames of that size, each masked and written in turn."""
    from websockets.asyncio.server import serve
    from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
    from websockets.frames import Opcode

    flags: list[tuple[str, bool]] = []

    class Recording(ServerPerMessageDeflateFactory):
        def process_request_params(self, params, accepted_extensions):
            response, extension = super().process_request_params(params, accepted_extensions)
            decode = extension.decode

            def recorded(frame, **kwargs):
                if frame.opcode in (Opcode.TEXT, Opcode.CONT):
                    flags.append((frame.opcode.name, frame.rsv1))
                return decode(frame, **kwargs)

            extension.decode = recorded
            return response, extension

    received: list[bytes] = []

    async def handler(ws) -> None:
        async for message in ws:
            received.append(message.encode())

    small = json.dumps({"type": "response.create", "input": [{"role": "user", "content": "hi " * 100}]}).encode()
    large = json.dumps({"type": "response.create", "input": "x" * (COMPRESS_UP_TO + 1)}).encode()
    huge = json.dumps({"type": "response.create", "input": "y" * 2 * FRAGMENT})[:2 * FRAGMENT + 1].encode()
    async with serve(handler, "127.0.0.1", 0, extensions=[Recording()], max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        target = Target(f"ws://127.0.0.1:{port}/v1/responses", "127.0.0.1", "127.0.0.1", port, ())
        upstream = await open_socket(target, TLSOptions())
        for message in (small, large, huge, small):
            await upstream.send(message)
        await upstream.close()
    assert received == [small, large, huge, small]
    assert flags == [("TEXT", True), ("TEXT", False), ("TEXT", False), ("CONT", False), ("CONT", False),
                     ("CONT", False), ("TEXT", True)]


# -- the relay --------------------------------------------------------------------------------------


class Writer:
    """What mitmproxy reads from the loopback server."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.aborted = False
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True


class Scripted:
    """A socket that answers each message with the next script: a list of
    events (dicts), ending early with ``CLOSE`` to drop the connection or
    ``STALL`` to send nothing more; a number is a pause of that many seconds."""

    CLOSE = object()
    STALL = object()

    def __init__(self, *scripts: list) -> None:
        self.scripts = list(scripts)
        self.sent: list[dict] = []
        self.queue: list = []
        self.open = True
        self.closed_by_us = False

    async def send(self, message: bytes) -> None:
        if not self.open:
            raise ConnectionClosedError(None, None)
        self.sent.append(json.loads(message))
        self.queue = list(self.scripts.pop(0))

    async def recv(self) -> bytes:
        await asyncio.sleep(0)
        while self.queue and isinstance(self.queue[0], float):
            await asyncio.sleep(self.queue.pop(0))
        if self.queue and self.queue[0] is Scripted.STALL:
            await asyncio.Event().wait()  # pings would still be answered: only the turn is silent
        if not self.queue or self.queue[0] is Scripted.CLOSE:
            self.open = False
            raise ConnectionClosedError(None, None)
        return json.dumps(self.queue.pop(0)).encode()

    def close_soon(self) -> None:
        self.open, self.closed_by_us = False, True

    def abort(self) -> None:
        self.open = False


def answered(response_id="resp_2", previous=None, output=OUTPUT) -> list[dict]:
    shell = {"id": response_id, "status": "in_progress", "output": [], "previous_response_id": previous}
    return [{"type": "response.created", "response": shell},
            {"type": "response.output_item.done", "output_index": 0, "item": output[0]},
            {"type": "response.completed", "response": {**shell, "status": "completed", "output": output}}]


def refusal(status: int, code: str) -> list[dict]:
    return [{"type": "error", "status": status, "error": {"type": "invalid_request_error", "code": code,
                                                         "message": "no", "param": None}}]


async def run(*sockets: Scripted, streamed: bool = False, continued: bool = True, http=(200, [], b"{}"),
              first_event_s: float = 5.0, silence_s: float = 5.0, built: list | None = None, gone: bool = False):
    """A turn through ``relay``: the first socket is held, later ones open as needed; ``built`` is
    given one entry each time the message with the whole input is made; ``gone``: mitmproxy has
    closed the loopback connection (its client went away)."""
    p, _ = pool()
    choice = p.choose("s", ROOT, digests(HISTORY), {})
    p.opened(choice.held, sockets[0])
    spare = list(sockets[1:])
    over_http: list[bool] = []
    settled = []

    async def open_socket():
        if not spare:
            raise Refused(404)
        return spare.pop(0)

    async def fall_back(outcome):
        over_http.append(True)
        return http

    history = HISTORY + OUTPUT + [{"role": "user", "content": "next"}]
    body, reading = read({"model": "m", "input": history, **({"stream": True} if streamed else {})})
    def whole() -> bytes:
        if built is not None:
            built.append(True)
        return socket_message(body, reading.fields)

    turn = Turn(streamed, ROOT, digests(history), whole, len(history), open_socket, fall_back, settled.append,
                first_event_s, silence_s)
    if continued:
        turn.continued, turn.items_sent = tip_of(), 1
        turn.delta_message = socket_message(body, reading.fields, reading.raw_items[3:], "resp_1")
    writer, reader = Writer(), asyncio.StreamReader()
    if gone:
        reader.feed_eof()
    outcome = await relay(turn, choice.held, p, Answer(writer, reader))
    assert settled == [outcome]
    return outcome, bytes(writer.data), choice.held, bool(over_http)


async def test_a_continued_json_turn_answers_the_terminal_response_and_remembers_it():
    socket, built = Scripted(answered(previous="resp_1")), []
    outcome, data, held, http = await run(socket, built=built)
    assert socket.sent[0]["previous_response_id"] == "resp_1" and len(socket.sent[0]["input"]) == 1
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-type: application/json" in head
    assert json.loads(body)["id"] == "resp_2" and not http
    assert (outcome.transport, outcome.previous_response_id, outcome.items_sent) == ("websocket", "resp_1", 1)
    assert held.tip.response_id == "resp_2" and held.tip.length == 4 + len(OUTPUT) and not held.busy
    assert not built  # a long history's copy, never sent: never made on the event loop


async def test_a_json_client_gets_the_output_a_terminal_event_left_empty_from_the_done_events():
    """As the HTTP API's JSON answer would hold it (forward mode reads such streams alike)."""
    events = answered(previous="resp_1")
    events[-1] = {**events[-1], "response": {**events[-1]["response"], "output": []}}
    events[1:2] = [{"type": "response.output_item.done", "output_index": i, "item": item}
                   for i, item in enumerate(OUTPUT)]
    _, data, held, _ = await run(Scripted(events))
    answer = json.loads(data.partition(b"\r\n\r\n")[2])
    assert answer["output"] == OUTPUT and answer["id"] == "resp_2" and answer["status"] == "completed"
    assert held.tip.length == 4 + len(OUTPUT)


async def test_a_streamed_turn_relays_every_event_as_sse_chunks():
    _, data, held, _ = await run(Scripted(answered(previous="resp_1")), streamed=True)
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: text/event-stream" in head and b"transfer-encoding: chunked" in head
    assert body.count(b"event: ") == 3 and body.endswith(b"0\r\n\r\n") and held.tip.response_id == "resp_2"


async def test_a_socket_that_closes_before_the_first_event_is_replaced_and_the_turn_sent_whole():
    broken, fresh, built = Scripted([Scripted.CLOSE]), Scripted(answered()), []
    outcome, data, held, http = await run(broken, fresh, built=built)
    assert "previous_response_id" not in fresh.sent[0] and len(fresh.sent[0]["input"]) == 4
    assert held.connection is fresh and outcome.previous_response_id is None and outcome.retries and not http
    assert built == [True]  # made once the retry needs it
    assert b"200 OK" in data


@pytest.mark.parametrize("code", ["previous_response_not_found", "websocket_connection_limit_reached",
                                  "conversation_already_has_active_response"])
async def test_a_state_error_sends_the_turn_whole_and_the_client_never_hears_of_it(code):
    first = Scripted(refusal(400, code), answered())
    second = Scripted(answered())
    outcome, data, _, http = await run(first, second)
    retried = (first if code == "previous_response_not_found" else second).sent[-1]  # busy or spent: a fresh one
    assert "previous_response_id" not in retried and len(retried["input"]) == 4
    assert first.closed_by_us is (code != "previous_response_not_found")
    assert b"200 OK" in data and not http and outcome.retries


async def test_a_refusal_of_the_clients_own_request_goes_over_http_whose_answer_is_the_clients():
    outcome, data, held, http = await run(Scripted(refusal(400, "unsupported_parameter")), continued=False,
                                          http=(400, [(b"content-type", b"application/json")], b'{"error": 1}'))
    assert http and outcome.transport == "http" and data.startswith(b"HTTP/1.1 400") and data.endswith(b'{"error": 1}')
    assert held.tip is None and held.open  # the socket is fine: back in the pool, remembering nothing


@pytest.mark.parametrize("status,continued", [(429, True), (503, True), (500, False)])
async def test_a_rate_limit_or_server_error_reaches_the_client_as_that_status(status, continued):
    outcome, data, _, http = await run(Scripted(refusal(status, "x")), continued=continued)
    assert data.startswith(f"HTTP/1.1 {status}".encode()) and not http and outcome.status == status


async def test_a_server_error_to_a_continuation_is_retried_whole_as_forward_mode_retries_its_changes():
    """A 500 to a continuation (a request the bridge changed) goes again with the whole history, as
    forward mode sends a changed request's original body again: invisibly, and no verdict."""
    socket = Scripted(refusal(500, "server_error"), answered())
    outcome, data, _, http = await run(socket)
    assert "previous_response_id" not in socket.sent[-1] and len(socket.sent[-1]["input"]) == 4
    assert outcome.status == 200 and not http and outcome.previous_response_id is None
    assert outcome.refused_continuation is None and data.startswith(b"HTTP/1.1 200")


async def test_a_continuation_that_does_not_echo_its_previous_id_is_never_relayed():
    socket = Scripted(answered(previous=None))
    outcome, data, held, http = await run(socket, streamed=True)
    assert outcome.unverified and http and outcome.transport == "http" and b"event:" not in data
    assert not socket.open and held.retired


async def test_after_the_client_has_bytes_a_broken_socket_breaks_its_stream():
    events = answered(previous="resp_1")
    outcome, data, held, http = await run(Scripted(events[:2] + [Scripted.CLOSE]), streamed=True)
    assert outcome.dropped and not http and data.count(b"event: ") == 2 and not data.endswith(b"0\r\n\r\n")
    assert held.retired


async def test_a_refused_reopening_goes_over_http_and_says_so():
    outcome, _, held, http = await run(Scripted([Scripted.CLOSE]))
    assert http and outcome.refused_upgrade == 404 and held.retired


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
async def test_no_first_event_within_its_bound_drops_the_socket_and_goes_over_http(streamed):
    silent, spare = Scripted([Scripted.STALL]), Scripted(answered())
    outcome, data, held, http = await run(silent, spare, streamed=streamed, first_event_s=0.05)
    assert http and outcome.transport == "http" and outcome.retries == ["no event within 0.05 s"]
    assert not silent.open and held.retired and not spare.sent  # over HTTP at once, not on another socket
    assert data.startswith(b"HTTP/1.1 200") and b"event:" not in data


async def test_a_client_gone_before_its_answer_has_nothing_sent_over_http_for_it():
    outcome, data, held, http = await run(Scripted([Scripted.STALL]), first_event_s=0.05, gone=True)
    assert not http and outcome.abandoned and outcome.retries == ["no event within 0.05 s"] and not data
    assert held.retired


async def test_a_json_client_has_no_byte_before_the_end_so_a_silence_mid_answer_goes_over_http():
    events = answered(previous="resp_1")
    outcome, data, held, http = await run(Scripted(events[:2] + [Scripted.STALL]), silence_s=0.05)
    assert http and outcome.retries == ["no event within 0.05 s"] and outcome.dropped is None and held.retired


async def test_a_silence_after_the_client_has_bytes_breaks_its_stream():
    events = answered(previous="resp_1")
    outcome, data, held, http = await run(Scripted(events[:2] + [Scripted.STALL]), streamed=True, silence_s=0.05)
    assert outcome.dropped == "the socket fell silent for 0.05 s" and not http and data.count(b"event: ") == 2
    assert not data.endswith(b"0\r\n\r\n") and held.retired


async def test_a_silence_within_the_bounds_is_waited_out():
    events = answered(previous="resp_1")
    socket = Scripted([0.1, *events[:2], 0.2, events[2]])
    outcome, data, held, http = await run(socket, streamed=True, first_event_s=0.15, silence_s=0.25)
    assert not http and outcome.dropped is None and not outcome.retries and data.endswith(b"0\r\n\r\n")
    assert held.tip.response_id == "resp_2"


# -- the glue, in-process with mitmproxy's test helpers ----------------------------------------------


def bridgeable_flow(url: str, body: dict, mode: str = "regular", host_header: str | None = None) -> tflow.HTTPFlow:
    parts = urlsplit(url)
    headers = [(b"authorization", b"Bearer sk-glue"), (b"proxy-authorization", b"Basic dXNlcjpwYXNz"),
               (b"user-agent", b"glue-test"), (b"content-type", b"application/json")]
    req = tutils.treq(method=b"POST", scheme=parts.scheme.encode(), host=parts.hostname,
                      port=parts.port or (443 if parts.scheme == "https" else 80),
                      path=(parts.path + (f"?{parts.query}" if parts.query else "")).encode(),
                      content=json.dumps(body).encode(), headers=headers)
    if host_header is not None:
        req.host_header = host_header
    flow = tflow.tflow(req=req)
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def test_in_transparent_mode_the_socket_goes_to_the_address_under_the_host_headers_name():
    flow = bridgeable_flow("https://10.1.2.3:443/v1/responses?api-version=1", {}, "transparent",
                           host_header="api.example.test")
    target = target_of(flow.request)
    assert (target.url, target.server_name, target.host, target.port) == (
        "wss://api.example.test/v1/responses?api-version=1", "api.example.test", "10.1.2.3", 443)
    assert dict(target.headers) == {"authorization": "Bearer sk-glue", "user-agent": "glue-test"}  # no proxy auth
    ipv6 = target_of(bridgeable_flow("http://[fd00::5]:8080/v1/responses", {}, "transparent",
                                     host_header="[fd00::5]:8080").request)
    assert (ipv6.url, ipv6.host, ipv6.port) == ("ws://[fd00::5]:8080/v1/responses", "fd00::5", 8080)  # no name
    named = bridgeable_flow("https://api.example.test/v1/responses", {}, "regular", host_header="elsewhere.test")
    assert target_of(named.request).url == "wss://api.example.test/v1/responses"  # a name is never replaced


async def test_a_bridged_flow_is_let_go_once_its_answer_is_done(emulator):
    """The bridge's job refers to its flow: a flow mitmproxy is done with must not be kept for it."""
    from test_addon import Glue

    async with Glue(stateful_upstream_websocket="auto") as addon:
        bridge, done, hooks_of = addon.bridge, [], addon.tctx.master.addons.invoke_addon
        history: list = []
        for n in range(3):
            history.append({"role": "user", "content": f"glue turn {n}"})
            flow = bridgeable_flow(emulator.url + "/v1/responses", {"model": "m", "store": False, "input": history})
            await hooks_of(bridge, HttpRequestHook(flow))
            assert flow.request.host == "127.0.0.1" and len(bridge._flows) == 1
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:  # as mitmproxy fetches it
                answer = await client.post(flow.request.url, content=b"")
            flow.response = http.Response.make(answer.status_code, answer.content, dict(answer.headers))
            await hooks_of(bridge, HttpResponseHeadersHook(flow))
            assert flow.request.url == emulator.url + "/v1/responses"
            await hooks_of(bridge, HttpResponseHook(flow))  # mitmproxy is done with the flow
            history += answer.json()["output"]
            done.append(weakref.ref(flow))
        del flow
        gc.collect()
        assert len(bridge._flows) == 0 and [ref() for ref in done] == [None] * 3
        log = emulator.model.snapshot_log()
        assert [r["transport"] for r in log] == ["websocket"] * 3
        assert [r["continued"] for r in log] == [False, True, True]


async def test_in_transparent_mode_two_names_at_one_address_never_share_a_socket(emulator):
    """One address may serve several hosts (a provider's regional names, a cloud's shared front end), and one
    credential may reach them all: a turn for one name never goes over a socket opened to another."""
    from test_addon import Glue

    async with Glue(stateful_upstream_websocket="auto") as addon:
        bridge, hooks_of = addon.bridge, addon.tctx.master.addons.invoke_addon
        history: list = [{"role": "user", "content": "one address, two names"}]
        for name in ("localhost", "alias.example.test"):
            flow = bridgeable_flow(f"http://127.0.0.1:{emulator.port}/v1/responses",
                                   {"model": "m", "store": False, "input": history}, "transparent",
                                   host_header=f"{name}:{emulator.port}")
            await hooks_of(bridge, HttpRequestHook(flow))
            assert flow.metadata[BRIDGED]["action"] == "full"  # the second extends the first: on its socket no more
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                answer = await client.post(flow.request.url, content=b"")
            flow.response = http.Response.make(answer.status_code, answer.content, dict(answer.headers))
            await hooks_of(bridge, HttpResponseHeadersHook(flow))
            await hooks_of(bridge, HttpResponseHook(flow))
            history += [*answer.json()["output"], {"role": "user", "content": "and the other name?"}]
        assert len(bridge.pool) == 2
        assert [r["continued"] for r in emulator.model.snapshot_log()] == [False, False]


def test_a_live_conversation_stored_upstream_gives_its_socket_where_stored_responses_are_read_back():
    """Its next turn goes on from storage on any socket; a memory only its socket holds (store: false) is kept."""
    p, clock = pool(max_per_scope=2)
    stored = opened(p, tip=tip_of({**RESPONSE, "id": "resp_stored", "store": True}))
    clock.now += 1
    memory_only = opened(p, tip=tip_of({**RESPONSE, "id": "resp_memory", "store": False}))
    assert (stored.tip.stored, memory_only.tip.stored) == (True, False)
    newcomer = digests([{"role": "user", "content": "another conversation"}])
    assert p.choose("s", ROOT, newcomer, {}) == Declined("live")  # not proven readable: both kept
    choice = p.choose("s", ROOT, newcomer, {}, hydrates=True)
    assert choice.held is stored and choice.continued is None
    p.release(choice.held, None)
    p.release(p.choose("s", ROOT, newcomer, {}).held, tip_of({**RESPONSE, "id": "resp_2"}))  # store unsaid
    assert p.choose("s", ROOT, digests([{"role": "user", "content": "a third"}]), {}, hydrates=True) \
        == Declined("live")
