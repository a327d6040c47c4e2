"""The mitmproxy glue, in-process, with mitmproxy's own test helpers."""

from __future__ import annotations

import asyncio
import json
import runpy
import sys

import pytest
from harness import ADDON
from mitmproxy.test import taddons, tflow, tutils
from stateful_responses.client_websocket.addon import ClientWebSocket
from stateful_responses.compaction.addon import Compaction
from stateful_responses.forward.addon import ForwardMode
from stateful_responses.options import Options
from stateful_responses.pipeline import make_addons
from stateful_responses.record.addon import ContinuationRecord
from stateful_responses.replays import Replays
from stateful_responses.request_encoding.addon import DecodedRequests, EncodedRequests
from stateful_responses.router.addon import Router
from stateful_responses.state.addon import StateStore
from stateful_responses.store_emulation.addon import ConversationEmulation, StoreEmulation
from stateful_responses.websocket.addon import WebSocketBridge
from stateful_responses.flows import DECISION
from stateful_responses.state.storage import StorageError
from stateful_responses.store_emulation.turns import DEPENDENTS, ITEMS

UPSTREAM_OUTPUT = [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "hi!", "annotations": []}]}]


def responses_flow(body: dict | bytes, answer: dict | None = None) -> tflow.HTTPFlow:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = tutils.treq(method=b"POST", scheme=b"https", host="api.example.test", port=443,
                      path=b"/v1/responses", content=content,
                      headers=[(b"authorization", b"Bearer sk-x"), (b"content-type", b"application/json")])
    resp: bool | object = False
    if answer is not None:
        resp = tutils.tresp(status_code=200, content=json.dumps(answer).encode(),
                            headers=[(b"content-type", b"application/json")])
    return tflow.tflow(req=req, resp=resp)


class Glue:
    """The addons as the entry script lists them, in mitmproxy's test context,
    with an in-memory store and, as the harness's mitmdump, the WebSocket
    bridge off unless a test turns it on."""

    def __init__(self, **options) -> None:
        self.addons = make_addons()
        one = {type(addon): addon for addon in self.addons}  # each capability's addon, wherever the pipeline puts it
        self.options, self.state, self.decoding, self.record, self.router = (
            one[Options], one[StateStore], one[DecodedRequests], one[ContinuationRecord], one[Router])
        self.conversations, self.emulation, self.compaction = one[ConversationEmulation], one[StoreEmulation], one[Compaction]
        self.bridge, self.forward, self.encoding = one[WebSocketBridge], one[ForwardMode], one[EncodedRequests]
        self.client_websocket, self.replays = one[ClientWebSocket], one[Replays]
        self.planner = self.forward.planner
        self._options = {"stateful_store": "memory", "stateful_upstream_websocket": "off", **options}
        # The proof's GET goes through mitmproxy's replay, which needs a running
        # proxy (the integration tests send it for real): here it succeeds at once.
        self.forward.proofs.start = lambda flow, scope, label, upstream, response_id: \
            self.planner.upstreams.mark("reads_back", scope)

    async def __aenter__(self):
        self._context = taddons.context(*self.addons)
        self.tctx = self._context.__enter__()
        self.tctx.configure(self.options, **self._options)
        self.state.running()
        for _ in range(200):  # the store connects in the background
            if self.state.up:
                break
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc) -> None:
        self.state.done()
        self._context.__exit__(*exc)

    async def request(self, flow) -> None:
        await self.forward.request(flow)

    async def request_through_all(self, flow) -> None:
        """Every addon's request hook, in order (the record needs its own)."""
        await self.record.request(flow)
        await self.emulation.request(flow)
        await self.forward.request(flow)

    def responseheaders(self, flow) -> None:
        self.forward.responseheaders(flow)

    async def response(self, flow) -> None:
        await self.forward.response(flow)


def stream_through(addon, flow, data: bytes, chunk: int = 7) -> bytes:
    """What the client receives when ``data`` streams through the addon's tap."""
    addon.responseheaders(flow)
    out = b""
    for i in range(0, len(data), chunk):
        out += flow.response.stream(data[i:i + chunk])
    return out + flow.response.stream(b"")


