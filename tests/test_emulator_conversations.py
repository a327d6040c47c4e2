"""OpenAI's Conversations API as the emulator serves it, driven by the real
openai SDK and openai-agents: conversations and their items, ``conversation``
on ``POST /responses`` (the exact context the model saw, what joins the
conversation), per-credential ownership, the API's refusals, and the faults that
play upstreams without the API."""

from __future__ import annotations

import itertools
import threading
import time

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.memory import OpenAIConversationsSession
from driver import httpx
from openai.types.shared import Reasoning

set_tracing_disabled(True)


def sdk(emu, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=emu.url + "/v1", api_key=key, max_retries=0)


def request(emu, method: str, path: str, body=None, key: str = "sk-a") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.request(method, emu.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def records(emu) -> list[dict]:
    return emu.model.snapshot_log()


def listed(client: openai.OpenAI, conversation_id: str) -> list[dict]:
    """Every item of the conversation, oldest first, as the API lists them."""
    return [item.model_dump(exclude_unset=True)
            for item in client.conversations.items.list(conversation_id, order="asc", limit=100)]


def api_error(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    return answer.json()["error"]


def not_found(conversation_id: str) -> dict:
    return {"message": f"Conversation with id '{conversation_id}' not found.", "type": "invalid_request_error",
            "param": None, "code": None}


# -- conversations --------------------------------------------------------------------


def test_create_retrieve_update_and_delete(emulator):
    client = sdk(emulator)
    created = client.conversations.create(metadata={"topic": "demo"})
    assert created.id.startswith("conv_") and created.object == "conversation" and created.metadata == {"topic": "demo"}
    assert isinstance(created.created_at, int)
    assert client.conversations.retrieve(created.id) == created
    updated = client.conversations.update(created.id, metadata={"topic": "other", "k": "v"})
    assert (updated.id, updated.created_at, updated.metadata) == (created.id, created.created_at,
                                                                   {"topic": "other", "k": "v"})
    assert client.conversations.update(created.id, metadata=None).metadata == {}
    deleted = client.conversations.delete(created.id)
    assert deleted.model_dump() == {"id": created.id, "object": "conversation.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        assert api_error(request(emulator, method, f"/v1/conversations/{created.id}"), 404) == not_found(created.id)
    client.close()


def test_a_conversation_without_metadata_has_an_empty_object(emulator):
    answer = request(emulator, "POST", "/v1/conversations", {})
    assert answer.status_code == 200
    assert answer.json().keys() == {"id", "object", "created_at", "metadata"} and answer.json()["metadata"] == {}


def test_an_update_needs_metadata(emulator):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    assert api_error(request(emulator, "POST", f"/v1/conversations/{created['id']}", {}), 400) == {
        "message": "Missing required parameter: 'metadata'.", "type": "invalid_request_error", "param": "metadata",
        "code": "missing_required_parameter"}


@pytest.mark.parametrize("path", ["/v1/conversations", "/v1/conversations/{id}"])
def test_at_most_16_metadata_pairs(emulator, path):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    path = path.format(id=created["id"])
    assert request(emulator, "POST", path, {"metadata": {f"k{n}": "v" for n in range(16)}}).status_code == 200
    assert api_error(request(emulator, "POST", path, {"metadata": {f"k{n}": "v" for n in range(17)}}), 400) == {
        "message": "Invalid 'metadata': too many properties. Expected an object with at most 16 properties, but got"
                   " an object with 17 properties instead.",
        "type": "invalid_request_error", "param": "metadata", "code": "object_above_max_properties"}


@pytest.mark.parametrize("path", ["/v1/conversations", "/v1/conversations/{id}"])
def test_metadata_keys_are_at_most_64_characters_and_values_strings_of_at_most_512(emulator, path):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    path = path.format(id=created["id"])
    assert request(emulator, "POST", path, {"metadata": {"k" * 64: "v" * 512}}).json()["metadata"] == {
        "k" * 64: "v" * 512}
    assert api_error(request(emulator, "POST", path, {"metadata": {"k" * 65: "v"}}), 400) == {
        "message": "Invalid 'metadata': key too long. Expected a key with maximum length 64, but got a key with"
                   " length 65 instead.",
        "type": "invalid_request_error", "param": "metadata", "code": "key_above_max_length"}
    assert api_error(request(emulator, "POST", path, {"metadata": {"k": "v" * 513}}), 400) == {
        "message": "Invalid 'metadata.k': string too long. Expected a string with maximum length 512, but got a"
                   " string with length 513 instead.",
        "type": "invalid_request_error", "param": "metadata.k", "code": "string_above_max_length"}
    assert api_error(request(emulator, "POST", path, {"metadata": {"k": 1}}), 400) == {
        "message": "Invalid type for 'metadata.k': expected a string, but got an integer instead.",
        "type": "invalid_request_error", "param": "metadata.k", "code": "invalid_type"}
    assert request(emulator, "GET", f"/v1/conversations/{created['id']}").json()["metadata"] == (
        {"k" * 64: "v" * 512} if path.endswith(created["id"]) else {})  # a refused change changes nothing


@pytest.mark.parametrize("path", ["/v1/conversations", "/v1/conversations/{id}/items"])
def test_at_most_20_items_a_request(emulator, path):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    path = path.format(id=created["id"])
    assert request(emulator, "POST", path, {"items": [{"role": "user", "content": f"m{n}"} for n in range(20)]}
                   ).status_code == 200
    assert api_error(request(emulator, "POST", path, {"items": [{"role": "user", "content": "m"}] * 21}), 400) == {
        "message": "Invalid 'items': array too long. Expected an array with maximum length 20, but got an array"
                   " with length 21 instead.",
        "type": "invalid_request_error", "param": "items", "code": "array_above_max_length"}


# -- items ----------------------------------------------------------------------------


def test_items_get_ids_and_are_listed_newest_first(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "one"},
                                                      {"type": "message", "role": "assistant", "content": "two"}])
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    call, output = added.data
    assert (added.object, added.first_id, added.last_id, added.has_more) == ("list", call.id, output.id, False)
    assert call.id.startswith("fc_") and output.id.startswith("fco_") and call.status == "completed"
    newest_first = client.conversations.items.list(conversation.id)
    user, assistant = reversed(newest_first.data[2:])
    assert [item.id for item in newest_first.data] == [output.id, call.id, assistant.id, user.id]
    assert user.model_dump(exclude_unset=True) == {"id": user.id, "type": "message", "role": "user", "status":
                                                   "completed", "content": [{"type": "input_text", "text": "one"}]}
    assert assistant.content[0].type == "output_text" and assistant.content[0].text == "two"
    assert (newest_first.first_id, newest_first.last_id, newest_first.has_more) == (output.id, user.id, False)
    client.close()


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pagination_walks_every_item_once(emulator, order):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": f"m{n}"} for n in range(20)])
    client.conversations.items.create(conversation.id, items=[{"role": "user", "content": f"m{n}"}
                                                              for n in range(20, 25)])
    first = client.conversations.items.list(conversation.id, order=order)
    assert len(first.data) == 20 and first.has_more is True  # limit defaults to 20
    page = client.conversations.items.list(conversation.id, order=order, limit=7, after=first.data[6].id)
    assert [item.id for item in page.data] == [item.id for item in first.data[7:14]] and page.has_more is True
    walked = [item.content[0].text for item in client.conversations.items.list(conversation.id, order=order, limit=7)]
    expected = [f"m{n}" for n in range(25)]
    assert walked == (expected if order == "asc" else expected[::-1])  # the SDK follows `after` itself
    client.close()


def test_an_empty_conversation_lists_null_ids(emulator):
    created = request(emulator, "POST", "/v1/conversations", {"items": []}).json()
    assert request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json() == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    client = sdk(emulator)
    assert list(client.conversations.items.list(created["id"])) == []  # the SDK's pager takes the nulls
    client.close()


def test_list_parameters_are_checked_as_the_api_does(emulator):
    created = request(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}]}).json()
    path = f"/v1/conversations/{created['id']}/items"
    for query, param, code in (("limit=0", "limit", "integer_below_min_value"),
                               ("limit=101", "limit", "integer_above_max_value"),
                               ("order=newest", "order", "invalid_value")):
        error = api_error(request(emulator, "GET", f"{path}?{query}"), 400)
        assert (error["param"], error["code"]) == (param, code)
    assert api_error(request(emulator, "GET", f"{path}?after=msg_unknown"), 404) == {
        "message": "No item found with id 'msg_unknown'", "type": "invalid_request_error", "param": "after",
        "code": None}


