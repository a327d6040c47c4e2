"""One continuation engine, two transports, through real mitmdump on the
default path (the bridge on): every answer, over a socket or over HTTP, is
learned into the same prefix store and shared store, so a conversation is
continued after a restart or a kill -9, across replicas, and when a turn
moves between the socket and HTTP; what a socket cannot do is a verdict
learned once. Every test compares what the model saw with what the client
meant, request by request."""

from __future__ import annotations

from pathlib import Path

import pytest
from driver import Conversation, assert_context_preserved, client_turns, user_turns, without_comparisons
from test_state_integration import Alternating, replica_stores


@pytest.fixture
def bridged(emulator, start_proxy):
    """mitmdump with the default bridge (``auto``) in front of the emulator."""
    def start(*extra: str, **options):
        return start_proxy(emulator.url, "--set", "stateful_debug=true", *extra, upstream_websocket="auto",
                           **options)
    return start


def creates(emulator) -> list[dict]:
    """The upstream's Responses creates (over HTTP or a socket), in order, less
    the proxy's comparisons (the first continuation across tool calls is also
    sent whole, to compare their input tokens)."""
    return [r for r in without_comparisons(emulator.model.snapshot_log()) if "input_items" in r]


def answered(emulator) -> list[dict]:
    return [r for r in creates(emulator) if r.get("status_code") == 200]


def converse(conv: Conversation, turns: int, tag: str = "") -> None:
    for text in user_turns(turns, tag):
        conv.turn(text)


