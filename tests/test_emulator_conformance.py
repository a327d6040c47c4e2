"""Every answer of the emulator validates against the Open Responses
specification, release 2026-04-24, through openresponses-types (Mozilla.ai's
pydantic models of it), strictly: JSON responses, each SSE event, error bodies
and the other endpoints, across text, tool calls, reasoning, failed and
incomplete answers, streamed and not.

Where OpenAI's API and the spec differ, the emulator follows the API;
``REAL_API_DIFFERENCES`` names each difference and a test below pins it, so
none is skipped silently (docs/emulator.md explains them). What the spec does
not define (OpenAI's Conversations API) is checked against the openai SDK's own
pydantic types, strictly."""

from __future__ import annotations

import json
import time

import openresponses_types as spec
import pytest
from driver import TOOLS, httpx
from openai.types import conversations as sdk_conversations
from openai.types.responses import response as sdk_response
from pydantic import BaseModel, TypeAdapter, ValidationError

REAL_API_DIFFERENCES = {
    "stream_ends_without_done": "The spec ends a stream with a literal `data: [DONE]`; OpenAI's Responses API ends it"
                                " after the terminal event, and clients (the openai SDK) expect no more.",
    "error_type_names": "The spec's error types are invalid_request, not_found, server_error, model_error and"
                        " too_many_requests; the API answers 400, 401 and 404 with type invalid_request_error (as the"
                        " spec's own example does).",
    "reasoning_effort_minimal": "The API accepts and echoes reasoning effort 'minimal' (gpt-5 models); the spec's"
                                " ReasoningEffortEnum lacks it.",
    "endpoints_beyond_the_spec": "The spec defines POST /responses only; GET and DELETE /responses/{id}, its"
                                 " input_items and cancel are the API's. GET and cancel answer a ResponseResource (as"
                                 " the spec's source paths say), listed input items are checked as the spec's items,"
                                 " and the list and delete envelopes as OpenAI's reference writes them.",
    "conversations_beyond_the_spec": "The spec has neither the Conversations API nor a response's `conversation`"
                                     " field. A response made in a conversation still validates as the spec's"
                                     " ResponseResource; the field and the Conversations objects are checked against"
                                     " the openai SDK's types, strictly.",
    "empty_item_list_ids": "The openai SDK's ConversationItemList types first_id and last_id as strings; the API"
                           " answers null for an empty list (captured live), as the emulator does, and the SDK's"
                           " pager reads them as optional.",
}

EVENT_MODELS: dict[str, type[BaseModel]] = {
    member.value: model
    for name in dir(spec) if name.endswith("StreamingEvent")
    for model in [getattr(spec, name)]
    for member in model.model_fields["type"].annotation
}
ITEM_MODELS: dict[str, type[BaseModel]] = {"message": spec.Message, "function_call": spec.FunctionCall,
                                           "function_call_output": spec.FunctionCallOutput,
                                           "reasoning": spec.ReasoningBody}
NON_STRICT_TOOL = {"type": "function", "name": "lookup", "strict": False,
                   "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
CREATE_CASES = {
    "text": {"input": "hello"},
    "function call": {"input": 'call:get_weather({"city": "Oslo"})', "tools": TOOLS + [NON_STRICT_TOOL]},
    "reasoning": {"input": "think", "reasoning": {"effort": "low"}},
    "reasoning with summary and encrypted content": {
        "input": "think", "reasoning": {"effort": "high", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"]},
    "every echoed parameter": {
        "input": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "instructions": "terse", "temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "top_logprobs": 2, "max_output_tokens": 500, "max_tool_calls": 3,
        "safety_identifier": "user-1", "prompt_cache_key": "conv-1", "metadata": {"k": "v"},
        "parallel_tool_calls": False, "tool_choice": "none", "truncation": "auto", "service_tier": "auto",
        "text": {"verbosity": "low"}, "stream_options": {"include_obfuscation": False}},
    "null parameters": {"input": "hi", "temperature": None, "top_p": None, "tool_choice": None},
}


def request(emu, method: str, path: str, body=None, key: str | None = "sk-a") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.request(method, emu.url + path, json=body, headers=headers)


def conforms(model: type[BaseModel], text: str) -> None:
    """Strict: no coercion, every required field present with the spec's type."""
    model.model_validate_json(text, strict=True)


def stream_conforms(text: str) -> list[dict]:
    """Each event validates against the spec's model for its type, is named
    by its ``event:`` line and numbered in order. Returns the events."""
    blocks = [block for block in text.split("\n\n") if block.strip()]
    events = []
    for number, block in enumerate(blocks):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert name == f"event: {event['type']}" and event["sequence_number"] == number
        conforms(EVENT_MODELS[event["type"]], data[len("data: "):])
        events.append(event)
    return events


def error_conforms(answer: httpx.Response, status: int) -> dict:
    """An error answer: the status, and ``{"error": …}`` whose object has every
    field the spec's error payload requires."""
    assert answer.status_code == status
    assert answer.json().keys() == {"error"}
    conforms(spec.ErrorPayload, json.dumps(answer.json()["error"]))
    return answer.json()["error"]


@pytest.mark.parametrize("case", CREATE_CASES)
def test_json_answers_conform(emulator, case):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", **CREATE_CASES[case]})
    assert answer.status_code == 200
    conforms(spec.ResponseResource, answer.text)


@pytest.mark.parametrize("case", CREATE_CASES)
def test_every_streamed_event_conforms(emulator, case):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", **CREATE_CASES[case], "stream": True})
    events = stream_conforms(answer.text)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["failed", "incomplete"])
def test_unfinished_answers_conform(emulator, kind, stream):
    emulator.model.control({"fail_next": [{"kind": kind}]})
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "stream": stream, "tools": TOOLS})
    if stream:
        final = stream_conforms(answer.text)[-1]
        assert final["type"] == f"response.{kind}"
    else:
        conforms(spec.ResponseResource, answer.text)
        final = {"response": answer.json()}
    if kind == "incomplete":  # the spec: an incomplete item is the last one, in an incomplete response
        assert final["response"]["output"][-1]["status"] == "incomplete"


