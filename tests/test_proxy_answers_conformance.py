"""Issue 15: what the proxy answers by itself (store emulation's errors,
retrieve, input_items and delete) validates against the Open Responses
specification, checked as the emulator's answers are, through a real mitmdump."""

from __future__ import annotations

import json

import openresponses_types as spec
from driver import httpx
from test_emulator_conformance import ITEM_MODELS, conforms, error_conforms

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
