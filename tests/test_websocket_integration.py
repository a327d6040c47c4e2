"""The WebSocket bridge through a real mitmdump: full-history HTTP clients
(the openai SDK, openai-agents) continued over a socket the proxy holds to
the emulator's WebSocket mode, ``store: false`` kept, every fault invisible
before a byte reached the client, bounds, and a client's own WebSocket passing
through untouched. Every test compares, request by request, what the model
saw with what the client meant."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import sqlite3
import threading
import time
from pathlib import Path

import openai
import pytest
import websockets.sync.client
from driver import (
    Conversation,
    assert_context_preserved,
    drop_nulls,
    expand_input,
    httpx,
    recording_clients,
    user_turns,
    weather_agent,
    without_comparisons,
)
from mitmproxy import io as flow_io
from stateful_responses.view import render
from stateful_responses.websocket.addon import UNCLAIMED_S
from stateful_responses.websocket.connect import FRAGMENT
from stateful_responses.websocket.messages import sse_event

AUTH = {"authorization": "Bearer sk-test-key"}
SOCKET_FAULTS = ("ws_close", "ws_error", "ws_stall")


@pytest.fixture
def bridge(emulator, start_proxy, tmp_path):
    """mitmdump with the bridge on (debug and the record file too) in front of the emulator."""
    def start(*extra: str, upstream: str | None = None, **options):
        return start_proxy(upstream or emulator.url, "--set", "stateful_debug=true",
                           "--set", f"stateful_record_file={tmp_path / 'record.jsonl'}", *extra,
                           upstream_websocket="auto", **options)
    return start


def records(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def reached_the_client(emulator) -> list[dict]:
    """The upstream's answers the client got: not the turns a socket fault cut, nor refusals retried."""
    return [r for r in records(emulator) if r.get("fault") not in SOCKET_FAULTS and r.get("status_code") == 200]


def record_lines(tmp_path, count: int) -> list[dict]:
    """The record file's lines, once there are ``count`` (a thread of its own writes them)."""
    lines: list[dict] = []
    for _ in range(100):
        path = tmp_path / "record.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= count:
            break
        time.sleep(0.05)
    return lines


def converse(conv: Conversation, turns: int, tag: str = "") -> None:
    try:
        for text in user_turns(turns, tag):
            conv.turn(text)
    finally:
        conv.close()


# -- full-history clients, store: false, over one socket --------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_openai_sdk_over_twelve_tool_turns_is_continued_on_one_socket_with_store_false(
        emulator, bridge, tmp_path, stream):
    proxy = bridge()
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    converse(conv, 12)
    log = records(emulator)
    assert len(conv.sent) >= 16  # 12 turns and their tool loops
    assert_context_preserved(conv.sent, log)
    assert [r["transport"] for r in log] == ["websocket"] * len(log)
    assert len({r["socket"] for r in log}) == 1
    assert [r["continued"] for r in log] == [False] + [True] * (len(log) - 1)
    assert all(r["store"] is False and r["stored"] is False for r in log)  # never forced, nothing retained
    assert all(r["input_items"] <= 2 for r in log[1:])  # the new items only
    assert sum(r["body_bytes"] for r in log) < sum(s.size for s in conv.sent) / 3
    lines = record_lines(tmp_path, len(conv.sent))
    assert len(lines) == len(conv.sent) and len({line["continuation"]["chainId"] for line in lines}) == 1
    assert all(line["transport"] == {"client": "http", "upstream": "websocket"} for line in lines)
    assert all(line["continuation"]["restored"] for line in lines[1:])
    audit = [entry["reason"] for entry in lines[-1]["audit"]["protocolMapping"]["preserved"]]
    assert any(reason.startswith("continued over the upstream's WebSocket from resp_") for reason in audit)
    assert "ws: continued from resp_" in proxy.output() and "forced" not in proxy.output()


def test_a_turn_larger_than_a_frame_reaches_the_upstream_whole_and_is_continued(emulator, bridge):
    """A message over a megabyte goes in several frames (the event loop masks and writes one at a time)."""
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    conv.history.append({"role": "user", "content": "a long document: " + "lorem ipsum " * 250_000})
    converse(conv, 2)
    log = records(emulator)
    assert conv.sent[0].size > 2 * FRAGMENT
    assert_context_preserved(conv.sent, log)
    assert [(r["transport"], r["continued"]) for r in log] == [("websocket", False)] + [("websocket", True)] * (
        len(log) - 1) and len(log) >= 2


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_over_twelve_turns_with_store_false(emulator, bridge, streamed):
    agents = pytest.importorskip("agents")
    proxy = bridge()
    sent: list = []
    _, http = recording_clients(sent)

    async def run() -> None:
        agent, client = weather_agent(agents, proxy.url, http)
        agent = agent.clone(model_settings=agents.ModelSettings(store=False))
        history: list = []
        for text in user_turns(12):
            turn_input = history + [{"role": "user", "content": text}]
            if streamed:
                result = agents.Runner.run_streamed(agent, turn_input)
                async for _ in result.stream_events():
                    pass
            else:
                result = await agents.Runner.run(agent, turn_input)
            history = result.to_input_list()
        await client.close()

    asyncio.run(run())
    log = records(emulator)
    assert len(sent) >= 16
    assert_context_preserved(sent, log, reshaped=True)
    assert all(r["transport"] == "websocket" and r["store"] is False for r in log)
    assert sum(r["continued"] for r in log[1:]) == len(log) - 1