def test_an_item_is_retrieved_and_deleted_by_id(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "keep"},
                                                      {"role": "user", "content": "drop"}])
    keep, drop = client.conversations.items.list(conversation.id, order="asc").data
    assert client.conversations.items.retrieve(drop.id, conversation_id=conversation.id) == drop
    after_delete = client.conversations.items.delete(drop.id, conversation_id=conversation.id)
    assert after_delete == client.conversations.retrieve(conversation.id)  # the API answers with the conversation
    assert [item.id for item in client.conversations.items.list(conversation.id).data] == [keep.id]
    for method in ("GET", "DELETE"):
        error = api_error(request(emulator, method, f"/v1/conversations/{conversation.id}/items/{drop.id}"), 404)
        assert error["message"] == f"No item found with id '{drop.id}'"
    client.close()


def test_an_item_given_by_a_stored_id_is_the_stored_item_and_cannot_be_added_twice(emulator):
    client = sdk(emulator)
    source = client.conversations.create(items=[{"role": "user", "content": "original"}])
    original = client.conversations.items.list(source.id).data[0]
    target = client.conversations.create()
    added = client.conversations.items.create(target.id, items=[
        {"type": "message", "role": "user", "id": original.id, "content": "other text"}])
    assert added.data == [original]  # the stored content, whatever was sent with the id
    response = client.responses.create(model="m", input="hi")
    by_reference = client.conversations.items.create(target.id, items=[
        {"type": "item_reference", "id": response.output[0].id}])
    assert by_reference.data[0].model_dump(exclude_unset=True) == response.output[0].model_dump(exclude_unset=True)
    again = request(emulator, "POST", f"/v1/conversations/{target.id}/items", {"items": [{"id": original.id}]})
    assert api_error(again, 400) == {"message": "Item already in conversation", "type": "invalid_request_error",
                                     "param": "items", "code": "item_already_in_conversation"}
    unknown = request(emulator, "POST", f"/v1/conversations/{target.id}/items",
                      {"items": [{"type": "item_reference", "id": "msg_never_stored"}]})
    assert api_error(unknown, 404)["message"] == "Item with id 'msg_never_stored' not found."
    client.close()


