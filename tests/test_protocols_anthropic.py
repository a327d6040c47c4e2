"""anthropic-messages lifting: requests, JSON answers, and streamed answers
reassembled the way the anthropic SDK's accumulate_event does."""

from __future__ import annotations

import json

import pytest
from protocols_support import lift, lift_answer, sse_bytes
from stateful_responses.record.protocols import AnswerLifter, detect, lift_request

URL = "https://api.anthropic.com/v1/messages"


def body(**fields) -> bytes:
    return json.dumps({"model": "claude-x", "max_tokens": 10, **fields}).encode()


def test_detect_by_endpoint():
    assert detect("POST", URL) == "anthropic-messages"
    assert detect("POST", URL + "/count_tokens") is None
    assert detect("POST", URL + "/batches") is None


def test_request_system_roles_tool_use_and_results():
    lifted = lift("anthropic-messages", URL, body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "c2ln"},
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"}]},
        ]))
    assert lifted.system == [{"type": "text", "text": "Be brief."}]
    assert lifted.messages[0] == {"role": "user", "content": [{"type": "text", "text": "Weather?"}]}
    assert lifted.messages[2]["content"][0] == {
        "type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "text", "text": "sunny"}]}
    assert [(r.call_id, r.name) for r in lifted.submitted_tool_results] == [("toolu_a", "get_weather")]
    audit = {(e.field, e.disposition) for e in lifted.audit}
    assert {("system", "preserved"), ("continuation", "unsupported"), ("cache_control", "dropped")} <= audit


@pytest.mark.parametrize("doc", [{"model": "m"}, {"messages": {"role": "user"}}, None])
def test_not_a_messages_body(doc):
    assert lift_request("anthropic-messages", URL, json.dumps(doc).encode()) is None


def test_json_answer_keeps_thinking_signatures_and_redacted_thinking():
    doc = {"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": "tool_use", "content": [
        {"type": "thinking", "thinking": "Hmm.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Checking.", "citations": None},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    answer = lift_answer("anthropic-messages", json.dumps(doc).encode(), sse=False)
    assert answer.messages == [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Hmm.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Checking."},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]
    assert (answer.response_id, answer.status, answer.finish_reason) == ("msg_1", "completed", "tool_use")
    assert answer.pending_tool_calls == ["toolu_1"]  # the server ran its own tool


@pytest.mark.parametrize("stop, status", [("end_turn", "completed"), ("stop_sequence", "completed"),
                                          ("max_tokens", "incomplete"), ("pause_turn", "incomplete"),
                                          ("refusal", "failed"), ("something_new", "incomplete"), (None, "unknown")])
def test_stop_reason_to_status(stop, status):
    doc = {"type": "message", "role": "assistant", "content": [], "stop_reason": stop}
    assert lift_answer("anthropic-messages", json.dumps(doc).encode(), sse=False).status == status


def start(**message) -> tuple:
    return ("message_start", {"type": "message_start", "message": {
        "id": "msg_7", "type": "message", "role": "assistant", "content": [], "stop_reason": None, **message}})


def block(index: int, **content_block) -> tuple:
    return ("content_block_start", {"type": "content_block_start", "index": index, "content_block": content_block})


def delta(index: int, **d) -> tuple:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})


STOP = [("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"})]


def test_stream_reassembles_thinking_text_citations_and_tool_input():
    citation = {"type": "char_location", "cited_text": "x", "document_index": 0, "start_char_index": 0, "end_char_index": 1}
    events = [
        start(),
        block(0, type="thinking", thinking="", signature=""),
        delta(0, type="thinking_delta", thinking="Think"),
        delta(0, type="thinking_delta", thinking="ing."),
        delta(0, type="signature_delta", signature="c2ln"),
        block(1, type="text", text=""),
        delta(1, type="text_delta", text="It is "),
        delta(1, type="citations_delta", citation=citation),
        delta(1, type="text_delta", text="sunny."),
        block(2, type="tool_use", id="toolu_9", name="f", input={}),
        delta(2, type="input_json_delta", partial_json="{\"b\": [1, "),
        delta(2, type="input_json_delta", partial_json="2], \"a\": null}"),
        block(3, type="tool_use", id="toolu_10", name="g", input={}),
        *STOP,
    ]
    answer = lift_answer("anthropic-messages", sse_bytes(events), sse=True)
    assert answer.messages == [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Thinking.", "signature": "c2ln"},
        {"type": "text", "text": "It is sunny.", "citations": [citation]},
        {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {"b": [1, 2], "a": None}},
        {"type": "tool_use", "id": "toolu_10", "name": "g", "input": {}}]}]
    assert (answer.status, answer.pending_tool_calls) == ("completed", ["toolu_9", "toolu_10"])


def test_stream_complete_at_message_stop():
    lifter = AnswerLifter("anthropic-messages")
    for name, data in [start(), block(0, type="text", text="Hi"), STOP[0]]:
        lifter.event(name, json.dumps(data))
    assert not lifter.complete
    name, data = STOP[1]
    lifter.event(name, json.dumps(data))
    assert lifter.complete


def test_stream_cut_off_inside_tool_input_never_equals_an_echo():
    events = [start(), block(0, type="tool_use", id="toolu_1", name="f", input={}),
              delta(0, type="input_json_delta", partial_json="{\"city\": \"Par"),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}})]
    answer = lift_answer("anthropic-messages", sse_bytes(events), sse=True)
    assert answer.status == "incomplete"
    assert answer.messages[0]["content"][0]["input"] == {"$unparsed_json": "{\"city\": \"Par"}
    assert ("content[].input", "lossy") in [(e.field, e.disposition) for e in answer.audit]


def test_error_event_and_error_body_are_failed_answers():
    events = [start(), block(0, type="text", text="Hi"),
              ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})]
    streamed = lift_answer("anthropic-messages", sse_bytes(events), sse=True)
    whole = lift_answer("anthropic-messages", b'{"type": "error", "error": {"type": "invalid_request_error"}}', sse=False)
    assert (streamed.status, streamed.messages) == (whole.status, whole.messages) == ("failed", [])
