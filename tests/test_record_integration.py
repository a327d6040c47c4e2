"""The continuation record (seed 003) through real mitmdump: every
LLM API flow gets the seed's record and a mapping audit, in flow.metadata, in
flows saved with -w, in the record file, and as a chain tag in its comment."""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest
from driver import ChainedConversation, Conversation, httpx, user_turns
from google import genai
from mitmproxy import flowfilter, io

SEED_KEYS = {"chainId", "previousTurnId", "resumeFrom", "stickyScope", "stateOrigin", "restored",
             "toolContinuation", "protocolHints", "turnId"}


def wait_for_lines(path, count: int, timeout: float = 10) -> None:
    """Until the record file holds ``count`` lines: every flow's answer is in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the record file has not reached {count} lines")


def saved_flows(path) -> list:
    with open(path, "rb") as f:
        return [flow for flow in io.FlowReader(f).stream() if "continuation" in flow.metadata]


def test_a_full_history_conversation_is_one_chain_turn_by_turn(emulator, start_proxy, tmp_path):
    flows_file, record_file = tmp_path / "flows", tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "-w", str(flows_file), "--set", f"stateful_record_file={record_file}")
    conv = Conversation(proxy.url)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    wait_for_lines(record_file, len(conv.sent))
    proxy.stop()
    flows = saved_flows(flows_file)
    records = [f.metadata["continuation"] for f in flows]
    assert len(records) == len(conv.sent) and all(set(r) == SEED_KEYS for r in records)
    assert len({r["chainId"] for r in records}) == 1
    assert records[0]["previousTurnId"] is None and records[0]["stickyScope"] == "request"
    for before, after in zip(records, records[1:], strict=False):
        assert after["previousTurnId"] == before["turnId"]
        assert after["stickyScope"] == "request_chain" and after["restored"] is True  # continued upstream
        assert after["resumeFrom"]["turnId"] == before["turnId"]
    tool_turn = next(r for r in records if r["toolContinuation"]["pendingToolCallIds"])
    answer_turn = records[records.index(tool_turn) + 1]
    assert answer_turn["toolContinuation"]["submittedToolCallIds"] == tool_turn["toolContinuation"]["pendingToolCallIds"]
    assert answer_turn["stateOrigin"] == "tool-loop" and answer_turn["toolContinuation"]["mode"] == "tool_outputs"
    assert all(o.keys() == {"callId", "name", "bytes", "digest"}
               for o in answer_turn["toolContinuation"]["resumeOutputs"])
    audits = [f.metadata["audit"]["protocolMapping"] for f in flows]
    assert any(e["field"] == "store" for e in audits[0]["lossy"])  # the forced store
    assert all(any(e["field"] == "input" and e["source"] == "proxy" for e in a["preserved"]) for a in audits[1:])
    tag = "chain:" + records[0]["chainId"].rsplit("_", 1)[-1][:8]
    only_this = flowfilter.parse(f"~comment {tag}")
    assert all(only_this(f) for f in flows) and all(f.comment.startswith(tag) for f in flows)
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert [line["continuation"]["turnId"] for line in lines] == [r["turnId"] for r in records]
    assert {line["protocol"] for line in lines} == {"openai-responses"}
    assert all(line.keys() == {"flow", "time", "protocol", "model", "transport", "continuation", "audit"}
               for line in lines)
    assert all(line["transport"] == {"client": "http", "upstream": "http"} for line in lines)
    text = record_file.read_text()
    assert "turn 0" not in text and "temp_c" not in text  # no prompt text, no tool result


def test_conversations_forks_and_previous_response_id_chains(emulator, start_proxy, tmp_path):
    flows_file, record_file = tmp_path / "flows", tmp_path / "records.jsonl"
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "-w", str(flows_file), "--set", "stateful_emulate=always",
                        "--set", f"stateful_record_file={record_file}")
    one, two = ChainedConversation(proxy.url), ChainedConversation(proxy.url)
    for n in range(3):
        one.turn(f"first conversation {n}")
        two.turn(f"second conversation {n}")
    fork_from = one.previous
    one.turn("first conversation, one more")
    with httpx.Client(trust_env=False, timeout=30) as c:  # regenerate from the same answer: a fork
        forked = c.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-test-key"},
                        json={"model": "gpt-test", "input": "another direction", "previous_response_id": fork_from})
        assert forked.status_code == 200
    one.close()
    two.close()
    wait_for_lines(record_file, 8)
    proxy.stop()
    records = [f.metadata["continuation"] for f in saved_flows(flows_file)]
    first = [r for r in records[:-1] if r["chainId"] == records[0]["chainId"]]
    second = [r for r in records if r["chainId"] == records[1]["chainId"]]
    assert len(first) == 4 and len(second) == 3  # two conversations, never one chain
    assert all(r["resumeFrom"]["previousResponseId"] for r in first[1:])
    fork = records[-1]
    assert fork["chainId"] not in (records[0]["chainId"], records[1]["chainId"])
    assert fork["resumeFrom"]["responseId"] == fork_from and fork["resumeFrom"]["turnId"] == first[2]["turnId"]
    audits = [f.metadata["audit"]["protocolMapping"] for f in saved_flows(flows_file)]
    assert all(any(e["field"] == "previous_response_id" for e in a["dropped"]) for a in audits[2:])


def test_records_survive_a_restart_and_the_file_keeps_appending(emulator, start_proxy, tmp_path):
    record_file = tmp_path / "records.jsonl"
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}", confdir=confdir)
    conv = Conversation(proxy.url)
    for text in user_turns(2):
        conv.turn(text)
    wait_for_lines(record_file, len(conv.sent))
    proxy.stop()
    start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}", confdir=confdir, port=proxy.port)
    conv.turn("after the restart")
    conv.close()
    wait_for_lines(record_file, len(conv.sent))
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert len({line["continuation"]["chainId"] for line in lines}) == 1  # the chain outlived the process
    assert lines[-1]["continuation"]["previousTurnId"] == lines[-2]["continuation"]["turnId"]


# -- the three other protocols, with their real SDKs ------------------------------------

def _chat_conversation(base_url: str, streamed: bool) -> None:
    from test_emulator_protocols import chat_turn

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-chat", max_retries=0,
                           http_client=httpx.Client(trust_env=False))
    messages: list = [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": 'Weather? call:get_weather({"city": "Paris"})'}]
    for text in ("thanks", "and tomorrow?"):
        choice = chat_turn(client, messages, streamed)
        messages.append(choice.message)  # the SDK's own object, echoed back as real agents do
        for call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "21C"})
            choice = chat_turn(client, messages, streamed)
            messages.append(choice.message)
        messages.append({"role": "user", "content": text})
    client.close()


def _anthropic_conversation(base_url: str, streamed: bool) -> None:
    from test_emulator_protocols import anthropic_turn

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-ant", max_retries=0,
                                 http_client=httpx.Client(trust_env=False))
    messages: list = [{"role": "user", "content": 'Weather? call:get_weather({"city": "Paris"})'}]
    for text in ("thanks", "and tomorrow?"):
        message = anthropic_turn(client, messages, streamed)
        messages.append({"role": "assistant", "content": message.content})
        uses = [block for block in message.content if block.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                          "content": "21C"} for u in uses]})
            message = anthropic_turn(client, messages, streamed)
            messages.append({"role": "assistant", "content": message.content})
        messages.append({"role": "user", "content": text})
    client.close()


def _gemini_conversation(base_url: str, streamed: bool) -> None:
    from google.genai import types
    from test_emulator_protocols import gemini_turn

    client = genai.Client(api_key="g-key", http_options=types.HttpOptions(
        base_url=base_url, retry_options=types.HttpRetryOptions(attempts=1)))
    contents: list = [types.Content(role="user", parts=[types.Part(
        text='Weather? call:get_weather({"city": "Paris"})')])]
    for text in ("thanks", "and tomorrow?"):
        content = gemini_turn(client, contents, streamed)
        contents.append(content)
        calls = [part.function_call for part in content.parts if part.function_call]
        if calls:
            contents.append(types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                id=c.id, name=c.name, response={"temp_c": 21})) for c in calls]))
            contents.append(gemini_turn(client, contents, streamed))
        contents.append(types.Content(role="user", parts=[types.Part(text=text)]))


CONVERSATIONS = {"openai-chat": _chat_conversation, "anthropic-messages": _anthropic_conversation,
                 "gemini-chat": _gemini_conversation}


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("protocol", sorted(CONVERSATIONS))
def test_every_protocols_conversation_is_one_chain_with_its_tool_loop(emulator, start_proxy, tmp_path,
                                                                      protocol, streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    CONVERSATIONS[protocol](proxy.url, streamed)
    served = [r for r in emulator.model.snapshot_log() if r["status_code"] == 200]
    assert len(served) == 3  # the call, the answer to its result, the answer to "thanks"
    wait_for_lines(record_file, len(served))
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert {line["protocol"] for line in lines} == {protocol}
    records = [line["continuation"] for line in lines]
    assert all(set(r) == SEED_KEYS for r in records)
    assert len({r["chainId"] for r in records}) == 1, "one conversation, one chain"
    for before, after in zip(records, records[1:], strict=False):
        assert after["previousTurnId"] == before["turnId"] and after["stickyScope"] == "conversation"
    call, result = records[0], records[1]
    assert call["toolContinuation"]["mode"] == "tool_calls" and call["toolContinuation"]["pendingToolCallIds"]
    assert result["toolContinuation"]["submittedToolCallIds"] == call["toolContinuation"]["pendingToolCallIds"]
    assert result["stateOrigin"] == "tool-loop"
    for line in lines:  # the audit is never silent, and says there is no server-side continuation
        mapping = line["audit"]["protocolMapping"]
        assert any(mapping[d] for d in ("preserved", "lossy", "dropped", "unsupported"))
        assert mapping["unsupported"], "no server-side continuation must be said"
    assert "Paris" not in record_file.read_text() and "21C" not in record_file.read_text()


def _next_request(path: str, body: dict, answer: dict) -> dict:
    """The client's second request: its history, the answer, one more user turn."""
    if "gemini" in path:
        return {"contents": [*body["contents"], answer["candidates"][0]["content"],
                             {"role": "user", "parts": [{"text": "and then?"}]}]}
    said = answer["choices"][0]["message"] if "chat" in path else {"role": "assistant", "content": answer["content"]}
    return {**body, "messages": [*body["messages"], said, {"role": "user", "content": "and then?"}]}