def duplicate(item_id: str) -> dict:
    return {"message": f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try"
                       " again.", "type": "invalid_request_error", "param": "input", "code": None}


def walked(client: openai.OpenAI, conversation_id: str, limit: int) -> list[str]:
    """The ids the SDK's auto-paging lists, oldest first, ``limit`` a page; cut
    at 50, so that a pager that never ends fails the test instead of hanging it."""
    pager = client.conversations.items.list(conversation_id, order="asc", limit=limit)
    return [item.id for item in itertools.islice(pager, 50)]


def test_an_item_given_twice_in_one_request_is_kept_twice_and_paging_over_it_ends(emulator):
    """The API takes a stored id twice in one request and lists both copies;
    paging by ``after`` over them still advances and ends, listing each copy
    it can tell apart from the next page's cursor."""
    client = sdk(emulator)
    source = client.conversations.create(items=[{"role": "user", "content": "original"}])
    twice = client.conversations.items.list(source.id).data[0]
    target = client.conversations.create(items=[{"role": "user", "content": "first"}])
    copy = {"type": "message", "role": "user", "id": twice.id, "content": "other text"}
    added = client.conversations.items.create(target.id, items=[copy, {"role": "user", "content": "between"},
                                                                 copy])
    assert [item.id for item in added.data] == [twice.id, added.data[1].id, twice.id]
    assert added.data[0] == added.data[2] == twice
    first, between = client.conversations.items.list(target.id, order="asc").data[0].id, added.data[1].id
    assert walked(client, target.id, 100) == [first, twice.id, between, twice.id]
    assert walked(client, target.id, 2) == [first, twice.id, between, twice.id]
    assert walked(client, target.id, 1) == [first, between, twice.id]  # a page of one never ends on the first copy
    page = client.conversations.items.list(target.id, order="asc", limit=1, after=twice.id)
    assert (page.data, page.has_more) == ([], False)  # past the last copy: the end, never the start again
    client.close()