def test_the_client_gets_every_event_as_the_sse_the_http_api_streams(emulator, bridge):
    proxy = bridge()
    conv = Conversation(proxy.url, as_dicts=True, options={"store": False})
    converse(conv, 1)
    body = {"model": "gpt-test", "stream": True, "store": False, "input": conv.history + [
        {"role": "user", "content": "and now?"}]}
    with httpx.Client(trust_env=False, timeout=30) as client, \
            client.stream("POST", proxy.url + "/v1/responses", json=body, headers=AUTH) as answer:
        received = b"".join(answer.iter_raw())
        assert answer.headers["content-type"].startswith("text/event-stream")
    record = records(emulator)[-1]
    assert record["continued"] is True and record["transport"] == "websocket"
    assert received == b"".join(sse_event(json.loads(m)["type"], m.encode()) for m in record["messages"])


# -- refused, and every fault ----------------------------------------------------------------------------


def test_a_refused_upgrade_is_remembered_per_upstream_and_credential_and_shared_with_replicas(
        emulator, bridge, tmp_path):
    emulator.model.control({"websocket": "refuse"})
    store = f"sqlite:{tmp_path / 'shared.sqlite3'}"
    first = bridge("--set", f"stateful_store={store}")
    conv = Conversation(first.url, options={"store": False})
    converse(conv, 4)
    log = records(emulator)
    assert_context_preserved(conv.sent, log)
    assert all(r["transport"] == "http" for r in log)
    output = first.stop()
    assert output.count("refused the WebSocket upgrade (404); HTTP from now on") == 1
    assert output.count("ws: opening a socket") == 1  # tried once, never again
    # another proxy on the same store never tries the upgrade for that upstream + credential
    second = bridge("--set", f"stateful_store={store}")
    again = Conversation(second.url, options={"store": False})
    converse(again, 2)
    assert "ws: opening a socket" not in second.stop()
    assert all(r["transport"] == "http" for r in records(emulator))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fault", [
    {"kind": "ws_close", "when": "continued"},  # the socket drops before the first event
    {"kind": "ws_close", "code": 1011, "when": "continued"},  # the upstream closes it
    {"kind": "ws_error", "status": 400, "code": "previous_response_not_found", "when": "continued"},
    {"kind": "ws_error", "status": 400, "code": "invalid_value", "when": "continued"},  # any refused continuation
], ids=["dropped", "closed", "not-found", "refused"])
def test_a_fault_before_the_first_event_is_retried_invisibly_with_full_history(emulator, bridge, stream, fault):
    proxy = bridge()
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    converse(conv, 3)
    emulator.model.control({"fail_next": [fault]})
    conv = Conversation(proxy.url, stream=stream, options={"store": False}, history=conv.history, sent=conv.sent)
    converse(conv, 2, "after the fault ")
    faulted = [r for r in records(emulator) if r.get("fault") == fault["kind"]]
    assert len(faulted) == 1 and faulted[0]["previous_response_id"] is not None
    retry = records(emulator)[records(emulator).index(faulted[0]) + 1]
    assert retry["transport"] == "websocket" and retry["previous_response_id"] is None
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert records(emulator)[-1]["continued"]  # and the socket continues again from the retried answer
    assert "after: the socket" in proxy.output()


def test_a_socket_still_running_a_response_is_replaced_invisibly(emulator, bridge):
    """The upstream keeps a turn running after its last event: the next turn's create is refused as busy."""
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_stall", "after_events": 100, "ms": 5000}]})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    converse(conv, 2, "right after a turn that still runs ")
    log = records(emulator)
    refused = [r for r in log if r["status_code"] != 200]
    assert [r["error"]["code"] for r in refused] == ["conversation_already_has_active_response"]
    busy, retry = log[log.index(refused[0]) - 1], log[log.index(refused[0]) + 1]
    assert busy["fault"] == "ws_stall" and refused[0]["socket"] == busy["socket"] != retry["socket"]
    assert retry["transport"] == "websocket" and retry["previous_response_id"] is None  # whole, on a fresh socket
    assert_context_preserved(conv.sent, [r for r in log if r["status_code"] == 200])  # the busy turn's answer too
    assert log[-1]["continued"] and "after: the socket refused it (conversation_already_has_active_response)" \
        in proxy.output()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_upstream_that_takes_a_turn_and_sends_nothing_is_given_up_and_the_turn_goes_over_http(
        emulator, bridge, stream):
    proxy = bridge("--set", "stateful_upstream_websocket_first_event_s=1")
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_stall", "when": "continued"}]})  # silent until dropped
    conv = Conversation(proxy.url, stream=stream, options={"store": False}, history=conv.history, sent=conv.sent)
    started = time.monotonic()
    conv.turn("the upstream takes this and says nothing")
    assert 1 <= time.monotonic() - started < 10
    converse(conv, 2, "after the silence ")
    log = records(emulator)
    stalled = next(r for r in log if r["fault"] == "ws_stall")
    over_http, fresh = log[log.index(stalled) + 1: log.index(stalled) + 3]
    assert stalled["continued"] and over_http["transport"] == "http" and over_http["previous_response_id"] is None
    assert fresh["transport"] == "websocket" and fresh["socket"] != stalled["socket"] and not fresh["continued"]
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert log[-1]["continued"] and "after: no event within 1 s" in proxy.output()
    assert emulator.open_sockets == 1  # the silent socket was dropped


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_silence_mid_answer_is_invisible_to_a_json_client_and_breaks_a_streaming_clients_stream(
        emulator, bridge, stream):
    proxy = bridge("--set", "stateful_upstream_websocket_silence_s=1")
    emulator.model.control({"slow_ms": 200})  # a pause between events within the bound is waited out
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    converse(conv, 1)
    emulator.model.control({"slow_ms": 0, "fail_next": [{"kind": "ws_stall", "after_events": 3}]})
    conv = Conversation(proxy.url, stream=stream, options={"store": False}, history=conv.history, sent=conv.sent)
    if stream:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            conv.turn("this stream falls silent")
        conv.history.pop()
        conv.sent.pop()
    else:
        conv.turn("this answer falls silent before the client has a byte")
    converse(conv, 2, "the client goes on ")  # as an SDK retries a dropped stream
    log = records(emulator)
    stalled = next(r for r in log if r["fault"] == "ws_stall")
    after = log[log.index(stalled) + 1]
    assert after["transport"] == ("websocket" if stream else "http") and after["previous_response_id"] is None
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert ("the socket fell silent for 1 s mid-answer" if stream else "after: no event within 1 s") in proxy.output()