def test_a_stream_failing_midway_ends_with_a_conforming_error_event(emulator):
    emulator.model.control({"fail_next": [{"kind": "stream_error"}]})
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "stream": True})
    events = stream_conforms(answer.text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["error"]["code"] == "server_error"


def test_continuations_and_item_references_conform(emulator):
    first = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "one"}).json()
    for body in ({"input": "two", "previous_response_id": first["id"]},
                 {"input": [{"type": "item_reference", "id": first["output"][0]["id"]}]}):
        conforms(spec.ResponseResource, request(emulator, "POST", "/v1/responses", {"model": "m", **body}).text)
        stream_conforms(request(emulator, "POST", "/v1/responses", {"model": "m", **body, "stream": True}).text)


ERROR_CASES = {
    "no API key": ("POST", "/v1/responses", {"model": "m", "input": "x"}, None, 401),
    "missing model": ("POST", "/v1/responses", {"input": "x"}, "sk-a", 400),
    "input of the wrong type": ("POST", "/v1/responses", {"model": "m", "input": 5}, "sk-a", 400),
    "unknown previous response": ("POST", "/v1/responses", {"model": "m", "input": "x",
                                                           "previous_response_id": "resp_nope"}, "sk-a", 400),
    "unknown item reference": ("POST", "/v1/responses", {"model": "m", "input": [{"type": "item_reference",
                                                                                  "id": "msg_nope"}]}, "sk-a", 404),
    "an item id twice in the input": ("POST", "/v1/responses", {"model": "m", "input": [
        {"type": "message", "role": "user", "id": "msg_twice", "content": "a"},
        {"type": "message", "role": "user", "id": "msg_twice", "content": "b"}]}, "sk-a", 400),
    "unknown response": ("GET", "/v1/responses/resp_nope", None, "sk-a", 404),
    "unknown response's input items": ("GET", "/v1/responses/resp_nope/input_items", None, "sk-a", 404),
    "deleting an unknown response": ("DELETE", "/v1/responses/resp_nope", None, "sk-a", 404),
    "cancelling an unknown response": ("POST", "/v1/responses/resp_nope/cancel", None, "sk-a", 404),
    "unknown URL": ("GET", "/v1/nothing", None, "sk-a", 404),
    "unknown conversation": ("GET", "/v1/conversations/conv_nope", None, "sk-a", 404),
    "unknown conversation's items": ("GET", "/v1/conversations/conv_nope/items", None, "sk-a", 404),
    "a response in an unknown conversation": ("POST", "/v1/responses", {"model": "m", "input": "x",
                                                                        "conversation": "conv_nope"}, "sk-a", 404),
    "conversation with previous_response_id": ("POST", "/v1/responses", {
        "model": "m", "input": "x", "conversation": "conv_nope", "previous_response_id": "resp_nope"}, "sk-a", 400),
    "too many items for a conversation": ("POST", "/v1/conversations", {
        "items": [{"role": "user", "content": "x"}] * 21}, "sk-a", 400),
    "too much metadata for a conversation": ("POST", "/v1/conversations", {
        "metadata": {f"k{n}": "v" for n in range(17)}}, "sk-a", 400),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_error_bodies_conform(emulator, case):
    method, path, body, key, status = ERROR_CASES[case]
    error_conforms(request(emulator, method, path, body, key), status)


def test_error_bodies_of_the_other_endpoints_conform(emulator):
    done = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    error_conforms(request(emulator, "GET", f"/v1/responses/{done['id']}", key="sk-other"), 404)
    error_conforms(request(emulator, "POST", f"/v1/responses/{done['id']}/cancel"), 400)
    error_conforms(request(emulator, "GET", f"/v1/responses/{done['id']}/input_items?limit=101"), 400)
    error_conforms(request(emulator, "GET", f"/v1/responses/{done['id']}/input_items?order=up"), 400)
    emulator.model.control({"fail_next": [{"kind": "status", "status": 503}]})
    error_conforms(request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}), 503)
    with httpx.Client(trust_env=False) as client:
        answer = client.post(emulator.url + "/v1/responses", content=b"{not json",
                             headers={"authorization": "Bearer k"})
    error_conforms(answer, 400)