def test_an_item_already_in_the_conversation_or_twice_in_the_input_is_refused_as_the_api_refuses(emulator):
    """What an SDK that sends back the output it got does: the API's 400,
    and the conversation is unchanged."""
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    answered = client.responses.create(model="m", input="hi", conversation=conversation.id)
    before = listed(client, conversation.id)
    sent_back = answered.output[0].model_dump(exclude_unset=True)
    for item_input, named in (([{"role": "user", "content": "more"}, sent_back], sent_back["id"]),
                              ([{"type": "item_reference", "id": before[0]["id"]}], before[0]["id"]),
                              ([{"type": "message", "role": "user", "id": "msg_own", "content": "a"},
                                {"type": "message", "role": "user", "id": "msg_own", "content": "b"}], "msg_own")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model="m", input=item_input, conversation=conversation.id, stream=stream)
            assert refused.value.body == duplicate(named)
    assert listed(client, conversation.id) == before
    again = client.responses.create(model="m", input=[{"role": "user", "content": "more"}],
                                    conversation=conversation.id)
    assert [item["id"] for item in listed(client, conversation.id)][:len(before)] == [i["id"] for i in before]
    assert again.status == "completed" and records(emulator)[-1]["context"][:len(before)] == before
    client.close()


def test_a_reasoning_item_with_neither_id_nor_encrypted_content_is_invalid(emulator):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    answer = request(emulator, "POST", f"/v1/conversations/{created['id']}/items",
                     {"items": [{"type": "reasoning", "summary": []}]})
    assert api_error(answer, 400) == {"message": "Invalid item", "type": "invalid_request_error", "param": "item",
                                      "code": "invalid_item"}
    kept = request(emulator, "POST", f"/v1/conversations/{created['id']}/items",
                   {"items": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA-opaque"}]}).json()
    assert kept["data"][0]["id"].startswith("rs_")


def test_encrypted_reasoning_is_listed_only_when_included(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create()
    client.responses.create(model="m", input="think", conversation=conversation.id, reasoning={"effort": "low"},
                            include=["reasoning.encrypted_content"])
    plain = client.conversations.items.list(conversation.id, order="asc").data[1]
    assert plain.type == "reasoning" and plain.encrypted_content is None
    included = client.conversations.items.list(conversation.id, order="asc",
                                               include=["reasoning.encrypted_content"]).data[1]
    assert included.encrypted_content.startswith("enc_")
    assert client.conversations.items.retrieve(plain.id, conversation_id=conversation.id,
                                               include=["reasoning.encrypted_content"]) == included
    client.close()


# -- ownership and unknown ids ----------------------------------------------------------


# Every endpoint that names a conversation: (method, path).
ENDPOINTS = [("GET", "/v1/conversations/{conversation}"), ("POST", "/v1/conversations/{conversation}"),
             ("DELETE", "/v1/conversations/{conversation}"), ("POST", "/v1/conversations/{conversation}/items"),
             ("GET", "/v1/conversations/{conversation}/items"),
             ("GET", "/v1/conversations/{conversation}/items/{item}"),
             ("DELETE", "/v1/conversations/{conversation}/items/{item}")]
BODY = {"metadata": {}, "items": [{"role": "user", "content": "y"}]}  # what the POST endpoints need


@pytest.mark.parametrize("method,path", ENDPOINTS)
@pytest.mark.parametrize("how", ["another credential", "unknown"])
def test_a_conversation_belongs_to_the_credential_that_created_it(emulator, method, path, how):
    created = request(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}]}).json()
    item = request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json()["data"][0]["id"]
    conversation_id = created["id"] if how == "another credential" else "conv_never_made"
    answer = request(emulator, method, path.format(conversation=conversation_id, item=item), BODY,
                     key="sk-b" if how == "another credential" else "sk-a")
    assert api_error(answer, 404) == not_found(conversation_id)
    assert request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json()["data"][0]["id"] == item


@pytest.mark.parametrize("how", ["another credential", "unknown"])
def test_a_response_cannot_use_a_conversation_it_does_not_own(emulator, how):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    conversation_id = created["id"] if how == "another credential" else "conv_never_made"
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": conversation_id},
                     key="sk-b" if how == "another credential" else "sk-a")
    assert api_error(answer, 404) == not_found(conversation_id)
    assert records(emulator)[-1]["conversation"] == conversation_id


def test_without_a_credential_the_api_answers_401(emulator):
    with httpx.Client(trust_env=False) as client:
        answer = client.post(emulator.url + "/v1/conversations", json={})
    assert answer.status_code == 401 and answer.json()["error"]["message"].startswith("You didn't provide an API key.")