def test_a_silent_socket_whose_client_gave_up_sends_nothing_more_upstream(emulator, bridge):
    """Over HTTP the turn would be billed again for nobody: a client gone has nothing to retry for."""
    proxy = bridge("--set", "stateful_upstream_websocket_first_event_s=2")
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_stall", "when": "continued"}]})
    impatient = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    impatient.client = impatient.client.with_options(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.turn("the client gives up on this one")
    impatient.close()
    time.sleep(3)  # the bridge gives up on the socket after 2 s
    log = records(emulator)
    assert [r["transport"] for r in log] == ["websocket"] * len(log) and log[-1]["fault"] == "ws_stall"
    assert "the client went away" in proxy.output()


def test_while_the_upgrade_rests_after_a_failure_turns_go_over_http_with_the_clients_store(emulator, bridge):
    emulator.model.control({"websocket": "unavailable"})
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 3)
    log = records(emulator)
    assert_context_preserved(conv.sent, log)
    assert all(r["transport"] == "http" and r["store"] is False and r["stored"] is False for r in log)  # never forced
    output = proxy.output()
    assert output.count("ws: opening a socket") == 1 and "refused the upgrade for now (503)" in output


def test_a_socket_past_its_lifetime_is_replaced_invisibly(emulator, bridge):
    emulator.model.control({"ws_lifetime_s": 0.5})
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    conv.turn("turn 0: hello")
    time.sleep(0.6)
    conv.turn("turn 1: still there?")
    conv.close()
    refused = [r for r in records(emulator) if r["status_code"] != 200]
    assert [r["error"]["code"] for r in refused] == ["websocket_connection_limit_reached"]
    served = reached_the_client(emulator)
    assert_context_preserved(conv.sent, served)
    assert served[0]["socket"] != served[1]["socket"] and served[1]["previous_response_id"] is None


def test_a_socket_that_breaks_mid_stream_breaks_the_clients_stream_and_its_retry_recovers(emulator, bridge):
    proxy = bridge()
    conv = Conversation(proxy.url, stream=True, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_close", "after_events": 3}]})
    conv = Conversation(proxy.url, stream=True, options={"store": False}, history=conv.history, sent=conv.sent)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        conv.turn("this stream will break")
    conv.history.pop()
    conv.sent.pop()
    converse(conv, 2, "the client tried again ")  # as an SDK retries a dropped stream
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert "the socket broke mid-answer" in proxy.output()


def test_a_socket_that_breaks_mid_answer_of_a_json_client_is_invisible(emulator, bridge):
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_close", "after_events": 3}]})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    converse(conv, 2, "no byte reached the client yet ")
    assert_context_preserved(conv.sent, reached_the_client(emulator))


def test_cache_misses_on_sockets_are_no_verdict_and_never_force_store(emulator, bridge):
    """previous_response_not_found to a continuation of the socket's own latest response is the socket's state
    (an eviction upstream), not a refusal: the turn goes whole on the socket, the next ones are continued
    there again, and no turn of a store: false conversation is ever sent with store forced."""
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    miss = {"kind": "reject", "when": "continued", "status": 400, "code": "previous_response_not_found",
            "message": "Previous response with id 'resp_x' not found."}
    emulator.model.control({"fail_next": [miss] * 3})  # three continuations in a row miss
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    converse(conv, 5, "after cache misses ")
    log = records(emulator)
    assert sum(r["fault"] == "reject" for r in log) == 3
    assert all(r["transport"] == "websocket" for r in log)
    assert all(r["store"] is False and r.get("stored") is not True for r in log)  # never forced, nothing kept
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert log[-1]["continued"] and "HTTP from now on" not in proxy.output()


def test_a_failed_turn_evicts_the_sockets_memory_and_the_next_turn_goes_whole(emulator, bridge):
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "failed"}]})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    conv.turn("this one fails")  # a failed response, as HTTP would answer it
    converse(conv, 2, "after the failure ")
    log = records(emulator)
    failed = next(r for r in log if r["fault"] == "failed")
    after = log[log.index(failed) + 1]
    assert after["transport"] == "websocket" and after["previous_response_id"] is None
    assert_context_preserved(conv.sent, log)
    assert log[-1]["continued"]


@pytest.mark.parametrize("status,error", [(429, openai.RateLimitError), (500, openai.InternalServerError),
                                          (503, openai.InternalServerError)])
