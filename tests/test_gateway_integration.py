"""A real gateway between the addon and the model: LiteLLM's proxy (no
database) in front of the emulator, through mitmdump with the addon, driven
by the real openai SDK. On every turn the model sees exactly what the client
meant, whichever route LiteLLM takes:

- its chat-completions bridges store nothing, echo ``store: true`` when asked,
  and answer a ``previous_response_id`` 200 with the history dropped: the
  addon must find out before it relies on them (it asks for a response back);
- its native pass-through stores (the emulator keeps the chain), re-encodes
  every id and echoes the upstream's raw one: the addon must keep its savings.
"""

from __future__ import annotations

import json
import re

import pytest
from driver import (
    INSTRUCTIONS,
    ChainedConversation,
    Conversation,
    assert_context_preserved,
    user_turns,
    without_comparisons,
)
from litellm_server import module_emulator

emulator = module_emulator()


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def responses_meaning(items: list) -> list[tuple]:
    """What a Responses history says, turn by turn, in terms a chat
    completion can say too (instructions, messages, tool calls and results)."""
    said: list[tuple] = [("system", INSTRUCTIONS)]
    for item in items:
        item = item if isinstance(item, dict) else item.model_dump()
        kind = item.get("type", "message")
        if kind == "message":
            said.append((item["role"], _text(item["content"])))
        elif kind == "function_call":
            said.append(("call", item["name"], json.loads(item["arguments"])))
        elif kind == "function_call_output":
            said.append(("tool", item["output"]))
    return said


def chat_meaning(messages: list) -> list[tuple]:
    said: list[tuple] = []
    for message in messages:
        if message.get("role") == "tool":
            said.append(("tool", _text(message["content"])))
        elif message.get("tool_calls"):
            said += [("call", c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in message["tool_calls"]]
        else:
            said.append((message["role"], _text(message["content"])))
    return said


def bridged(emulator) -> list[dict]:
    return [r for r in emulator.model.snapshot_log() if r["protocol"] == "openai-chat"]


def assert_every_bridged_turn_saw(meant: list[list], emulator) -> None:
    seen = bridged(emulator)
    assert len(seen) == len(meant), (len(seen), len(meant))
    for n, (items, record) in enumerate(zip(meant, seen, strict=True)):
        assert chat_meaning(record["context"]) == responses_meaning(items), f"request {n}"


BRIDGES = ["chat-bridge", "provider-bridge"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("route", BRIDGES)
def test_a_full_history_client_through_a_bridge_is_never_continued(litellm_gateway, fresh_emulator, start_proxy,
                                                                 route, stream):
    proxy = start_proxy(litellm_gateway.url, "--set", "stateful_debug=true")
    conv = Conversation(proxy.url, api_key=litellm_gateway.master_key, model=route, stream=stream)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    assert_every_bridged_turn_saw([sent.body["input"] for sent in conv.sent], fresh_emulator)
    output = proxy.output()
    assert "continued from" not in output and "rewritten" not in output
    if route == "chat-bridge":  # its GET reaches the upstream, which has nothing: 404
        assert "cannot read back a response it said it stored" in output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("route", BRIDGES)
def test_a_previous_response_id_client_through_a_bridge_keeps_its_context(
        litellm_gateway, fresh_emulator, start_proxy, route, mode, stream):
    proxy = start_proxy(litellm_gateway.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    conv = ChainedConversation(proxy.url, api_key=litellm_gateway.master_key, model=route, stream=stream)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    assert_every_bridged_turn_saw(conv.meant, fresh_emulator)
    assert "internal error" not in proxy.output()


def native_route_conversation(proxy, gateway, emulator, stream: bool) -> tuple[Conversation, list, list[bool]]:
    """Twelve full-history turns through ``proxy`` to LiteLLM's native route, each request's context checked:
    the client, what the emulator behind LiteLLM answered, and which of those were continued."""
    conv = Conversation(proxy.url, api_key=gateway.master_key, model="native", stream=stream)
    for text in user_turns(12):
        conv.turn(text)
    conv.close()
    log = [r for r in without_comparisons(emulator.model.snapshot_log()) if r["protocol"] == "openai-responses"]
    assert_context_preserved(conv.sent, log)
    return conv, log, [r["continued"] for r in log]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_full_history_client_through_the_native_route_keeps_its_savings(litellm_gateway, fresh_emulator,
                                                                           start_proxy, stream):
    proxy = start_proxy(litellm_gateway.url, "--set", "stateful_debug=true")
    conv, log, continued = native_route_conversation(proxy, litellm_gateway, fresh_emulator, stream)
    output = proxy.stop()
    saved = int(re.search(r"bytes_saved=(-?\d+)", output).group(1))
    client = sum(s.size for s in conv.sent)
    ratio = (client - saved) / client
    print(f"\nnative route, {'sse' if stream else 'json'}: {sum(continued)} of {len(log)} requests continued, "
          f"{client - saved} bytes sent to LiteLLM for the client's {client} ({ratio:.2f})")
    # every request after the conversation's first is continued (the second's echo, in LiteLLM's spelling,
    # is settled by the listing of its input items), at 0.27-0.29 of the client's bytes
    assert continued == [False] + [True] * (len(log) - 1)
    assert ratio < 0.32
    assert "ignored previous_response_id" not in output and "from now on" not in output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_with_the_bridge_on_the_native_routes_unused_sockets_are_a_verdict_and_turns_continue_over_http(
        litellm_gateway, fresh_emulator, start_proxy, stream):
    """LiteLLM accepts the upgrade and closes the socket before any event: one turn finds it out, and
    forward mode (forcing store, as with the bridge off) continues every later one over HTTP."""
    proxy = start_proxy(litellm_gateway.url, "--set", "stateful_debug=true", upstream_websocket="auto")
    _, log, continued = native_route_conversation(proxy, litellm_gateway, fresh_emulator, stream)
    output = proxy.stop()
    print(f"\nnative route, bridge on, {'sse' if stream else 'json'}: {sum(continued)} of {len(log)} continued")
    assert len(log) >= 16 and continued == [False] + [True] * (len(log) - 1)
    assert output.count("closed sockets opened for a turn before their first event") == 1
    assert output.count("ws: opening a socket") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_previous_response_id_client_through_the_native_route_keeps_its_context(
        litellm_gateway, fresh_emulator, start_proxy, mode, stream):
    proxy = start_proxy(litellm_gateway.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    conv = ChainedConversation(proxy.url, api_key=litellm_gateway.master_key, model="native", stream=stream)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    log = [r for r in without_comparisons(fresh_emulator.model.snapshot_log()) if r["protocol"] == "openai-responses"]
    assert len(log) == len(conv.meant)
    for n, (meant, record) in enumerate(zip(conv.meant, log, strict=True)):
        assert responses_meaning(record["context"]) == responses_meaning(meant), f"request {n}"
    # from the second request on, continued: the client's own ids in auto, forward mode's (checked) in always
    assert [r["continued"] for r in log] == [False] + [True] * (len(log) - 1)
    output = proxy.stop()
    assert "retrying with the original body" not in output and "from now on" not in output