def test_a_deleted_conversation_is_gone_but_its_items_stay_stored(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "remember me"}])
    item = client.conversations.items.list(conversation.id).data[0]
    client.conversations.delete(conversation.id)
    assert api_error(request(emulator, "GET", f"/v1/conversations/{conversation.id}/items"), 404) == \
        not_found(conversation.id)
    client.responses.create(model="m", input=[{"type": "item_reference", "id": item.id}])
    assert records(emulator)[-1]["context"] == [item.model_dump(exclude_unset=True)]
    other = client.conversations.create(items=[{"id": item.id}])
    assert client.conversations.items.list(other.id).data == [item]
    client.close()


# -- responses in a conversation ----------------------------------------------------------


def test_a_response_sees_the_conversations_items_then_its_input_and_both_join_it(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"},
                                                      {"role": "user", "content": "hello"}])
    before = listed(client, conversation.id)
    response = client.responses.create(model="m", conversation=conversation.id,
                                       input=[{"role": "user", "content": "and now?"}])
    record = records(emulator)[-1]
    assert record["conversation"] == conversation.id and record["continued"] is False
    assert record["context"] == before + [{"role": "user", "content": "and now?"}]
    assert response.output_text.startswith("I saw 3 items")
    assert response.conversation.model_dump() == {"id": conversation.id}
    after = listed(client, conversation.id)
    assert after[:2] == before and len(after) == 4
    assert after[2]["content"] == [{"type": "input_text", "text": "and now?"}] and after[2]["id"].startswith("msg_")
    assert after[3] == response.output[0].model_dump(exclude_unset=True)
    input_items = client.responses.input_items.list(response.id, order="asc").data
    assert [item.id for item in input_items] == [item["id"] for item in after[:3]]  # its context, same ids
    client.close()


def test_a_streamed_response_joins_the_conversation_too(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    before = listed(client, conversation.id)
    with client.responses.stream(model="m", input="streamed", conversation={"id": conversation.id}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[0].type == "response.created" and events[0].response.conversation.id == conversation.id
    assert final.conversation.id == conversation.id
    record = records(emulator)[-1]
    assert record["context"] == before + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "streamed"}]}]
    after = listed(client, conversation.id)
    assert after[:1] == before and after[2:] == record["output"] and after[2]["id"] == final.output[0].id
    client.close()


def test_a_response_without_a_conversation_has_no_conversation_field(emulator):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    assert "conversation" not in answer and records(emulator)[-1]["conversation"] is None


def test_conversation_with_previous_response_id_is_refused_before_any_lookup(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create()
    first = client.responses.create(model="m", input="x")
    for conversation_id in (conversation.id, "conv_never_made"):
        answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "y",
                                                             "conversation": conversation_id,
                                                             "previous_response_id": first.id})
        assert api_error(answer, 400) == {
            "message": "Mutually exclusive parameters: ''. Ensure you are only providing one of: 'pre..._id' or"
                       " 'conversation'.",
            "type": "invalid_request_error", "param": None, "code": "mutually_exclusive_parameters"}
    assert listed(client, conversation.id) == []
    client.close()