def test_an_error_event_with_a_status_reaches_the_client_as_that_status_and_the_sdk_retries_it(
        emulator, bridge, status, error):
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    times = 2 if status == 500 else 1  # a 500 to a continuation goes again whole: the whole one fails too
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": status, "code": "x",
                                           "message": "try later"}] * times})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    with pytest.raises(error) as raised:
        conv.turn("this one is refused")
    assert raised.value.status_code == status and raised.value.body["code"] == "x"
    conv.history.pop()
    conv.sent.pop()
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": status, "code": "x"}]})  # a whole turn now
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent, max_retries=2)
    converse(conv, 1, "the SDK retries ")
    retried = [sent for n, sent in enumerate(conv.sent) if n == 0 or sent.body != conv.sent[n - 1].body]
    assert len(retried) == len(conv.sent) - 1  # the SDK sent the refused request once more
    assert_context_preserved(retried, reached_the_client(emulator))


@pytest.mark.parametrize("spelling", ["status_code", "none"])
def test_an_error_events_status_is_read_in_either_spelling_or_from_its_code_or_type(emulator, bridge, spelling):
    """Servers name an error event's status ``status_code`` (codex-rs reads either), or leave it out: a
    refused continuation stays an invisible full retry, a 429 a 429 with its Retry-After, a refusal of the
    client's own request goes once over HTTP, and the socket's limit named by the error's type takes a fresh
    socket. None of them is a 500 of the proxy's making."""
    emulator.model.control({"ws_error_status": spelling})
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued", "status": 400,
                                           "code": "invalid_value", "message": "Invalid value."}]})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    conv.turn("a refused continuation")
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 429, "code": "rate_limit_exceeded",
                                           "type": "requests", "headers": {"retry-after": "7"}}]})
    with pytest.raises(openai.RateLimitError) as raised:
        conv.turn("this one is rate limited")
    assert raised.value.response.headers["retry-after"] == "7" and raised.value.body["code"] == "rate_limit_exceeded"
    conv.history.pop()
    conv.sent.pop()
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 400, "code": None,
                                           "type": "websocket_connection_limit_reached", "when": "continued"}]})
    conv.turn("the socket is worn out")
    converse(conv, 1, "then ")
    log = records(emulator)
    worn = next(n for n, r in enumerate(log) if r["fault"] == "ws_error" and r["status_code"] == 400)
    assert log[worn + 1]["socket"] != log[worn]["socket"] and log[worn + 1]["transport"] == "websocket"
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 400, "code": "unsupported_parameter"}]})
    other = Conversation(proxy.url, options={"store": False})
    converse(other, 1, "another conversation ")
    assert records(emulator)[-1]["transport"] == "http"  # refused on the socket, answered over HTTP
    assert_context_preserved(other.sent, [r for r in reached_the_client(emulator) if r["context"][0]
                                          == other.sent[0].body["input"][0]])
    assert "internal error" not in proxy.output()


def test_a_500_to_a_continuation_goes_again_whole_on_the_socket_invisibly(emulator, bridge):
    """The retry rule of forward mode, on the socket: a request the bridge changed (a continuation) that
    gets a 500 goes again as the client meant it, whole, and the client never hears of it; no verdict."""
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 500, "code": "server_error",
                                           "when": "continued"}]})
    conv = Conversation(proxy.url, options={"store": False}, history=conv.history, sent=conv.sent)
    converse(conv, 2, "after the 500 ")
    log = records(emulator)
    failed = next(n for n, r in enumerate(log) if r["fault"] == "ws_error")
    assert log[failed + 1]["transport"] == "websocket" and not log[failed + 1]["continued"]
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert log[-1]["continued"] and "from now on" not in proxy.output()


def test_a_refusal_of_the_clients_own_request_on_the_socket_goes_over_http(emulator, bridge):
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 400, "code": "unsupported_parameter"}]})
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 2)
    log = records(emulator)
    assert [r["transport"] for r in log[:2]] == ["websocket", "http"]  # refused on the socket, answered over HTTP
    assert_context_preserved(conv.sent, reached_the_client(emulator))
    assert "ws: sent over HTTP" in proxy.output()


NOTE_HEADER = """
class NoteHeader:
    \"\"\"A gateway that adds a header outside latin-1 (UTF-8 bytes, as some servers send) to its HTTP answers.\"\"\"

    def response(self, flow):
        if flow.request.method == "POST" and flow.response is not None:
            flow.response.headers["x-note"] = "Wetter \u2192 sonnig \u2600"

addons = [NoteHeader()]
"""


def test_an_http_fallback_answer_with_a_header_outside_latin_1_reaches_the_client_as_it_came(
        emulator, bridge, start_proxy, tmp_path):
    script = tmp_path / "note.py"
    script.write_text(NOTE_HEADER)
    gateway = start_proxy(emulator.url, "-s", str(script), script=False)
    proxy = bridge(upstream=gateway.url)
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 400, "code": "unsupported_parameter"}]})
    with httpx.Client(trust_env=False, timeout=30) as client:
        answer = client.post(f"{proxy.url}/v1/responses", headers=AUTH,
                             json={"model": "gpt-test", "input": "hello", "store": False})
    assert answer.status_code == 200 and answer.json()["status"] == "completed"
    assert dict(answer.headers.raw)[b"x-note"] == "Wetter \u2192 sonnig \u2600".encode()
    assert [r["transport"] for r in records(emulator)] == ["websocket", "http"]
    assert "internal error" not in proxy.output()


