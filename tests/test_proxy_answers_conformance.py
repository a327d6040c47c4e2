"""What the proxy answers by itself (store emulation's errors, retrieve,
input_items and delete) validates against the Open Responses specification,
and the Conversations API it keeps (which the specification does not define)
against the openai SDK's own types, strictly, checked as the emulator's answers
are, through a real mitmdump."""

from __future__ import annotations

import json

import openresponses_types as spec
import pytest
from driver import TOOLS, httpx
from openai.types import conversations as sdk_conversations
from openai.types.responses import response as sdk_response
from test_emulator_conformance import CONVERSATION_ITEM, ITEM_MODELS, conforms, error_conforms, sdk_conforms, \
    stream_conforms

HEADERS = {"authorization": "Bearer sk-spec"}


def test_every_answer_the_proxy_makes_itself_conforms(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_max_depth=2")
    with httpx.Client(trust_env=False, timeout=30, headers=HEADERS) as c:
        def create(body: dict) -> httpx.Response:
            return c.post(proxy.url + "/v1/responses", json={"model": "m", **body})

        first = create({"input": [
            {"role": "user", "content": "look it up"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_client", "summary": [], "encrypted_content": "enc"},
            {"role": "assistant", "content": "it is sunny"}]}).json()
        second = create({"input": "and tomorrow?", "previous_response_id": first["id"]}).json()
        before = len(emulator.model.snapshot_log())

        conforms(spec.ResponseResource, c.get(f"{proxy.url}/v1/responses/{second['id']}").text)
        listed = c.get(f"{proxy.url}/v1/responses/{second['id']}/input_items?limit=100").json()
        assert listed.keys() == {"object", "data", "first_id", "last_id", "has_more"} and listed["object"] == "list"
        assert {item["type"] for item in listed["data"]} == set(ITEM_MODELS)
        for item in listed["data"]:
            conforms(ITEM_MODELS[item["type"]], json.dumps(item))
        error_conforms(c.get(f"{proxy.url}/v1/responses/{second['id']}/input_items?limit=101"), 400)
        error_conforms(c.get(f"{proxy.url}/v1/responses/{second['id']}/input_items?after=nope"), 404)
        error_conforms(c.get(f"{proxy.url}/v1/responses/resp_nowhere"), 404)
        third = create({"input": "more", "previous_response_id": second["id"]}).json()
        error_conforms(create({"input": "x", "previous_response_id": third["id"]}), 400)  # deeper than 2
        error_conforms(create({"input": "x", "previous_response_id": "resp_nowhere"}), 400)
        assert c.delete(f"{proxy.url}/v1/responses/{second['id']}").json() == {
            "id": second["id"], "object": "response", "deleted": True}
        error_conforms(c.get(f"{proxy.url}/v1/responses/{second['id']}"), 404)
    answered_here = len(emulator.model.snapshot_log()) - before
    assert answered_here == 1  # only the third turn went upstream


@pytest.mark.parametrize("upstream", ["absent", "ignore"])
def test_the_conversations_the_proxy_keeps_conform_to_the_openai_sdk_types(emulator, start_proxy, upstream):
    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    with httpx.Client(trust_env=False, timeout=30, headers=HEADERS) as c:
        created = c.post(f"{proxy.url}/v1/conversations", json={"metadata": {"k": "v"},
                                                                 "items": [{"role": "user", "content": "hello"}]})
        sdk_conforms(sdk_conversations.Conversation, created.text)
        path = f"{proxy.url}/v1/conversations/{created.json()['id']}"
        empty = c.post(f"{proxy.url}/v1/conversations", json={}).json()
        assert c.get(f"{proxy.url}/v1/conversations/{empty['id']}/items").json() == {
            "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}  # as the API answers
        for stream in (False, True):
            answer = c.post(f"{proxy.url}/v1/responses", json={
                "model": "m", "input": 'call:get_weather({"city": "Oslo"})', "tools": TOOLS, "stream": stream,
                "reasoning": {"effort": "low", "summary": "auto"}, "conversation": created.json()["id"]})
            if stream:
                responses = [event["response"] for event in stream_conforms(answer.text) if "response" in event]
            else:
                conforms(spec.ResponseResource, answer.text)
                responses = [answer.json()]
            for response in responses:
                sdk_conforms(sdk_response.Conversation, json.dumps(response["conversation"]))
                assert response["conversation"] == {"id": created.json()["id"]}
        call = [item for item in c.get(f"{path}/items").json()["data"] if item["type"] == "function_call"][0]
        added = c.post(f"{path}/items", json={"items": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
            {"type": "message", "role": "assistant", "content": "It is sunny."}]})
        sdk_conforms(sdk_conversations.ConversationItemList, added.text)
        listed = c.get(f"{path}/items?order=asc&include[]=reasoning.encrypted_content")
        sdk_conforms(sdk_conversations.ConversationItemList, listed.text)
        assert {item["type"] for item in listed.json()["data"]} == {
            "message", "reasoning", "function_call", "function_call_output"}
        for item in listed.json()["data"]:
            CONVERSATION_ITEM.validate_json(c.get(f"{path}/items/{item['id']}").text, strict=True)
        for answer in (c.get(path), c.post(path, json={"metadata": {"k": "w"}}),
                       c.delete(f"{path}/items/{call['id']}")):
            sdk_conforms(sdk_conversations.Conversation, answer.text)
        for answer, status in ((c.get(f"{proxy.url}/v1/conversations/conv_nope"), 404),
                               (c.get(f"{path}/items?limit=0"), 400), (c.get(f"{path}/items/msg_nope"), 404),
                               (c.post(f"{proxy.url}/v1/conversations", json={"items": [{"role": "user"}] * 21}), 400),
                               (c.post(f"{proxy.url}/v1/responses", json={"model": "m", "input": "x",
                                                                          "conversation": "conv_nope"}), 404),
                               (c.post(f"{proxy.url}/v1/responses", json={
                                   "model": "m", "input": "x", "conversation": created.json()["id"],
                                   "previous_response_id": "resp_nope"}), 400)):
            error_conforms(answer, status)
        sdk_conforms(sdk_conversations.ConversationDeletedResource, c.delete(path).text)