@pytest.mark.parametrize("stop", ["restart", "kill -9"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_after_a_restart_the_next_turn_is_continued_on_a_new_socket(emulator, bridged, tmp_path, stop, stream):
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    first = bridged(confdir=str(confdir))
    conv = Conversation(first.url, stream=stream, as_dicts=True)
    converse(conv, 3)
    assert all(r["transport"] == "websocket" for r in creates(emulator))
    output = first.kill() if stop == "kill -9" else first.stop()
    assert "internal error" not in output
    bridged(confdir=str(confdir), port=first.port)
    before = len(creates(emulator))
    conv.turn("the first turn after the restart")
    conv.close()
    after = creates(emulator)[before]
    assert after["transport"] == "websocket" and after["continued"] is True and after["hydrated"] is True
    assert after["previous_response_id"] == creates(emulator)[before - 1]["response_id"]
    assert after["input_items"] == 1  # only the new user message
    assert_context_preserved(conv.sent, creates(emulator))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("store", ["redis", "redis-cluster"])
def test_two_replicas_sharing_redis_continue_every_turn_after_the_first(emulator, bridged, request, store, stream):
    proxies = [bridged("--set", f"stateful_store={spec}") for spec in replica_stores(request, store)]
    client = Alternating(proxies, stream=stream)
    client.turns(user_turns(8))
    client.close()
    log = answered(emulator)
    assert_context_preserved(client.conv.sent, log)
    assert client.requests >= 8
    assert [r["continued"] for r in log] == [False] + [True] * (len(log) - 1)
    assert all(r["transport"] == "websocket" for r in log)
    assert all(r["input_items"] <= 2 for r in log[1:])  # the new items only
    for proxy in proxies:
        assert "internal error" not in proxy.output()


def test_a_turn_moved_to_http_by_stream_large_bodies_is_continued_from_the_sockets_answers(emulator, bridged):
    proxy = bridged("--set", "stream_large_bodies=3k")
    conv = Conversation(proxy.url, as_dicts=True)
    converse(conv, 2)
    assert all(r["transport"] == "websocket" for r in creates(emulator))
    before = len(creates(emulator))
    conv.turn("a long turn " + "x" * 4000)  # over stream_large_bodies: streamed past the bridge, to forward mode
    conv.turn("back to short turns")
    conv.close()
    moved = creates(emulator)[before]
    assert moved["transport"] == "http" and moved["continued"] is True
    assert moved["previous_response_id"] == creates(emulator)[before - 1]["response_id"]
    # the first continuation over HTTP across function calls was compared with the turn sent whole
    assert all(r["continued"] for r in client_turns(creates(emulator))[1:])
    assert_context_preserved(conv.sent, creates(emulator))


@pytest.mark.parametrize("emulate", ["off", "always"])
@pytest.mark.parametrize("store", [None, False], ids=["stored", "store-false"])
def test_a_socket_that_refuses_previous_response_id_costs_one_wasted_call(emulator, bridged, store, emulate):
    emulator.model.control({"websocket": "no_previous"})
    proxy = bridged("--set", f"stateful_emulate={emulate}")
    conv = Conversation(proxy.url, as_dicts=True, options={} if store is None else {"store": store})
    converse(conv, 6)
    conv.close()
    log = creates(emulator)
    refused = [r for r in log if r.get("status_code") != 200]
    assert len(refused) == 1  # one wasted call for this upstream + credential, then the verdict holds
    assert len(log) == len(conv.sent) + 1
    assert_context_preserved(conv.sent, answered(emulator))
    if store is None:  # then forward mode continues over HTTP
        http = [r for r in answered(emulator) if r["transport"] == "http"]
        assert http and all(r["continued"] for r in http[1:])
    else:  # a verdict drawn from a turn is no licence to store what the client asked not to
        assert all(r["store"] is False for r in log)
    output = proxy.stop()
    assert output.count("refused a continuation of its socket's own latest response") == 1


@pytest.mark.parametrize("store", [None, False], ids=["stored", "store-false"])
def test_an_upstream_that_closes_its_sockets_before_any_event_is_continued_over_http(emulator, bridged, store):
    """LiteLLM's native pass-through accepts the upgrade and closes the socket: after one
    turn, forward mode continues over HTTP what the upstream stores (a turn that does not
    say store: the API's default); a store: false conversation keeps its store (the verdict
    is drawn from faults, for an hour: no licence to store) and goes whole."""
    emulator.model.control({"websocket": "close"})
    proxy = bridged()
    conv = Conversation(proxy.url, as_dicts=True, options={} if store is None else {"store": store})
    converse(conv, 12)
    conv.close()
    log = answered(emulator)
    assert_context_preserved(conv.sent, log)
    assert len(log) == len(conv.sent) >= 16
    if store is None:
        assert sum(r["continued"] for r in log) >= len(log) - 1
    else:
        assert all(r["store"] is False and not r["continued"] for r in log)
    output = proxy.stop()
    assert output.count("closed sockets opened for a turn before their first event") == 1
    assert output.count("ws: opening a socket") == 1


def test_the_verdict_is_shared_with_a_replica(emulator, bridged, tmp_path):
    emulator.model.control({"websocket": "close"})
    store = f"sqlite:{tmp_path / 'shared.sqlite3'}"
    first = bridged("--set", f"stateful_store={store}")
    conv = Conversation(first.url, as_dicts=True)
    converse(conv, 2)
    first.stop()
    second = bridged("--set", f"stateful_store={store}")
    again = Conversation(second.url, as_dicts=True)
    converse(again, 2)
    again.close()
    assert "ws: opening a socket" not in second.stop()
    assert Path(tmp_path / "shared.sqlite3").exists()


def test_conversations_taking_turns_on_fewer_sockets_continue_from_their_stored_responses(emulator, bridged):
    """Each turn takes a socket that remembers another conversation: its own stored response is hydrated there."""
    proxy = bridged("--set", "stateful_upstream_websocket_max_sockets=1")
    convs = [Conversation(proxy.url, as_dicts=True) for _ in range(3)]
    for text in user_turns(3):
        for n, conv in enumerate(convs):
            conv.turn(f"conversation {n}, {text}")
    for conv in convs:
        conv.close()
    log = answered(emulator)
    assert all(r["transport"] == "websocket" for r in log) and len({r["socket"] for r in log}) == 1
    assert sum(not r["continued"] for r in log) == len(convs)  # each conversation's first request only
    assert all(r["input_items"] <= 2 for r in log if r["continued"])
    assert any(r["hydrated"] for r in log)
    for conv in convs:
        mine = [r for r in log if r["context"][0] == conv.sent[0].body["input"][0]]
        assert_context_preserved(conv.sent, mine)


def test_an_upgrade_never_answered_is_a_verdict_after_one_wait(emulator, bridged):
    emulator.model.control({"websocket": "silent"})
    proxy = bridged()
    conv = Conversation(proxy.url, as_dicts=True)
    converse(conv, 3)
    conv.close()
    log = answered(emulator)
    assert_context_preserved(conv.sent, log)
    assert all(r["transport"] == "http" for r in log)
    assert all(r["continued"] for r in log[1:])  # forward mode, as with no WebSocket mode
    output = proxy.stop()
    assert output.count("never answered the WebSocket upgrade") == 1
    assert output.count("ws: opening a socket") == 1


@pytest.mark.parametrize("fault", [
    {"kind": "ws_close", "when": "continued"},  # the socket drops before the first event
    {"kind": "ws_error", "status": 400, "code": "websocket_connection_limit_reached", "when": "continued"},
], ids=["dropped", "worn-out"])
def test_a_stored_conversation_whose_socket_is_lost_is_continued_on_a_fresh_one(emulator, bridged, fault):
    proxy = bridged()
    conv = Conversation(proxy.url, as_dicts=True)
    converse(conv, 3)
    emulator.model.control({"fail_next": [fault]})
    converse(conv, 2, "after the fault ")
    conv.close()
    log = creates(emulator)
    faulted = [r for r in log if r.get("fault") == fault["kind"]]
    assert len(faulted) == 1 and faulted[0]["previous_response_id"] is not None
    retry = log[log.index(faulted[0]) + 1]
    assert retry["transport"] == "websocket" and retry["socket"] != faulted[0]["socket"]
    assert retry["previous_response_id"] == faulted[0]["previous_response_id"] and retry["hydrated"] is True
    reached = [r for r in log if r.get("fault") is None and r.get("status_code") == 200]
    assert all(r["continued"] for r in reached[1:])
    assert_context_preserved(conv.sent, reached)
    assert "internal error" not in proxy.output()