def test_a_continuation_the_upstream_does_not_echo_turns_the_bridge_off_there(emulator, bridge, tmp_path):
    """An upstream that takes the socket but ignores previous_response_id would lose history."""
    emulator.model.control({"echo_previous": False})
    proxy = bridge(confdir=str(tmp_path))
    conv = Conversation(proxy.url, options={"store": False})
    converse(conv, 4)
    log = records(emulator)
    unverified = [r for r in log if r["transport"] == "websocket" and r["continued"]]
    assert len(unverified) == 1  # its answer never reached the client
    served = [r for r in log if r not in unverified]
    assert_context_preserved(conv.sent, served)
    assert [r["transport"] for r in served] == ["websocket"] + ["http"] * (len(conv.sent) - 1)
    assert all(r["store"] is False for r in log)  # a verdict drawn from one answer forces no store
    assert "without echoing its previous_response_id; HTTP from now on" in proxy.output()
    proxy.stop()
    with contextlib.closing(sqlite3.connect(Path(proxy.confdir) / "stateful-responses.sqlite3")) as db:
        marks = {bytes(key).partition(b"\x00")[0]: expires - time.time()
                 for key, expires in db.execute("SELECT key, expires FROM records WHERE tbl = 'marks'")}
    assert 3000 < marks[b"refuses_websocket"] <= 3600  # an hour, not stateful_ttl_days: one answer is no long verdict


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_continuation_echoed_only_on_its_terminal_event_is_no_verdict(emulator, bridge, stream):
    """A server whose response.created leaves previous_response_id out, and whose terminal event echoes
    it: the turn is verified there, every turn stays on the socket, and no verdict is drawn."""
    emulator.model.control({"echo_previous": "terminal"})
    proxy = bridge()
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    converse(conv, 4)
    log = records(emulator)
    assert len(log) == len(conv.sent) and all(r["transport"] == "websocket" for r in log)
    assert [r["continued"] for r in log] == [False] + [True] * (len(log) - 1)
    assert_context_preserved(conv.sent, log)
    assert "from now on" not in proxy.output()


# -- concurrency and bounds ---------------------------------------------------------------------------


HOLD_A_FLOW = """
import asyncio
import json
from mitmproxy import http

ANSWER = {{"id": "resp_addon", "object": "response", "created_at": 0, "status": "completed", "model": "gpt-test",
          "output": [{{"type": "message", "id": "msg_addon", "status": "completed", "role": "assistant",
                      "content": [{{"type": "output_text", "text": "from an addon", "annotations": []}}]}}],
          "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}}

class TheThirdBridgedFlow:
    \"\"\"After ours, keeps the third bridged flow a while, as mitmweb's intercept does while a person looks
    (hold_s), or answers it itself.\"\"\"

    seen = 0

    def request(self, flow):
        if flow.request.path.startswith("/stateful-websocket/"):
            self.seen += 1
            if self.seen == 3 and {hold_s}:
                flow.intercept()
                asyncio.get_running_loop().call_later({hold_s}, flow.resume)
            elif self.seen == 3:
                flow.response = http.Response.make(200, json.dumps(ANSWER), {{"content-type": "application/json"}})

addons = [TheThirdBridgedFlow()]
"""


def test_a_flow_held_past_the_sockets_hold_still_gets_its_answer(emulator, bridge, tmp_path):
    """A bridged flow that reaches the loopback server only after its socket was given back (held by an
    intercept for over a minute) is answered over HTTP with the client's request, not refused by the proxy."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD_A_FLOW.format(hold_s=UNCLAIMED_S + 2))
    proxy = bridge("-s", str(script))
    conv = Conversation(proxy.url, as_dicts=True, options={"store": False})
    conv.client = conv.client.with_options(timeout=UNCLAIMED_S + 30)
    converse(conv, 3)
    log = records(emulator)
    assert [r["transport"] for r in log] == ["websocket", "websocket", "http"] + ["websocket"] * (len(log) - 3)
    assert_context_preserved(conv.sent, log)
    assert log[2]["store"] is False and log[3]["continued"]  # the socket, given back as it was, goes on
    assert "ws: sent over HTTP (after: the flow came " in proxy.output()


def test_a_flow_another_addon_answers_gives_its_socket_back_at_once(emulator, bridge, tmp_path):
    script = tmp_path / "answer.py"
    script.write_text(HOLD_A_FLOW.format(hold_s=0))
    proxy = bridge("-s", str(script))
    conv = Conversation(proxy.url, as_dicts=True, options={"store": False})
    converse(conv, 3)
    log = records(emulator)
    assert any(item.get("id") == "msg_addon" for item in conv.history) and len(conv.sent) == 4 and len(log) == 3
    assert_context_preserved(conv.sent[:2] + conv.sent[3:], log)
    assert len({r["socket"] for r in log}) == 1 and log[2]["continued"]  # its socket was free for the next turn


def test_six_concurrent_conversations_each_keep_their_context_on_sockets_of_their_own(emulator, bridge):
    emulator.model.control({"think_ms": 20})
    proxy = bridge()
    conversations = [Conversation(proxy.url, stream=n % 2 == 1, options={"store": False}) for n in range(6)]
    threads = [threading.Thread(target=converse, args=(conv, 8, f"conversation {n}: "))
               for n, conv in enumerate(conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    log = records(emulator)
    assert len(log) == sum(len(conv.sent) for conv in conversations)
    sockets = set()
    for n, conv in enumerate(conversations):
        own = [r for r in log if f"conversation {n}: turn 0" in json.dumps(r["context"][:1])]
        assert_context_preserved(conv.sent, own)
        assert all(r["transport"] == "websocket" for r in own) and all(r["continued"] for r in own[1:])
        sockets |= {r["socket"] for r in own}
    assert len(sockets) == 6  # each conversation a socket of its own


def test_two_turns_on_one_branch_at_once_get_their_own_sockets(emulator, bridge):
    proxy = bridge()
    conv = Conversation(proxy.url, as_dicts=True, options={"store": False})
    converse(conv, 2)
    emulator.model.control({"think_ms": 300})
    body = {"model": "gpt-test", "store": False, "input": conv.history + [{"role": "user", "content": "fork"}]}
    answers: list = []

    def send() -> None:
        with httpx.Client(trust_env=False, timeout=30) as client:
            answers.append(client.post(proxy.url + "/v1/responses", json=body, headers=AUTH))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [a.status_code for a in answers] == [200, 200]
    both = records(emulator)[-2:]
    assert both[0]["socket"] != both[1]["socket"] and sorted(r["continued"] for r in both) == [False, True]
    assert drop_nulls(both[0]["context"]) == drop_nulls(both[1]["context"])


def test_turns_beyond_the_socket_cap_go_over_http_with_the_clients_store(emulator, bridge):
    """Even before the upstream's first answer on a socket: no forced store while WebSocket mode may serve it."""
    proxy = bridge("--set", "stateful_upstream_websocket_max_sockets=1")
    emulator.model.control({"think_ms": 2000})
    busy = threading.Thread(target=converse, args=(Conversation(proxy.url, options={"store": False}), 1, "busy "))
    busy.start()
    deadline = time.monotonic() + 10
    while not emulator.open_sockets and time.monotonic() < deadline:  # the busy turn has taken the one socket
        time.sleep(0.01)  # (a fixed pause let a loaded CI machine send the overflow first: it took the socket)
    overflow = Conversation(proxy.url, options={"store": False})
    converse(overflow, 1, "overflow ")
    busy.join(30)
    over_http = [r for r in records(emulator) if r["transport"] == "http"]
    assert len(over_http) == len(overflow.sent) and all(r["store"] is False for r in over_http)  # never forced
    assert_context_preserved(overflow.sent, over_http)
    assert "every socket of" in proxy.output()


