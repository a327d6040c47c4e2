"""Lifters never raise and never touch their input, whatever they are fed,
and what they lift always has canonical JSON (the prefix hash needs it)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stateful_responses.items import canonical_json
from stateful_responses.record.protocols import MODULES, AnswerLifter, LiftedAnswer, LiftedRequest, detect, lift_request

PROTOCOLS = list(MODULES)
URLS = {
    "openai-responses": "http://127.0.0.1/v1/responses",
    "openai-chat": "http://127.0.0.1/v1/chat/completions",
    "anthropic-messages": "http://127.0.0.1/v1/messages",
    "gemini-chat": "http://127.0.0.1/v1beta/models/g:streamGenerateContent?alt=sse",
}
# Field names and values the lifters look at, so that generated JSON reaches
# deep into them instead of being turned away at the top.
WORDS = [
    "role", "content", "type", "text", "tool_calls", "function", "arguments", "id", "index", "name", "tool_call_id",
    "parts", "functionCall", "function_call", "functionResponse", "thoughtSignature", "thought_signature", "thought",
    "inlineData", "data", "args", "response", "messages", "contents", "input", "output", "call_id", "system",
    "systemInstruction", "instructions", "previous_response_id", "delta", "choices", "finish_reason", "candidates",
    "finishReason", "content_block", "message", "stop_reason", "partial_json", "signature", "thinking", "cache_control",
    "error", "object", "model", "stream", "responseId", "continuationToken", "cachedContent", "item", "output_index",
    "tool_use_id", "citation", "citations", "annotations", "promptFeedback", "blockReason",
    "user", "assistant", "model", "tool", "tool_use", "tool_result", "server_tool_use", "text_delta", "input_json_delta",
    "thinking_delta", "signature_delta", "citations_delta", "function_call_output", "reasoning", "message_start",
    "content_block_start", "content_block_delta", "message_delta", "message_stop", "response.completed",
    "response.output_item.done", "chat.completion.chunk", "STOP", "[DONE]", "{\"a\": 1}", "+/+/AHNpZw==", "",
]
EVENT_NAMES = ["", "error", "message_start", "content_block_start", "content_block_delta", "message_delta",
               "message_stop", "response.created", "response.completed", "response.output_item.done"]

words = st.sampled_from(WORDS) | st.text(max_size=4)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | words
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(words, inner, max_size=5),
                           max_leaves=40)
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["messages", "contents", "input", "system", "systemInstruction", "instructions"]),
                    json_values, min_size=1).map(lambda v: json.dumps(v).encode()),
)
events = st.lists(st.tuples(st.sampled_from(EVENT_NAMES) | st.text(max_size=5),
                            json_values.map(json.dumps) | st.text(max_size=20)), max_size=12)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def jsonable(lifted: LiftedRequest | LiftedAnswer) -> None:
    canonical_json(lifted.messages)
    canonical_json(lifted.hints)
    if isinstance(lifted, LiftedRequest):
        canonical_json(lifted.system)


@SETTINGS
@given(st.sampled_from(PROTOCOLS), bodies)
def test_lift_request_never_raises_nor_modifies_the_body(protocol, body):
    data = bytearray(body)
    lifted = lift_request(protocol, URLS[protocol], data)
    assert data == body
    assert lifted is None or isinstance(lifted, LiftedRequest)
    if lifted is not None:
        jsonable(lifted)
        assert lifted.audit


@SETTINGS
@given(st.sampled_from(PROTOCOLS), events, bodies)
def test_answer_lifter_never_raises(protocol, sse_events, body):
    for feed_body in (False, True):
        lifter = AnswerLifter(protocol)
        for name, data in sse_events:
            lifter.event(name, data)
            assert isinstance(lifter.complete, bool)
        if feed_body:
            data = bytearray(body)
            lifter.body(data)
            assert data == body
        answer = lifter.finish()
        assert answer is None or isinstance(answer, LiftedAnswer)
        if answer is not None:
            jsonable(answer)
            assert answer.audit


@given(st.text(max_size=8), st.text(max_size=60))
def test_detect_never_raises(method, url):
    assert detect(method, url) in (None, *PROTOCOLS)


def test_an_unknown_protocol_lifts_nothing():
    assert lift_request("smtp", "http://x", b"{}") is None  # type: ignore[arg-type]
    lifter = AnswerLifter("smtp")  # type: ignore[arg-type]
    lifter.body(b"{}")
    assert (lifter.complete, lifter.finish()) == (False, None)


# Well-formed requests and answers of each protocol; the fuzz below replaces
# random subtrees of them with arbitrary JSON, which reaches every branch.
SIGNATURE = "+/+/AHNpZw=="
REQUESTS = {
    "openai-responses": {"model": "m", "instructions": "Be brief.", "previous_response_id": "resp_1", "input": [
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
    "openai-chat": {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "annotations": [], "parsed": None,
         "function_call": {"name": "g", "arguments": "{}"},
         "tool_calls": [{"index": 0, "id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
    "anthropic-messages": {"model": "m", "system": [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]}]}]},
    "gemini-chat": {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "cachedContent": "c", "continuationToken": "dG9r",
                    "contents": [
        {"role": "user", "parts": [{"text": "Hi"}, {"inline_data": {"mime_type": "image/png", "data": SIGNATURE}}]},
        {"role": "model", "parts": [{"text": "a"}, {"text": "b", "thought": True}]},
        {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}, "thoughtSignature": SIGNATURE}]},
        {"role": "user", "parts": [{"functionResponse": {"id": "x", "name": "f", "response": {"r": 1}}}]}]},
}
def anthropic_block(index: int, **block) -> tuple:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def anthropic_delta(index: int, **delta) -> tuple:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


ANSWER_EVENTS = {
    "openai-responses": [
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                       "item": {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}}),
        ("response.completed", {"type": "response.completed", "response": {
            "id": "r", "status": "completed", "output": [], "incomplete_details": {"reason": "x"}}})],
    "openai-chat": [
        ("", {"id": "x", "object": "chat.completion.chunk",
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}),
        ("", {"choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}}]}),
        ("", {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                           "finish_reason": "tool_calls"}]})],
    "anthropic-messages": [
        ("message_start", {"type": "message_start", "message": {"id": "m", "role": "assistant", "content": []}}),
        anthropic_block(0, type="thinking", thinking=""),
        anthropic_delta(0, type="thinking_delta", thinking="t"),
        anthropic_delta(0, type="signature_delta", signature="s"),
        anthropic_block(1, type="text", text=""),
        anthropic_delta(1, type="citations_delta", citation={}),
        anthropic_block(2, type="tool_use", id="t", input={}),
        anthropic_delta(2, type="input_json_delta", partial_json="{}"),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"}}),
        ("message_stop", {"type": "message_stop"})],
    "gemini-chat": [
        ("", {"responseId": "r", "candidates": [{"index": 0, "content": {"role": "model", "parts": [{"text": "a"}]}}]}),
        ("", {"candidates": [{"content": {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
                              "finishReason": "STOP", "continuationToken": "dG9r"}], "promptFeedback": {}})],
}


@st.composite
def mutated(draw, example):
    """``example`` with random subtrees replaced by arbitrary JSON."""
    def walk(value):
        if draw(st.integers(0, 7)) == 0:
            return draw(json_values)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value
    return walk(example)


@SETTINGS
@given(st.data())
def test_the_lifters_read_odd_requests_without_the_safety_net(data):
    """The dispatch's catch-all is a last resort: odd JSON is read, not escaped from."""
    protocol = data.draw(st.sampled_from(PROTOCOLS))
    lifted = MODULES[protocol].lift_request(URLS[protocol], data.draw(mutated(REQUESTS[protocol])))
    assert lifted is None or isinstance(lifted, LiftedRequest)
    if lifted is not None:
        jsonable(lifted)