async def test_a_conversation_is_continued_and_traced_on_the_flow(caplog):
    caplog.set_level("INFO")
    async with Glue(stateful_debug=True) as addon:

        first = [{"role": "user", "content": "hello"}]
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        f = responses_flow({"model": "m", "input": first}, answer)
        await addon.request(f)
        assert json.loads(f.request.content)["store"] is True
        assert f.request.headers["content-length"] == str(len(f.request.raw_content))
        stream_through(addon, f, json.dumps(answer).encode())
        await addon.response(f)
        assert f.metadata[DECISION]["outcome"] == "advanced"

        second = first + UPSTREAM_OUTPUT + [{"role": "user", "content": "again"}]
        f2 = responses_flow({"model": "m", "input": second, "tools": []})
        await addon.request(f2)
        sent = json.loads(f2.request.content)
        assert sent == {"model": "m", "input": second[-1:], "tools": [], "previous_response_id": "resp_1", "store": True}
        assert f2.comment == "continued from resp_1: 1 of 3 items sent"
        assert f2.metadata[DECISION]["action"] == "continue"
        assert "rewritten m: 3 items, 1 new, previous resp_1" in caplog.text


async def test_the_tap_passes_every_byte_unchanged_even_when_reading_fails():
    async with Glue() as addon:
        f = responses_flow({"model": "m", "input": "hello"}, {})
        f.response.headers["content-type"] = "text/event-stream"
        await addon.request(f)
        garbage = b"data: {\xff\xfe broken\r\n\r\n" * 100 + b"\x00" * 1000
        assert stream_through(addon, f, garbage) == garbage
        await addon.response(f)
        assert f.metadata[DECISION]["outcome"] == "dropped"


async def test_an_internal_error_lets_the_original_request_through(monkeypatch, caplog):
    async with Glue() as addon:
        body = json.dumps({"model": "m", "input": "secret prompt text"}).encode()
        f = responses_flow(body)

        def explode(*args, **kwargs):
            raise KeyError("secret prompt text")

        monkeypatch.setattr(addon.planner, "plan", explode)
        await addon.request(f)
        assert f.request.raw_content == body
        assert addon.planner.counters.errors == 1
        assert "internal error (KeyError" in caplog.text
        assert "secret prompt text" not in caplog.text


async def test_other_traffic_is_not_touched_and_leaves_no_trace():
    async with Glue() as addon:
        f = tflow.tflow(req=tutils.treq(method=b"POST", path=b"/v1/chat/completions",
                                        content=b'{"model": "m", "messages": []}'))
        await addon.request(f)
        assert DECISION not in f.metadata and not f.comment
        assert f.request.content == b'{"model": "m", "messages": []}'


async def test_disabled_touches_nothing():
    async with Glue(stateful_enabled=False) as addon:

        f = responses_flow({"model": "m", "input": "hello"})
        before = f.request.raw_content
        await addon.request(f)
        assert f.request.raw_content == before and DECISION not in f.metadata


async def test_commands_stats_and_clear():
    async with Glue() as addon:
        commands = addon.tctx.master.commands
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        f = responses_flow({"model": "m", "input": "hello"}, answer)
        await addon.request(f)
        await addon.response(f)
        stats = commands.call("stateful.stats")
        assert "requests=1" in stats and "branches=1" in stats
        commands.call("stateful.clear")
        assert "branches=0" in commands.call("stateful.stats")


def test_reloading_the_entry_script_reloads_the_package():
    first = runpy.run_path(str(ADDON))
    module_before = sys.modules["stateful_responses.pipeline"]
    second = runpy.run_path(str(ADDON))
    assert sys.modules["stateful_responses.pipeline"] is not module_before
    assert type(first["addons"][0]) is not type(second["addons"][0])


@pytest.mark.parametrize("value", ["0", "-3", "many"])
async def test_configure_rejects_bad_values_in_process(value):
    from mitmproxy import exceptions

    async with Glue() as addon:
        with pytest.raises(exceptions.OptionsError, match="stateful_max_chains"):
            addon.tctx.options.deferred["stateful_max_chains"] = value
            addon.options._errors = addon.options._prevalidate(addon.tctx.options)
            addon.tctx.configure(addon.options)


def rendered(flow) -> tuple[str, str]:
    """(view name, text) as mitmproxy itself renders the request body in "auto" mode."""
    from mitmproxy import contentviews

    if hasattr(contentviews, "prettify_message"):  # mitmproxy 12
        result = contentviews.prettify_message(flow.request, flow, "auto")
        return result.view_name, result.text
    description, lines, _ = contentviews.get_message_content_view("auto", flow.request, flow)
    return description, "\n".join("".join(text for _, text in line) for line in lines)