def test_a_store_false_conversation_that_overflowed_gets_the_freed_socket_back(emulator, bridge):
    """One socket, two store: false conversations: the second overflows to HTTP while the first is live
    (store forced there, as without the bridge). Once the first ended and its memory went stale, the
    second's later turns take the idle socket (its first one there whole, the rest continued from the
    socket's memory, nothing stored), not HTTP with store forced."""
    proxy = bridge("--set", "stateful_upstream_websocket_max_sockets=1")
    first = Conversation(proxy.url, options={"store": False})
    for text in user_turns(3, "first "):
        first.turn(text)
        time.sleep(1)  # its pace: a second between turns, so it stays live three seconds after each
    first.close()
    second = Conversation(proxy.url, options={"store": False})
    second.turn("second turn 0: overflow")
    overflowed = len(records(emulator))
    assert records(emulator)[-1]["transport"] == "http"  # the first conversation's memory was live
    time.sleep(4)  # the first conversation ended: its memory goes stale
    converse(second, 5, "second, later ")
    later = records(emulator)[overflowed:]
    assert [r["transport"] for r in later] == ["websocket"] * len(later)
    assert [r["continued"] for r in later] == [False] + [True] * (len(later) - 1)
    assert all(r["store"] is False and r["stored"] is False for r in later)  # never forced again
    mine = [r for r in records(emulator) if r["context"][0] == second.sent[0].body["input"][0]]
    assert_context_preserved(second.sent, mine)


class CountingRelay:
    """A TCP relay on loopback in front of ``upstream`` that counts the bytes sent to it: what crosses the
    uplink, request lines, headers, handshakes and frames included."""

    def __init__(self, upstream: str) -> None:
        self.target = upstream.split("//", 1)[1].rsplit(":", 1)
        self.sent = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((self.target[0], int(self.target[1])))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(65536):
                if counted:
                    with self._lock:
                        self.sent += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def test_more_conversations_than_sockets_cost_no_more_upstream_bytes_than_the_bridge_off(
        emulator, bridge, start_proxy):
    """Six `store: false` conversations taking turns over four sockets: the four that hold a socket stay
    continued on it, the other two go over HTTP, where forward mode continues them as it does with the bridge
    off (replacing the least recently used socket's memory made every turn whole: 0 of 24 continued)."""
    pad = "x" * 4000  # each user turn 4 kB: a whole resend costs the history, a continuation the turn

    def six_in_turn(url: str, tag: str) -> list[Conversation]:
        conversations = [Conversation(url, as_dicts=True, options={"store": False}) for _ in range(6)]
        for t in range(4):
            for n, conv in enumerate(conversations):
                conv.turn(f"{tag} conversation {n}: turn {t} {pad}")
        for conv in conversations:
            conv.close()
        return conversations

    sent = {}
    relays = {"off": CountingRelay(emulator.url), "on": CountingRelay(emulator.url)}
    try:
        off = six_in_turn(start_proxy(relays["off"].url).url, "off")
        without_bridge = records(emulator)
        on = six_in_turn(bridge("--set", "stateful_upstream_websocket_max_sockets=4", upstream=relays["on"].url).url,
                         "on")
        with_bridge = records(emulator)[len(without_bridge):]
        sent = {name: relay.sent for name, relay in relays.items()}
    finally:
        for relay in relays.values():
            relay.close()
    for conversations, log in ((off, without_bridge), (on, with_bridge)):
        for n, conv in enumerate(conversations):
            own = [r for r in log if f"conversation {n}: turn 0" in json.dumps(r["context"][:1])]
            assert_context_preserved(conv.sent, own)
    on_sockets = [r for r in with_bridge if r["transport"] == "websocket"]
    assert len(on_sockets) == 16 and sum(r["continued"] for r in on_sockets) == 12
    over_http = [r for r in with_bridge if r["transport"] == "http"]
    assert len(over_http) == 8 and sum(r["continued"] for r in over_http) == 6  # as forward mode does them
    assert sum(r["continued"] for r in without_bridge) == 18
    assert sent["on"] <= sent["off"]
    # bodies alone: each socket message carries `"type":"response.create",` (25 bytes) that HTTP does not
    body_bytes = [sum(r["body_bytes"] for r in log) for log in (with_bridge, without_bridge)]
    assert body_bytes[0] <= body_bytes[1] + 25 * len(on_sockets)