ANSWER_BODIES = {
    "openai-responses": ANSWER_EVENTS["openai-responses"][-1][1]["response"],
    "openai-chat": {"id": "x", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "a", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}}]},
    "anthropic-messages": {"id": "m", "type": "message", "stop_reason": "end_turn", "content": [
        {"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
    "gemini-chat": [payload for _, payload in ANSWER_EVENTS["gemini-chat"]],
}


@SETTINGS
@given(st.data())
def test_the_answer_readers_read_odd_answers_without_the_safety_net(data):
    protocol = data.draw(st.sampled_from(PROTOCOLS))
    answer = MODULES[protocol].Answer()
    try:
        for name, payload in ANSWER_EVENTS[protocol]:
            if data.draw(st.integers(0, 9)):  # sometimes an event goes missing
                answer.event(name, json.dumps(data.draw(mutated(payload))))
        if data.draw(st.booleans()):
            answer.body(data.draw(mutated(ANSWER_BODIES[protocol])))
        lifted = answer.finish()
    except TypeError as e:
        # Only where openai-python's own accumulator raises (its client then gets no message).
        assert protocol == "openai-chat" and "list delta entry" in str(e)
        return
    assert lifted is None or isinstance(lifted, LiftedAnswer)
    if lifted is not None:
        jsonable(lifted)