async def test_mitmweb_view_shows_the_decision_and_both_bodies():
    async with Glue() as addon:
        addon.request = addon.request_through_all
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        f = responses_flow({"model": "m", "input": [{"role": "user", "content": "hello"}]}, answer)
        await addon.request(f)
        await addon.response(f)
        f2 = responses_flow({"model": "m", "input": [{"role": "user", "content": "hello"}] + UPSTREAM_OUTPUT
                             + [{"role": "user", "content": "again"}]})
        await addon.request(f2)
        name, text = rendered(f2)
        assert name == "Stateful Responses"
        assert "decision: continue (extends resp_1)" in text
        assert "--- client sent" in text and "--- sent upstream" in text
        assert text.index('"again"') < text.index("--- sent upstream") < text.rindex('"again"')
        assert f2.marked == ":recycle:" and f.marked == ":arrow_right:"
        assert "--- continuation record ---" in text and f2.metadata["continuation"]["chainId"] in text
        other = tflow.tflow()
        assert rendered(other)[0] != "Stateful Responses"


@pytest.mark.parametrize("kind", ["sse", "json"])
async def test_the_store_learns_before_the_last_bytes_reach_the_client(kind):
    """A fast agent's next request can arrive before the response hook runs;
    it must already find this answer stored."""
    from stateful_responses.emulator import sse_events

    async with Glue() as addon:
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        f = responses_flow({"model": "m", "input": "hello"}, answer)
        if kind == "sse":
            f.response.headers["content-type"] = "text/event-stream"
            data = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in sse_events(answer)).encode()
        else:
            data = json.dumps(answer).encode()
            f.response.headers["content-length"] = str(len(data))
        await addon.request(f)
        addon.responseheaders(f)
        assert f.response.stream(data) == data  # the last bytes, on their way to the client
        nxt = responses_flow({"model": "m", "input": [{"role": "user", "content": "hello"}] + UPSTREAM_OUTPUT
                              + [{"role": "user", "content": "next"}]})
        await addon.request(nxt)  # before f's stream ended and before its response hook
        assert nxt.metadata[DECISION]["action"] == "continue"
        f.response.stream(b"")
        await addon.response(f)
        assert f.metadata[DECISION]["outcome"] == "advanced"


async def test_clear_forgets_in_memory_and_in_the_store(tmp_path):
    from stateful_responses.continuation.prefixes import ENTRIES

    async with Glue(stateful_store=f"sqlite:{tmp_path / 'state.db'}") as addon:
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        f = responses_flow({"model": "m", "input": "hello"}, answer)
        await addon.request(f)
        await addon.response(f)
        await addon.state.written(addon.state.flush())
        for _ in range(100):
            if await addon.state.storage.scan(ENTRIES):
                break
            await asyncio.sleep(0.01)
        assert await addon.state.storage.scan(ENTRIES)
        addon.tctx.master.commands.call("stateful.clear")
        for _ in range(100):
            if not await addon.state.storage.scan(ENTRIES):
                break
            await asyncio.sleep(0.01)
        assert not await addon.state.storage.scan(ENTRIES)
        assert "branches=0" in addon.tctx.master.commands.call("stateful.stats")


def test_once_mitmproxy_runs_its_startup_objects_leave_the_collectors_passes():
    import gc

    from stateful_responses.heap import FrozenStartupHeap

    startup = [["an option tree"]]  # lists are always tracked
    assert any(o is startup for o in gc.get_objects())
    try:
        FrozenStartupHeap().running()
        assert not any(o is startup for o in gc.get_objects()), "walked by no later pass"
    finally:
        gc.unfreeze()
    assert any(o is startup for o in gc.get_objects())


async def test_clear_erases_the_conversations_the_proxy_keeps(tmp_path):
    from stateful_responses.store_emulation.conversations import CONVERSATIONS

    def conversations_flow(method: bytes, path: bytes, body: bytes = b"") -> tflow.HTTPFlow:
        return tflow.tflow(req=tutils.treq(method=method, scheme=b"https", host="api.example.test", port=443,
                                           path=path, content=body,
                                           headers=[(b"authorization", b"Bearer sk-x")]))

    async with Glue(stateful_store=f"sqlite:{tmp_path / 'state.db'}", stateful_emulate="always",
                    stateful_base_urls=["https://api.example.test/v1"]) as addon:
        created = conversations_flow(b"POST", b"/v1/conversations", b'{"items": [{"role": "user", "content": "x"}]}')
        await addon.conversations.request(created)
        conversation_id = json.loads(created.response.content)["id"]
        assert await addon.state.storage.scan(CONVERSATIONS)
        addon.tctx.master.commands.call("stateful.clear")
        for _ in range(100):
            if not await addon.state.storage.scan(CONVERSATIONS):
                break
            await asyncio.sleep(0.01)
        assert not await addon.state.storage.scan(CONVERSATIONS)
        listed = conversations_flow(b"GET", f"/v1/conversations/{conversation_id}/items".encode())
        await addon.conversations.request(listed)
        assert listed.response.status_code == 404  # gone from memory and from the store