def test_tenants_and_models_never_share_a_socket_or_its_memory(emulator, bridge):
    proxy = bridge()
    tenants = [Conversation(proxy.url, api_key=key, model=model, as_dicts=True, options={"store": False})
               for key, model in (("sk-tenant-a", "gpt-test"), ("sk-tenant-b", "gpt-test"), ("sk-tenant-a", "gpt-other"))]
    for n in range(3):
        for k, conv in enumerate(tenants):
            conv.turn(f"the same words {n}")  # identical histories: only the credential or the model differs
    for conv in tenants:
        conv.close()
    log = records(emulator)
    by_tenant = [log[k::3] for k in range(3)]
    for conv, own in zip(tenants, by_tenant, strict=True):
        assert_context_preserved(conv.sent, own)
        assert len({r["socket"] for r in own}) == 1 and all(r["continued"] for r in own[1:])
    assert len({own[0]["socket"] for own in by_tenant}) == 3
    assert by_tenant[0][0]["credential"] == by_tenant[2][0]["credential"] != by_tenant[1][0]["credential"]


def test_a_shutdown_after_bridged_traffic_is_quiet(emulator, bridge):
    """mitmdump stops while the client still holds its connection (and mitmproxy its own to the loopback
    server): the bridge's connections end without a traceback. (mitmproxy logs its own cancelled client
    connection on Python 3.11 with or without the addon.)"""
    proxy = bridge()
    conv = Conversation(proxy.url, options={"store": False})
    for text in user_turns(3):
        conv.turn(text)
    output = proxy.stop()
    conv.close()
    assert "loopback.py" not in output and "stateful_responses" not in output.partition("Traceback")[2]


def test_idle_sockets_are_closed(emulator, bridge):
    proxy = bridge("--set", "stateful_upstream_websocket_idle_s=1")
    converse(Conversation(proxy.url, options={"store": False}), 1)
    assert emulator.open_sockets == 1
    for _ in range(100):  # the sweep runs every 5 s
        if not emulator.open_sockets:
            break
        time.sleep(0.1)
    assert not emulator.open_sockets


# -- where it runs, and what it shows -----------------------------------------------------------------


def test_the_flow_shows_the_real_request_and_what_went_over_the_socket(emulator, bridge, tmp_path):
    flows_file = tmp_path / "flows.mitm"
    proxy = bridge("-w", str(flows_file))
    conv = Conversation(proxy.url, as_dicts=True, options={"store": False})
    converse(conv, 3)
    proxy.stop()
    with open(flows_file, "rb") as f:
        flows = [flow for flow in flow_io.FlowReader(f).stream() if flow.request.path == "/v1/responses"]
    assert len(flows) == len(conv.sent)
    for flow, sent in zip(flows, conv.sent, strict=True):
        assert flow.request.url == emulator.url + "/v1/responses"  # not the loopback server
        assert json.loads(flow.request.content) == sent.body  # the client's body
        assert flow.request.headers["authorization"] == AUTH["authorization"]
    last = flows[-1]
    assert last.comment.startswith("chain:") and " ws: continued from resp_" in last.comment
    assert last.comment.endswith(f": 1 of {len(conv.sent[-1].body['input'])} items sent")
    assert last.metadata["stateful_websocket"]["transport"] == "websocket"
    assert last.response.headers["content-type"] == "application/json"
    view = render(last, last.request.content)  # the Stateful Responses view in mitmweb
    assert "transport: the upstream's WebSocket, continue" in view and "previous_response_id: resp_" in view


def test_a_websocket_client_passes_through_untouched_with_one_record_per_turn(emulator, bridge, tmp_path):
    proxy = bridge()
    client = openai.OpenAI(api_key="sk-ws", base_url=proxy.url + "/v1", max_retries=0)
    with client.responses.connect() as conn:
        previous = None
        for n in range(3):
            conn.response.create(model="gpt-test", input=f"socket turn {n}", store=False,
                                 **({"previous_response_id": previous} if previous else {}))
            previous = next(e for e in conn if e.type == "response.completed").response.id
    message = json.dumps({"type": "response.create", "model": "gpt-test", "input": "raw", "store": False})
    with websockets.sync.client.connect(proxy.url.replace("http", "ws", 1) + "/v1/responses",
                                        additional_headers={"Authorization": "Bearer sk-ws"}) as ws:
        ws.send(message)
        received = []
        while not received or json.loads(received[-1])["type"] != "response.completed":
            received.append(ws.recv(timeout=10))
    log = records(emulator)
    assert [r["continued"] for r in log] == [False, True, True, False]
    assert len({r["socket"] for r in log}) == 2  # the client's own sockets, relayed as they are
    assert log[-1]["body_sha256"] == hashlib.sha256(message.encode()).hexdigest()
    assert received == log[-1]["messages"]
    lines = record_lines(tmp_path, 4)
    assert all(line["transport"] == {"client": "websocket", "upstream": "websocket"} for line in lines)
    assert [line["turn"] for line in lines] == [0, 1, 2, 0]
    chains = [line["continuation"]["chainId"] for line in lines]
    assert chains[0] == chains[1] == chains[2] != chains[3]
    assert [line["continuation"]["previousTurnId"] is None for line in lines] == [True, False, False, True]
    assert "ws: " not in proxy.output()  # the bridge never touched it


