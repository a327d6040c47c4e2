"""openai-chat lifting: requests, JSON answers, and streamed answers
reassembled the way openai-python's stream helper does."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming._deltas import accumulate_delta as sdk_accumulate_delta
from protocols_support import lift, lift_answer, sse_bytes
from stateful_responses.record.protocols import AnswerLifter, detect, lift_request
from stateful_responses.record.protocols.chat import accumulate_delta

URL = "https://api.openai.com/v1/chat/completions"


def body(**fields) -> bytes:
    return json.dumps({"model": "gpt-x", **fields}).encode()


def chunk(delta: dict, finish: str | None = None, index: int = 0) -> dict:
    return {"id": "chatcmpl-7", "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def test_detect_by_endpoint():
    assert detect("POST", URL) == "openai-chat"
    assert detect("POST", "http://127.0.0.1:8080/openai/deployments/x/chat/completions?api-version=1") == "openai-chat"
    assert detect("GET", URL) is None


def test_request_roles_tool_calls_and_results():
    lifted = lift("openai-chat", URL, body(stream=True, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "noon"}]},
    ]))
    assert (lifted.model, lifted.stream, lifted.system, lifted.previous_response_id) == ("gpt-x", True, None, None)
    assert [m["role"] for m in lifted.messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert lifted.messages[2] == {"role": "assistant", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"$json": {"city": "Paris"}}}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {"$json": {}}}}]}
    assert [(r.call_id, r.name) for r in lifted.submitted_tool_results] == [("call_a", "get_weather"), ("call_b", "get_time")]
    assert lifted.submitted_tool_results[0].output_bytes > 0 and len(lifted.submitted_tool_results[0].digest) == 32
    assert ("continuation", "unsupported") in [(e.field, e.disposition) for e in lifted.audit]


def test_tool_results_before_the_last_assistant_message_are_not_submitted_now():
    lifted = lift("openai-chat", URL, body(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "x"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]))
    assert lifted.submitted_tool_results == []


@pytest.mark.parametrize("doc", [{"model": "m"}, {"messages": "hi"}, [1, 2], "text"])
def test_not_a_chat_body(doc):
    assert lift_request("openai-chat", URL, json.dumps(doc).encode()) is None


def test_json_answer_with_tool_calls():
    answer = lift_answer("openai-chat", json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]}).encode(), sse=False)
    assert (answer.response_id, answer.status, answer.finish_reason) == ("chatcmpl-1", "completed", "tool_calls")
    assert answer.messages == [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"$json": {"a": 1}}}}]}]
    assert answer.pending_tool_calls == ["call_1"]


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("length", "incomplete"),
                                            ("content_filter", "incomplete"), (None, "unknown")])
def test_finish_reason_to_status(finish, status):
    doc = {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": "x"}}]}
    assert lift_answer("openai-chat", json.dumps(doc).encode(), sse=False).status == status


def test_only_choice_zero_is_lifted():
    doc = {"choices": [{"index": 1, "finish_reason": "stop", "message": {"role": "assistant", "content": "B"}},
                       {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "A"}}]}
    answer = lift_answer("openai-chat", json.dumps(doc).encode(), sse=False)
    assert answer.messages == [{"role": "assistant", "content": [{"type": "text", "text": "A"}]}]
    assert ("choices[1:]", "dropped") in [(e.field, e.disposition) for e in answer.audit]


def test_error_body_is_a_failed_answer():
    answer = lift_answer("openai-chat", b'{"error": {"message": "no", "type": "invalid_request_error"}}', sse=False)
    assert (answer.status, answer.messages) == ("failed", [])


def test_stream_reassembles_text_reasoning_and_interleaved_tool_call_fragments():
    events = [
        chunk({"role": "assistant", "content": None, "reasoning_content": "Two "}),
        chunk({"reasoning_content": "cities."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"ci"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "ty\": \"Oslo\"}"}}]}),
        chunk({}, "tool_calls"),
        {"id": "chatcmpl-7", "object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 3}},
        "[DONE]",
    ]
    answer = lift_answer("openai-chat", sse_bytes(events), sse=True)
    assert answer.messages == [{"role": "assistant", "reasoning_content": "Two cities.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"$json": {"city": "Paris"}}}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": {"$json": {"city": "Oslo"}}}}]}]
    assert (answer.status, answer.pending_tool_calls) == ("completed", ["call_a", "call_b"])


def test_stream_is_complete_at_choice_zeros_finish_reason():
    lifter = AnswerLifter("openai-chat")
    lifter.event("", json.dumps(chunk({"role": "assistant", "content": "Hi"})))
    assert not lifter.complete
    lifter.event("", json.dumps(chunk({}, "stop")))
    assert lifter.complete
    assert lifter.finish().messages == [{"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}]


def test_stream_skips_content_filter_events_and_fails_on_an_error_chunk():
    filtered = {"id": "", "object": "", "choices": [{"index": 0, "delta": {"content": "IGNORED"}}]}
    answer = lift_answer("openai-chat", sse_bytes([chunk({"role": "assistant", "content": "ok"}), filtered,
                                                   chunk({}, "stop"), "[DONE]"]), sse=True)
    assert answer.messages[0]["content"] == [{"type": "text", "text": "ok"}]
    failed = lift_answer("openai-chat", sse_bytes([chunk({"content": "o"}), {"error": {"message": "overloaded"}}]), sse=True)
    assert (failed.status, failed.messages) == ("failed", [])


def test_a_stream_the_sdk_cannot_accumulate_lifts_to_none():
    first = chunk({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": "{"}}]})
    broken = chunk({"tool_calls": [{"function": {"arguments": "}"}}]})  # a fragment without its index
    assert lift_answer("openai-chat", sse_bytes([first, broken]), sse=True) is None


_FRAGMENT = st.fixed_dictionaries({}, optional={
    "index": st.one_of(st.integers(-3, 3), st.just("0")),
    "id": st.sampled_from(["call_a", "call_b"]),
    "type": st.just("function"),
    "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "g"]),
                                                    "arguments": st.sampled_from(["{", "}", "\"x\": 1"])}),
})
_DELTA = st.fixed_dictionaries({}, optional={
    "role": st.just("assistant"),
    "content": st.one_of(st.none(), st.sampled_from(["a", "b"])),
    "refusal": st.none(),
    "tool_calls": st.lists(st.one_of(_FRAGMENT, st.just("not an object")), max_size=3),
    "logprobs": st.one_of(st.none(), st.fixed_dictionaries({"content": st.lists(st.integers(0, 2), max_size=2)})),
})


@given(st.lists(_DELTA, max_size=5))
def test_deltas_accumulate_as_openai_python_accumulates_them(deltas):
    """Our port of the SDK's accumulator: the same message, or an error where
    the SDK raises one (its client then gets no message)."""
    ours: dict = {}
    theirs: dict = {}
    try:
        for delta in deltas:
            theirs = sdk_accumulate_delta(theirs, copy.deepcopy(delta))
    except Exception:  # noqa: BLE001 (whatever the SDK raises, the client gets no message)
        with pytest.raises(TypeError):
            for delta in deltas:
                ours = accumulate_delta(ours, copy.deepcopy(delta))
        return
    for delta in deltas:
        ours = accumulate_delta(ours, copy.deepcopy(delta))
    assert ours == theirs