@pytest.mark.parametrize(("path", "header"), [
    ("/v1beta/models/gemini-test:generateContent", "x-goog-api-key"),
    ("/v1/messages", "x-api-key"),
    ("/v1/chat/completions", "api-key"),
])
def test_another_tenant_resending_a_history_word_for_word_never_joins_its_chain(emulator, start_proxy, tmp_path,
                                                                                path, header):
    """Each protocol's own credential header keeps tenants apart in the record."""
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    if "gemini" in path:
        body = {"contents": [{"role": "user", "parts": [{"text": "same words"}]}]}
    else:
        body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "same words"}]}
    with httpx.Client(trust_env=False, timeout=30, headers={"anthropic-version": "2023-06-01"}) as c:
        first = c.post(proxy.url + path, json=body, headers={header: "tenant-a"})
        assert first.status_code == 200, first.text
        second = _next_request(path, body, first.json())
        for key in ("tenant-a", "tenant-b"):
            assert c.post(proxy.url + path, json=second, headers={header: key}).status_code == 200
    wait_for_lines(record_file, 3)
    first, same_tenant, other_tenant = (json.loads(line)["continuation"]
                                        for line in record_file.read_text().splitlines())
    assert same_tenant["chainId"] == first["chainId"] and same_tenant["previousTurnId"] == first["turnId"]
    assert other_tenant["chainId"] != first["chainId"] and other_tenant["previousTurnId"] != first["turnId"]


def test_a_request_nested_past_any_sense_is_recorded_as_such_without_an_internal_error(emulator, start_proxy):
    nested = b'{"deeper":[' * 300 + b'"bottom"' + b',1]}' * 300  # 600 levels: parsed, then too deep to walk
    body = (b'{"model":"gpt-test","input":[{"role":"user","content":"x"},'
            b'{"type":"function_call_output","call_id":"c","output":"o","extra":' + nested + b'}]}')
    proxy = start_proxy(emulator.url)
    with httpx.Client(trust_env=False, timeout=30) as c:
        answer = c.post(proxy.url + "/v1/responses", content=body,
                        headers={"authorization": "Bearer k", "content-type": "application/json"})
    assert answer.status_code in (200, 400)  # the upstream's own answer, whatever it makes of it
    assert "internal error" not in proxy.output()