@pytest.mark.parametrize("trust", ["ssl_verify_upstream_trusted_ca", "ssl_insecure"])
def test_regular_mode_over_tls_honours_mitmproxys_upstream_tls_options(tmp_path, start_proxy, trust):
    from stateful_responses.emulator import Emulator
    from test_https_proxy_integration import self_signed

    cert, key = self_signed(tmp_path)
    with Emulator(certfile=cert, keyfile=key) as emu:
        option = f"ssl_verify_upstream_trusted_ca={cert}" if trust == "ssl_verify_upstream_trusted_ca" \
            else "ssl_insecure=true"
        proxy = start_proxy(emu.url, "--set", option, "--set", "stateful_debug=true", mode="regular",
                            upstream_websocket="auto")
        ca = Path(proxy.confdir) / "mitmproxy-ca-cert.pem"
        sent: list = []
        client = openai.OpenAI(base_url=emu.url + "/v1", api_key="sk-tls", max_retries=0, http_client=httpx.Client(
            proxy=proxy.url, verify=str(ca), trust_env=False, timeout=30,
            event_hooks={"request": [lambda r: sent.append(json.loads(r.read()))]}))
        history: list = []
        for n in range(4):
            history.append({"role": "user", "content": f"tls turn {n}"})
            history += client.responses.create(model="gpt-test", input=history, store=False).output
        client.close()
        log = emu.model.snapshot_log()
    assert [r["transport"] for r in log] == ["websocket"] * 4 and [r["continued"] for r in log][1:] == [True] * 3
    assert drop_nulls(log[-1]["context"]) == drop_nulls(expand_input(sent[-1]["input"]))


def test_transparent_mode_sends_the_socket_to_the_address_under_the_host_headers_name(tmp_path, start_proxy):
    """Transparent mode without root networking: mitmproxy's lookup of a redirected connection's original
    destination (netfilter's SO_ORIGINAL_DST) is replaced by one naming the emulator; mitmproxy's transparent
    layer and the bridge are real. The emulator's certificate names localhost and no address: a socket
    verified against the address instead of the Host header's name would fail, and the turns go over HTTP."""
    from stateful_responses.emulator import Emulator
    from test_https_proxy_integration import self_signed

    cert, key = self_signed(tmp_path, dns_name="localhost")
    with Emulator(certfile=cert, keyfile=key) as emu:
        original_destination = tmp_path / "original_destination.py"
        original_destination.write_text("from mitmproxy import platform\n"
                                        f"platform.original_addr = lambda sock: ('127.0.0.1', {emu.port})\n")
        proxy = start_proxy(emu.url, "-s", str(original_destination), "--set", f"ssl_verify_upstream_trusted_ca={cert}",
                            "--set", "stateful_debug=true", mode="transparent", upstream_websocket="auto")
        ca = Path(proxy.confdir) / "mitmproxy-ca-cert.pem"
        sent: list = []
        client = openai.OpenAI(base_url=f"https://localhost:{proxy.port}/v1", api_key="sk-transparent", max_retries=0,
                               http_client=httpx.Client(verify=str(ca), trust_env=False, timeout=30, event_hooks={
                                   "request": [lambda r: sent.append(json.loads(r.read()))]}))
        history: list = []
        for n in range(3):
            history.append({"role": "user", "content": f"transparent turn {n}"})
            history += client.responses.create(model="gpt-test", input=history, store=False).output
        client.close()
        log = emu.model.snapshot_log()
    assert [r["transport"] for r in log] == ["websocket"] * 3 and [r["continued"] for r in log] == [False, True, True]
    assert drop_nulls(log[-1]["context"]) == drop_nulls(expand_input(sent[-1]["input"]))
    assert "ws: continued from resp_" in proxy.output()


def test_in_upstream_proxy_mode_the_bridge_stays_off(emulator, start_proxy):
    upstream_proxy = start_proxy(emulator.url, script=False, mode="regular")
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true", mode=f"upstream:{upstream_proxy.url}",
                        upstream_websocket="auto")
    sent: list = []
    recording, _ = recording_clients(sent)
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0,
                           http_client=httpx.Client(proxy=proxy.url, trust_env=False, timeout=30,
                                                    event_hooks=recording.event_hooks))
    history: list = []
    for n in range(3):
        history.append({"role": "user", "content": f"turn {n}"})
        history += [o.model_dump() for o in client.responses.create(model="gpt-test", input=history,
                                                                    store=False).output]
    client.close()
    assert [r["transport"] for r in records(emulator)] == ["http"] * 3
    assert [r["store"] for r in records(emulator)] == [True] * 3  # no socket here: forward mode forces as before
    assert_context_preserved(sent, records(emulator))
    assert "ws: " not in proxy.output()