def test_retrieve_delete_and_input_items_conform(emulator):
    body = {"model": "m", "tools": TOOLS, "input": [
        {"role": "user", "content": "look it up"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_client", "summary": [], "encrypted_content": "enc"},
        {"role": "assistant", "content": "it is sunny"}]}
    first = request(emulator, "POST", "/v1/responses", body).json()
    second = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "and tomorrow?",
                                                         "previous_response_id": first["id"]}).json()
    retrieved = request(emulator, "GET", f"/v1/responses/{second['id']}")
    conforms(spec.ResponseResource, retrieved.text)
    listed = request(emulator, "GET", f"/v1/responses/{second['id']}/input_items?limit=100").json()
    assert listed.keys() == {"object", "data", "first_id", "last_id", "has_more"} and listed["object"] == "list"
    assert {item["type"] for item in listed["data"]} == set(ITEM_MODELS)
    for item in listed["data"]:
        conforms(ITEM_MODELS[item["type"]], json.dumps(item))
    assert request(emulator, "DELETE", f"/v1/responses/{second['id']}").json() == {
        "id": second["id"], "object": "response", "deleted": True}


def test_background_responses_conform_while_queued_running_and_done(emulator):
    emulator.model.control({"background_delay_ms": 300})
    queued = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True})
    conforms(spec.ResponseResource, queued.text)
    states = {queued.json()["status"]}
    deadline = time.monotonic() + 10
    while "completed" not in states and time.monotonic() < deadline:
        polled = request(emulator, "GET", f"/v1/responses/{queued.json()['id']}")
        conforms(spec.ResponseResource, polled.text)
        states.add(polled.json()["status"])
        time.sleep(0.02)
    assert states == {"queued", "in_progress", "completed"}
    cancelled = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True}).json()
    conforms(spec.ResponseResource, request(emulator, "POST", f"/v1/responses/{cancelled['id']}/cancel").text)


def test_a_streamed_background_response_conforms(emulator):
    emulator.model.control({"background_delay_ms": 100})
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "background": True,
                                                         "stream": True})
    types = [event["type"] for event in stream_conforms(answer.text)]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.completed"


# -- OpenAI's Conversations API, which the spec does not define -----------------


def sdk_conforms(model: type[BaseModel], text: str) -> None:
    """Strict against the openai SDK's own type: no coercion, every required field."""
    model.model_validate_json(text, strict=True)


CONVERSATION_ITEM = TypeAdapter(sdk_conversations.ConversationItem)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_in_a_conversation_conforms(emulator, stream):
    conversation = request(emulator, "POST", "/v1/conversations", {}).json()
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "stream": stream,
                                                         "conversation": conversation["id"]})
    if stream:
        responses = [event["response"] for event in stream_conforms(answer.text) if "response" in event]
    else:
        conforms(spec.ResponseResource, answer.text)
        responses = [answer.json()]
    for response in responses:
        sdk_conforms(sdk_response.Conversation, json.dumps(response["conversation"]))
        assert response["conversation"] == {"id": conversation["id"]}


def test_a_duplicate_item_is_refused_in_the_apis_exact_body(emulator):
    """An input item whose id the input already holds, or (in a conversation)
    the conversation already holds, references resolved: 400, as public
    captures of the API record it; an item given back once outside a
    conversation is no duplicate."""
    def duplicate(item_id: str) -> dict:
        return {"message": f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try"
                           " again.", "type": "invalid_request_error", "param": "input", "code": None}

    done = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    output = done["output"][0]
    twice = request(emulator, "POST", "/v1/responses", {"model": "m", "input": [
        output, {"type": "item_reference", "id": output["id"]}]})
    assert error_conforms(twice, 400) == duplicate(output["id"])
    once = request(emulator, "POST", "/v1/responses", {"model": "m", "input": [output, {"role": "user",
                                                                                        "content": "y"}]})
    assert once.status_code == 200 and once.json()["status"] == "completed"
    conversation = request(emulator, "POST", "/v1/conversations", {}).json()
    joined = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x",
                                                         "conversation": conversation["id"]}).json()
    again = request(emulator, "POST", "/v1/responses", {"model": "m", "input": [joined["output"][0]],
                                                        "conversation": conversation["id"], "stream": True})
    assert error_conforms(again, 400) == duplicate(joined["output"][0]["id"])