def test_a_failed_response_adds_nothing(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    before = listed(client, conversation.id)
    emulator.model.control({"fail_next": [{"kind": "failed"}]})
    assert client.responses.create(model="m", input="x", conversation=conversation.id).status == "failed"
    assert listed(client, conversation.id) == before
    client.close()


def test_store_false_keeps_no_response_but_the_conversation_still_grows(emulator):
    client = sdk(emulator)
    conversation = client.conversations.create()
    response = client.responses.create(model="m", input="x", conversation=conversation.id, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    assert [item["id"] for item in listed(client, conversation.id)][1:] == [response.output[0].id]
    client.close()


def test_a_conversations_reasoning_items_can_be_sent_back_by_id(emulator):
    """Only the conversation keeps them here (the response had ``store: false``),
    and that is enough for the API to read the reasoning from storage."""
    client = sdk(emulator)
    conversation = client.conversations.create()
    response = client.responses.create(model="m", input="think", conversation=conversation.id, store=False,
                                       reasoning={"effort": "low"})
    reasoning = response.output[0].model_dump(exclude_unset=True)
    assert reasoning["type"] == "reasoning" and "encrypted_content" not in reasoning
    sent = [{"role": "user", "content": "think"}, reasoning, {"role": "user", "content": "more"}]
    assert client.responses.create(model="m", input=sent, store=False).status == "completed"
    assert records(emulator)[-1]["context"] == sent
    client.close()


def test_a_background_response_joins_when_it_completes(emulator):
    emulator.model.control({"background_delay_ms": 300})
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    queued = client.responses.create(model="m", input="later", conversation=conversation.id, background=True)
    assert queued.status == "queued" and queued.conversation.id == conversation.id
    assert len(listed(client, conversation.id)) == 1
    deadline = time.monotonic() + 10
    while (done := client.responses.retrieve(queued.id)).status != "completed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done.conversation.id == conversation.id
    after = listed(client, conversation.id)
    assert len(after) == 3 and after[2] == done.output[0].model_dump(exclude_unset=True)
    client.close()


def test_concurrent_responses_on_one_conversation_both_join_in_completion_order(emulator):
    emulator.model.control({"think_ms": 300})  # both requests are in flight at once
    client = sdk(emulator)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    start = listed(client, conversation.id)
    answers: dict[str, object] = {}

    def ask(text: str) -> None:
        answers[text] = client.responses.create(model="m", input=text, conversation=conversation.id)

    threads = [threading.Thread(target=ask, args=(text,)) for text in ("left", "right")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    first, second = [record for record in records(emulator) if record["conversation"] == conversation.id]
    first_text, second_text = (record["context"][-1]["content"][0]["text"] for record in (first, second))
    assert {first_text, second_text} == {"left", "right"}
    items = listed(client, conversation.id)
    assert len(items) == 5 and len({item["id"] for item in items}) == 5  # nothing lost, nothing twice
    assert [item["content"][0]["text"] for item in items[1::2]] == [first_text, second_text]
    assert [items[2], items[4]] == [answers[first_text].output[0].model_dump(exclude_unset=True),
                                    answers[second_text].output[0].model_dump(exclude_unset=True)]
    assert first["context"] == start + [first["context"][-1]]
    assert second["context"] == items[:3] + [second["context"][-1]]  # answered second, it saw the first's turn
    client.close()


# -- upstreams without the Conversations API ---------------------------------------------------


@pytest.mark.parametrize("mode", ["absent", "ignore"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/conversations"), *ENDPOINTS])
def test_without_the_api_every_conversations_path_is_unknown(emulator, mode, method, path):
    created = request(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}]}).json()
    item = request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json()["data"][0]["id"]
    emulator.model.control({"conversations": mode})
    path = path.format(conversation=created["id"], item=item)
    assert api_error(request(emulator, method, path, BODY), 404) == {
        "message": f"Invalid URL ({method} {path})", "type": "invalid_request_error", "param": None, "code": None}


@pytest.mark.parametrize("method,path", [("POST", "/v1/conversations"), *ENDPOINTS])
def test_not_allowed_answers_every_conversations_path_405_as_a_router_without_it(emulator, method, path):
    created = request(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}]}).json()
    item = request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json()["data"][0]["id"]
    emulator.model.control({"conversations": "not_allowed"})
    answer = request(emulator, method, path.format(conversation=created["id"], item=item), BODY)
    assert (answer.status_code, answer.json()) == (405, {"detail": "Method Not Allowed"})
    dropped = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": created["id"]})
    assert dropped.status_code == 200 and "conversation" not in dropped.json()  # the field is dropped


def test_absent_refuses_the_conversation_field_as_unknown(emulator):
    created = request(emulator, "POST", "/v1/conversations", {}).json()
    emulator.model.control({"conversations": "absent"})
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": created["id"]})
    assert api_error(answer, 400) == {"message": "Unknown parameter: 'conversation'.", "type": "invalid_request_error",
                                      "param": "conversation", "code": "unknown_parameter"}
    assert request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x"}).status_code == 200


def test_ignore_answers_without_the_conversation_and_does_not_echo_it(emulator):
    created = request(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]}).json()
    emulator.model.control({"conversations": "ignore"})
    first = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": created["id"]})
    assert first.status_code == 200 and "conversation" not in first.json()
    assert records(emulator)[-1]["context"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    second = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": created["id"],
                                                         "previous_response_id": first.json()["id"]})
    assert second.status_code == 200 and records(emulator)[-1]["continued"] is True
    emulator.model.control({"conversations": None})
    assert len(request(emulator, "GET", f"/v1/conversations/{created['id']}/items").json()["data"]) == 1


# -- openai-agents ----------------------------------------------------------------------------


@function_tool
def get_weather(city: str) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


TURNS = ["hello", 'call:get_weather({"city": "Oslo"})', "thanks"]