def resource_flow(method: bytes, path: bytes) -> tflow.HTTPFlow:
    return tflow.tflow(req=tutils.treq(method=method, scheme=b"https", host="api.example.test", port=443, path=path,
                                       content=b"", headers=[(b"authorization", b"Bearer sk-x")]))


async def test_a_store_outage_while_answering_from_the_record_sends_the_request_upstream(monkeypatch, caplog):
    async with Glue(stateful_emulate="always") as addon:
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        made = responses_flow({"model": "m", "input": "hello"})
        await addon.emulation.request(made)
        made.response = tutils.tresp(status_code=200, content=json.dumps(answer).encode(),
                                     headers=[(b"content-type", b"application/json")])
        await addon.emulation.response(made)
        for _ in range(100):  # until the writer task has written it
            got = resource_flow(b"GET", b"/v1/responses/resp_1")
            await addon.emulation.request(got)
            if got.response is not None:
                break
            await asyncio.sleep(0.01)
        assert got.response.status_code == 200  # the record answers while the store does
        addon.emulation.history.items.clear()  # another replica's, or a restart's, memory
        real = addon.state.get_strict

        async def items_unreachable(table, keys):
            if table in (ITEMS, DEPENDENTS):
                raise StorageError("read timed out")
            return await real(table, keys)

        monkeypatch.setattr(addon.state, "get_strict", items_unreachable)
        for path in (b"/v1/responses/resp_1", b"/v1/responses/resp_1/input_items"):
            flow = resource_flow(b"GET", path)
            await addon.emulation.request(flow)
            assert flow.response is None and not flow.comment  # the upstream's to answer
            assert addon.emulation.counters.errors == 0  # an outage, not an internal error
        deleting = resource_flow(b"DELETE", b"/v1/responses/resp_1")
        await addon.emulation.request(deleting)
        assert deleting.response is None  # goes upstream, which deletes its copy
        deleting.response = tutils.tresp(status_code=200, content=b'{"id": "resp_1", "deleted": true}')
        addon.emulation.responseheaders(deleting)
        await addon.emulation.response(deleting)
        assert deleting.response.status_code == 503  # the record's copy may live on: never answered as done
        assert addon.emulation.counters.errors == 0 and "internal error" not in caplog.text


async def test_a_long_running_responses_plan_outlives_many_other_flows():
    async with Glue(stateful_emulate="always") as addon:
        emulation = addon.emulation
        answer = {"id": "resp_1", "status": "completed", "store": True, "output": UPSTREAM_OUTPUT}
        first = responses_flow({"model": "m", "input": "hello"})
        await emulation.request(first)
        first.response = tutils.tresp(status_code=200, content=json.dumps(answer).encode(),
                                      headers=[(b"content-type", b"application/json")])
        await emulation.response(first)
        slow = responses_flow({"model": "m", "input": "and then?", "previous_response_id": "resp_1"})
        await emulation.request(slow)  # expanded; its answer takes a long while
        assert json.loads(slow.request.content)["input"][0] == {"role": "user", "content": "hello"}
        others = []
        for n in range(10_001):  # in flight meanwhile, then done: more than the old count bound kept
            other = responses_flow({"model": "m", "input": f"other {n}"})
            await emulation.request(other)
            others.append(other)
        for other in others:
            other.response = tutils.tresp(status_code=500, content=b"{}")
            await emulation.response(other)
        del others
        slow.response = tutils.tresp(status_code=200, headers=[(b"content-type", b"application/json")],
                                     content=json.dumps({**answer, "id": "resp_2"}).encode())
        await emulation.response(slow)
        for _ in range(100):  # until the writer task has written it
            got = resource_flow(b"GET", b"/v1/responses/resp_2")
            await emulation.request(got)
            if got.response is not None:
                break
            await asyncio.sleep(0.01)
        assert got.response is not None, "resp_2 was never recorded: its plan was dropped"
        assert json.loads(got.response.content)["previous_response_id"] == "resp_1"  # recorded as its plan said
