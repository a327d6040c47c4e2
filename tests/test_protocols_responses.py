"""openai-responses lifting: items in items.normalize_item's form,
previous_response_id, instructions kept apart, answers JSON and SSE."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from protocols_support import lift, lift_answer, sse_bytes
from stateful_responses.emulator import sse_events
from stateful_responses.items import normalize_item
from stateful_responses.request_reader import Reader, Reading, Request
from stateful_responses.record.protocols import AnswerLifter, detect, lift_request, responses

URL = "https://api.openai.com/v1/responses"
OUTPUT = [
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
    {"type": "web_search_call", "id": "ws_1", "status": "completed"},
]
RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": OUTPUT}


def test_detect_by_endpoint():
    assert detect("POST", URL) == detect("POST", URL + "/") == "openai-responses"
    assert detect("POST", URL + "/resp_1/cancel") is None


def test_request_items_instructions_and_previous_response_id():
    lifted = lift("openai-responses", URL, json.dumps({
        "model": "gpt-x", "stream": True, "instructions": "Be brief.", "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"role": "user", "content": "And tomorrow?"}]}).encode())
    assert (lifted.model, lifted.stream, lifted.system, lifted.previous_response_id) == ("gpt-x", True, "Be brief.", "resp_1")
    assert lifted.messages[1] == normalize_item({"role": "user", "content": "And tomorrow?"})
    assert [r.call_id for r in lifted.submitted_tool_results] == ["call_1"]
    assert ("previous_response_id", "preserved") in [(e.field, e.disposition) for e in lifted.audit]


def test_string_input_is_one_user_message_and_tool_names_come_from_the_calls():
    assert lift("openai-responses", URL, b'{"model": "m", "input": "Hi"}').messages == [
        normalize_item({"role": "user", "content": "Hi"})]
    lifted = lift("openai-responses", URL, json.dumps({"input": [
        {"role": "user", "content": "Weather?"}, *OUTPUT[:2],
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}).encode())
    assert [(r.call_id, r.name) for r in lifted.submitted_tool_results] == [("call_1", "get_weather")]


@pytest.mark.parametrize("conversation", ['"conv_1"', '{"id": "conv_1"}'])
def test_a_response_in_a_conversation_names_it(conversation):
    lifted = lift("openai-responses", URL, b'{"model": "m", "input": "Hi", "conversation": %s}' % conversation.encode())
    assert lifted.conversation_id == "conv_1"
    assert ("conversation", "preserved") in [(e.field, e.disposition) for e in lifted.audit]


@pytest.mark.parametrize("doc", [{"input": 3}, [], "x"])
def test_not_a_responses_body(doc):
    assert lift_request("openai-responses", URL, json.dumps(doc).encode()) is None


def test_json_answer():
    answer = lift_answer("openai-responses", json.dumps(RESPONSE).encode(), sse=False)
    assert answer.messages == [normalize_item(i) for i in OUTPUT]
    assert (answer.response_id, answer.status, answer.pending_tool_calls) == ("resp_1", "completed", ["call_1"])


def test_sse_answer_and_its_terminal_event():
    events = sse_events(json.loads(json.dumps(RESPONSE)))
    lifter = AnswerLifter("openai-responses")
    for event in events[:-1]:
        lifter.event(event["type"], json.dumps(event))
    assert not lifter.complete
    lifter.event(events[-1]["type"], json.dumps(events[-1]))
    assert lifter.complete
    assert lifter.finish().messages == [normalize_item(i) for i in OUTPUT]


def test_sse_output_from_item_done_events_when_the_final_output_is_empty():
    events = sse_events(json.loads(json.dumps(RESPONSE)))
    events[-1]["response"]["output"] = []
    answer = lift_answer("openai-responses", sse_bytes(events), sse=True)  # no event names: types in the data
    assert answer.messages == [normalize_item(i) for i in OUTPUT]


def test_status_is_the_responses_not_the_events():
    incomplete = {**RESPONSE, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    answer = lift_answer("openai-responses", sse_bytes([("response.completed", {
        "type": "response.completed", "response": incomplete})]), sse=True)
    assert (answer.status, answer.finish_reason) == ("incomplete", "max_output_tokens")


def test_error_event_and_error_body_are_failed_answers():
    streamed = lift_answer("openai-responses", sse_bytes([("error", {"type": "error", "code": "server_error"})]), sse=True)
    whole = lift_answer("openai-responses", b'{"error": {"message": "nope", "type": "invalid_request_error"}}', sse=False)
    assert (streamed.status, streamed.messages) == (whole.status, whole.messages) == ("failed", [])


_ITEM_KINDS = st.sampled_from([
    {"role": "user", "content": "a question"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "an answer"}]},
    {"role": "assistant", "content": "an easy answer", "type": None},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
    {"type": "custom_tool_call", "call_id": "call_2", "name": "patch", "input": "x"},
    {"type": "function_call", "call_id": 7, "name": None, "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "21C"}]},
    {"type": "custom_tool_call_output", "call_id": "call_2", "output": "done", "id": None},
    {"type": "function_call_output", "call_id": None, "output": "orphan"},
    {"type": "item_reference", "id": "msg_9"},
    {"id": "msg_8"},
])


@settings(max_examples=300)
@given(st.lists(_ITEM_KINDS, max_size=8))
@example([  # a result whose call came before the model's last turn (found by CI)
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
    {"role": "user", "content": "a question"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "an answer"}]},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
])
def test_lifting_from_the_planners_reading_equals_lifting_the_body(items):
    """The record lifts a Responses request from the planner's raw spans
    (only the tail's shapes read); the result is the full lift's."""
    doc = {"model": "m", "instructions": "Be brief.", "input": items}
    body = json.dumps(doc).encode()
    reading = Reader().read(Request("POST", URL, {"authorization": "Bearer k"}, body))
    assert isinstance(reading, Reading)
    fast = responses.lift_read({"model": "m", "instructions": "Be brief."}, reading.raw_items, reading.digests)
    full = lift("openai-responses", URL, body)
    assert fast.submitted_tool_results == full.submitted_tool_results
    assert (fast.model, fast.system, fast.audit) == (full.model, full.system, full.audit)
    everywhere = range(len(items))
    assert [fast.items.kind(i) for i in everywhere] == [full.items.kind(i) for i in everywhere]
    assert fast.items.ids(everywhere) == full.items.ids(everywhere)
    calls = {"call_1", "call_2"}
    assert all(fast.items.results(i, calls) == full.items.results(i, calls) for i in everywhere)