def gist(item: dict) -> tuple:
    """What an item says, whatever ids and shape the client gave it."""
    content = item.get("content")
    text = content if isinstance(content, str) else " ".join(part.get("text", "") for part in content or [])
    return (item.get("type") or "message", item.get("role"), text, item.get("call_id"), item.get("name"),
            item.get("arguments"), item.get("output"))


def agent_over(client: openai.AsyncOpenAI, **settings) -> Agent:
    return Agent(name="assistant", instructions="terse", tools=[get_weather],
                 model=OpenAIResponsesModel(model="gpt-test", openai_client=client),
                 model_settings=ModelSettings(**settings))


async def test_openai_agents_conversations_session_over_three_turns_with_a_tool(emulator):
    """The session keeps history in a conversation and sends it whole: every
    model call sees exactly the conversation's items, then what this turn added
    (item for item; the SDK drops some ids it replays, and keeps the others)."""
    client = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    agent = agent_over(client, reasoning=Reasoning(effort="low"))
    session = OpenAIConversationsSession(openai_client=client)
    for number, turn in enumerate(TURNS):
        seen = len(records(emulator))
        stored_before = [item.model_dump(exclude_unset=True)
                         async for item in client.conversations.items.list(session.session_id, order="asc")] \
            if number else []
        result = await Runner.run(agent, turn, session=session)
        calls = records(emulator)[seen:]
        assert all(call["status_code"] == 200 and call["conversation"] is None for call in calls)
        assert [gist(item) for item in calls[0]["context"]] == [gist(item) for item in stored_before] + [
            ("message", "user", turn, None, None, None, None)]
        assert all(sent.get("id") in (None, kept["id"]) for sent, kept in zip(calls[0]["context"], stored_before))
        for earlier, later in itertools.pairwise(calls):  # a tool loop resends what came before, and its results
            assert later["context"][:len(earlier["context"])] == earlier["context"]
            added = later["context"][len(earlier["context"]):]
            assert [gist(item) for item in added[:len(earlier["output"])]] == [gist(i) for i in earlier["output"]]
            assert [item["type"] for item in added[len(earlier["output"]):]] == ["function_call_output"]
        assert result.final_output == calls[-1]["output"][-1]["content"][0]["text"]
        stored_after = [item.model_dump(exclude_unset=True)
                        async for item in client.conversations.items.list(session.session_id, order="asc")]
        assert [gist(item) for item in stored_after] == [gist(item) for item in calls[-1]["context"] +
                                                          calls[-1]["output"]]
    made = [item["id"] for record in records(emulator) for item in record["output"] if item["type"] == "reasoning"]
    kept = [item["id"] for item in stored_after if item["type"] == "reasoning"]
    assert kept == made  # sent back by id without encrypted content, each found where the API stored it
    assert [len(record["context"]) for record in records(emulator)] == [1, 4, 7, 10]
    await client.close()


async def test_openai_agents_with_a_conversation_id_sends_only_new_items(emulator):
    """``Runner.run(conversation_id=…)`` leaves the history to the API: each
    call sends what is new, and the model sees the conversation's items first."""
    client = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    agent = agent_over(client)
    conversation = await client.conversations.create()
    for turn in TURNS:
        seen = len(records(emulator))
        stored_before = [item.model_dump(exclude_unset=True)
                         async for item in client.conversations.items.list(conversation.id, order="asc")]
        result = await Runner.run(agent, turn, conversation_id=conversation.id)
        calls = records(emulator)[seen:]
        stored_after = [item.model_dump(exclude_unset=True)
                        async for item in client.conversations.items.list(conversation.id, order="asc")]
        assert calls[0]["context"][-1] == {"role": "user", "content": turn}
        joined = len(stored_before)
        for call in calls:  # each call: the conversation so far, then the one item it sent (a tool's output)
            assert call["conversation"] == conversation.id and call["input_items"] == 1
            assert call["context"][:-1] == stored_after[:joined]
            assert gist(stored_after[joined]) == gist(call["context"][-1])
            assert stored_after[joined + 1:joined + 1 + len(call["output"])] == call["output"]
            joined += 1 + len(call["output"])
        assert joined == len(stored_after)
        assert [call["context"][-1].get("type") for call in calls[1:]] == ["function_call_output"] * (len(calls) - 1)
        assert result.final_output == calls[-1]["output"][-1]["content"][0]["text"]
    assert [len(record["context"]) for record in records(emulator)] == [1, 3, 5, 7]
    await client.close()