def test_conversations_objects_conform_to_the_openai_sdk_types(emulator):
    created = request(emulator, "POST", "/v1/conversations", {"metadata": {"k": "v"},
                                                              "items": [{"role": "user", "content": "hello"}]})
    sdk_conforms(sdk_conversations.Conversation, created.text)
    path = f"/v1/conversations/{created.json()['id']}"
    request(emulator, "POST", "/v1/responses", {"model": "m", "input": 'call:get_weather({"city": "Oslo"})',
                                                "tools": TOOLS, "reasoning": {"effort": "low", "summary": "auto"},
                                                "conversation": created.json()["id"]})
    call = request(emulator, "GET", f"{path}/items").json()["data"][0]
    added = request(emulator, "POST", f"{path}/items", {"items": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
        {"type": "message", "role": "assistant", "content": "It is sunny."}]})
    sdk_conforms(sdk_conversations.ConversationItemList, added.text)
    listed = request(emulator, "GET", f"{path}/items?order=asc&include[]=reasoning.encrypted_content")
    sdk_conforms(sdk_conversations.ConversationItemList, listed.text)
    assert [item["type"] for item in listed.json()["data"]] == [
        "message", "message", "reasoning", "function_call", "function_call_output", "message"]
    for item in listed.json()["data"]:
        CONVERSATION_ITEM.validate_json(request(emulator, "GET", f"{path}/items/{item['id']}").text, strict=True)
    for answer in (request(emulator, "GET", path), request(emulator, "POST", path, {"metadata": {"k": "w"}}),
                   request(emulator, "DELETE", f"{path}/items/{call['id']}")):
        sdk_conforms(sdk_conversations.Conversation, answer.text)
    sdk_conforms(sdk_conversations.ConversationDeletedResource, request(emulator, "DELETE", path).text)


# -- where the emulator follows OpenAI's API rather than the spec ---------------


def test_streams_end_without_done_as_the_api_does(emulator):
    assert "stream_ends_without_done" in REAL_API_DIFFERENCES
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "stream": True})
    assert "[DONE]" not in answer.text
    assert json.loads(answer.text.strip().split("\n")[-1][len("data: "):])["type"] == "response.completed"


def test_errors_use_the_apis_type_names(emulator):
    assert "error_type_names" in REAL_API_DIFFERENCES
    for case in ("no API key", "missing model", "unknown response"):
        method, path, body, key, status = ERROR_CASES[case]
        assert error_conforms(request(emulator, method, path, body, key), status)["type"] == "invalid_request_error"


def test_reasoning_effort_minimal_is_echoed_as_the_api_does(emulator):
    assert "reasoning_effort_minimal" in REAL_API_DIFFERENCES
    answer = request(emulator, "POST", "/v1/responses",
                     {"model": "m", "input": "x", "reasoning": {"effort": "minimal"}})
    assert answer.json()["reasoning"]["effort"] == "minimal"
    with pytest.raises(ValidationError) as refused:
        conforms(spec.ResponseResource, answer.text)
    assert {error["loc"][:2] for error in refused.value.errors()} == {("reasoning", "effort")}


def test_the_spec_defines_none_of_the_other_endpoints():
    assert "endpoints_beyond_the_spec" in REAL_API_DIFFERENCES
    assert not [name for name in dir(spec) if "Deleted" in name or "ItemList" in name]


def test_the_spec_defines_no_conversations():
    assert "conversations_beyond_the_spec" in REAL_API_DIFFERENCES
    assert not [name for name in dir(spec) if "onversation" in name]
    assert "conversation" not in spec.ResponseResource.model_fields


def test_an_empty_item_list_has_null_ids_as_the_api_answers(emulator):
    assert "empty_item_list_ids" in REAL_API_DIFFERENCES
    conversation = request(emulator, "POST", "/v1/conversations", {}).json()
    answer = request(emulator, "GET", f"/v1/conversations/{conversation['id']}/items")
    assert (answer.json()["first_id"], answer.json()["last_id"]) == (None, None)
    with pytest.raises(ValidationError) as refused:
        sdk_conforms(sdk_conversations.ConversationItemList, answer.text)
    assert {error["loc"] for error in refused.value.errors()} == {("first_id",), ("last_id",)}
