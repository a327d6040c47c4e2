"""Stored responses as the real API serves them: retrieve, delete, list input
items (with the API's pagination), per credential, and item references
resolved from what is stored."""

from __future__ import annotations

import time

import openai
import pytest
from driver import TOOLS, httpx


def request(emu, method: str, path: str, body=None, key: str = "sk-a") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.request(method, emu.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def create(emu, key: str = "sk-a", **body) -> dict:
    answer = request(emu, "POST", "/v1/responses", {"model": "m", **body}, key)
    assert answer.status_code == 200, answer.text
    return answer.json()


def last_record(emu) -> dict:
    return emu.model.snapshot_log()[-1]


@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_retrieve_returns_what_create_answered(emulator, prefix):
    created = create(emulator, input="hello")
    assert request(emulator, "GET", f"{prefix}/responses/{created['id']}").json() == created


def test_a_streamed_response_is_retrieved_as_its_completed_event_carried(emulator):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    completed = [line for line in answer.text.splitlines() if line.startswith("data: ")][-1]
    response = httpx.Response(200, content=completed[len("data: "):]).json()["response"]
    assert request(emulator, "GET", f"/v1/responses/{response['id']}").json() == response


def test_an_unstored_response_is_not_found(emulator):
    unstored = create(emulator, input="x", store=False)
    answer = request(emulator, "GET", f"/v1/responses/{unstored['id']}")
    assert answer.status_code == 404
    assert answer.json() == {"error": {"message": f"Response with id '{unstored['id']}' not found.",
                                       "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize("how", ["unknown", "forgotten", "all forgotten"])
def test_an_unknown_or_forgotten_response_is_not_found(emulator, how):
    response_id = "resp_never_made" if how == "unknown" else create(emulator, input="x")["id"]
    emulator.model.control({"forget": [response_id]} if how == "forgotten" else {"forget_all": how == "all forgotten"})
    answer = request(emulator, "GET", f"/v1/responses/{response_id}")
    assert answer.status_code == 404
    assert answer.json() == {"error": {"message": f"Response with id '{response_id}' not found.",
                                       "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize("method,suffix", [("GET", ""), ("DELETE", ""), ("GET", "/input_items"),
                                           ("POST", "/cancel")])
def test_another_credentials_response_is_not_found(emulator, method, suffix):
    mine = create(emulator, input="x", background=True)
    answer = request(emulator, method, f"/v1/responses/{mine['id']}{suffix}", key="sk-b")
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == f"Response with id '{mine['id']}' not found."


def test_delete_forgets_the_response_but_not_what_continued_from_it(emulator):
    parent = create(emulator, input="one")
    child = create(emulator, input="two", previous_response_id=parent["id"])
    assert request(emulator, "DELETE", f"/responses/{parent['id']}").json() == {
        "id": parent["id"], "object": "response", "deleted": True}
    assert request(emulator, "GET", f"/v1/responses/{parent['id']}").status_code == 404
    assert request(emulator, "DELETE", f"/v1/responses/{parent['id']}").status_code == 404
    assert request(emulator, "POST", "/v1/responses", {"model": "m", "input": "x",
                                                       "previous_response_id": parent["id"]}).status_code == 400
    create(emulator, input="three", previous_response_id=child["id"])
    assert [item.get("role") for item in last_record(emulator)["context"]] == ["user", "assistant"] * 2 + ["user"]


def test_input_items_are_listed_typed_with_ids_newest_first(emulator):
    sent = [{"role": "user", "content": "look it up"},
            {"type": "function_call", "id": "fc_mine", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = create(emulator, input=sent, tools=TOOLS)
    listed = request(emulator, "GET", f"/v1/responses/{response['id']}/input_items").json()
    user, call, output = reversed(listed["data"])  # default order: desc
    assert user["id"].startswith("msg_") and user["type"] == "message" and user["status"] == "completed"
    assert user["content"] == [{"type": "input_text", "text": "look it up"}]
    assert call == {**sent[1], "status": "completed"}  # the client's own id is kept
    assert output["id"].startswith("fco_") and output["output"] == "sunny"
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (output["id"], user["id"], False)
    again = request(emulator, "GET", f"/v1/responses/{response['id']}/input_items").json()
    assert again == listed  # ids are assigned once, when stored


def test_a_continuations_input_items_are_its_whole_context(emulator):
    parent = create(emulator, input="one")
    child = create(emulator, input="two", previous_response_id=parent["id"])
    listed = request(emulator, "GET", f"/v1/responses/{child['id']}/input_items?order=asc").json()["data"]
    parent_input = request(emulator, "GET", f"/v1/responses/{parent['id']}/input_items").json()["data"]
    assert listed[:2] == parent_input + parent["output"]
    assert listed[2]["content"] == [{"type": "input_text", "text": "two"}]


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pagination_walks_every_item_once_in_both_directions(emulator, order):
    response = create(emulator, input=[{"role": "user", "content": f"m{n}"} for n in range(25)])
    path = f"/v1/responses/{response['id']}/input_items?order={order}"
    first = request(emulator, "GET", path).json()
    assert len(first["data"]) == 20 and first["has_more"] is True  # limit defaults to 20
    pages, after = [], None
    while True:
        page = request(emulator, "GET", path + "&limit=7" + (f"&after={after}" if after else "")).json()
        pages.append(page)
        after = page["last_id"]
        if not page["has_more"]:
            break
    walked = [item["content"][0]["text"] for page in pages for item in page["data"]]
    expected = [f"m{n}" for n in range(25)]
    assert walked == (expected if order == "asc" else expected[::-1])
    assert [len(page["data"]) for page in pages] == [7, 7, 7, 4]
    before = request(emulator, "GET", path + f"&limit=5&before={pages[1]['data'][0]['id']}").json()
    assert before["data"] == pages[0]["data"][2:] and before["has_more"] is True


def test_list_parameters_are_checked_as_the_api_does(emulator):
    response = create(emulator, input="x")
    path = f"/v1/responses/{response['id']}/input_items"
    for query, param, code in (("limit=0", "limit", "integer_below_min_value"),
                               ("limit=101", "limit", "integer_above_max_value"),
                               ("order=newest", "order", "invalid_value")):
        error = request(emulator, "GET", f"{path}?{query}").json()["error"]
        assert (error["param"], error["code"]) == (param, code)
    assert request(emulator, "GET", f"{path}?after=msg_unknown").status_code == 404


def test_the_openai_sdk_reads_every_endpoint(emulator):
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    created = client.responses.create(model="m", input="hello")
    assert client.responses.retrieve(created.id).output_text == created.output_text
    items = list(client.responses.input_items.list(created.id, limit=1))  # the SDK follows `after` itself
    assert [item.type for item in items] == ["message"]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    client.close()


# -- item references -------------------------------------------------------------


def test_an_item_reference_is_replaced_by_the_stored_item(emulator):
    first = create(emulator, input="one")
    create(emulator, input=[{"type": "item_reference", "id": first["output"][0]["id"]},
                            {"role": "user", "content": "two"}])
    record = last_record(emulator)
    assert record["context"][0] == first["output"][0] and record["references"] == 1
    assert record["output"][0]["content"][0]["text"].startswith("I saw 2 items")


def test_an_item_with_an_id_and_no_type_is_a_reference_too(emulator):
    first = create(emulator, input="one")
    create(emulator, input=[{"id": first["output"][0]["id"]}])
    assert last_record(emulator)["context"] == first["output"] and last_record(emulator)["references"] == 1


def test_input_items_can_be_referenced_by_the_ids_the_api_gave_them(emulator):
    first = create(emulator, input="remember me")
    listed = request(emulator, "GET", f"/v1/responses/{first['id']}/input_items").json()["data"]
    create(emulator, input=[{"type": "item_reference", "id": listed[0]["id"]}])
    assert last_record(emulator)["context"] == listed


@pytest.mark.parametrize("store,hint", [(True, ""), (False, " Items are not persisted when `store` is set to false.")])
def test_an_unknown_reference_gets_the_apis_not_found(emulator, store, hint):
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "store": store,
                                                         "input": [{"type": "item_reference", "id": "rs_gone"}]})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["message"].startswith(f"Item with id 'rs_gone' not found.{hint}")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "input", None)


@pytest.mark.parametrize("how", ["another credential", "unstored", "deleted"])
def test_only_this_credentials_stored_items_resolve(emulator, how):
    first = create(emulator, input="one", store=how != "unstored")
    if how == "deleted":
        request(emulator, "DELETE", f"/v1/responses/{first['id']}")
    answer = request(emulator, "POST", "/v1/responses", {"model": "m", "input": [{"id": first["output"][0]["id"]}]},
                     key="sk-b" if how == "another credential" else "sk-a")
    assert answer.status_code == 404


# -- reasoning items read from storage ---------------------------------------------


def reasoning_turn(emu, store: bool = True, encrypted: bool = False) -> dict:
    """A first turn whose output starts with a reasoning item."""
    return create(emu, input="think", store=store, reasoning={"effort": "low"},
                  include=["reasoning.encrypted_content"] if encrypted else [])


def test_a_stored_reasoning_item_sent_back_by_id_is_accepted_as_sent(emulator):
    first = reasoning_turn(emulator)
    reasoning = first["output"][0]
    assert reasoning["type"] == "reasoning" and "encrypted_content" not in reasoning
    sent = [{"role": "user", "content": "think"}, reasoning, first["output"][1], {"role": "user", "content": "more"}]
    create(emulator, input=sent, reasoning={"effort": "low"})
    assert last_record(emulator)["context"] == sent and last_record(emulator)["references"] == 0


def test_the_openai_sdk_sends_stored_reasoning_back_and_it_is_accepted(emulator):
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    first = client.responses.create(model="m", input="think", reasoning={"effort": "low"})
    assert first.output[0].type == "reasoning"
    second = client.responses.create(model="m", reasoning={"effort": "low"},
                                     input=[{"role": "user", "content": "think"}, *first.output,
                                            {"role": "user", "content": "more"}])
    assert second.status == "completed"
    assert last_record(emulator)["context"][1]["id"] == first.output[0].id
    client.close()


@pytest.mark.parametrize("how", ["store false", "forgotten", "another credential"])
def test_a_reasoning_item_the_api_never_kept_is_not_found(emulator, how):
    first = reasoning_turn(emulator, store=how != "store false")
    if how == "forgotten":
        emulator.model.control({"forget": [first["id"]]})
    reasoning = first["output"][0]
    answer = request(emulator, "POST", "/v1/responses",
                     {"model": "m", "store": False, "input": [{"role": "user", "content": "think"}, reasoning,
                                                             {"role": "user", "content": "more"}]},
                     key="sk-b" if how == "another credential" else "sk-a")
    assert answer.status_code == 404
    assert answer.json() == {"error": {
        "message": f"Item with id '{reasoning['id']}' not found. Items are not persisted when `store` is set to"
                   " false. Try again with `store` set to true, or remove this item from your input.",
        "type": "invalid_request_error", "param": "input", "code": None}}


def test_a_reasoning_item_with_encrypted_content_is_taken_without_lookup(emulator):
    first = reasoning_turn(emulator, store=False, encrypted=True)
    reasoning = first["output"][0]
    assert reasoning["encrypted_content"].startswith("enc_")
    sent = [{"role": "user", "content": "think"}, reasoning, {"role": "user", "content": "more"}]
    create(emulator, input=sent, store=False)
    assert last_record(emulator)["context"] == sent


def test_a_stateless_server_looks_no_reasoning_item_up(emulator):
    emulator.model.control({"stateless": "ignore"})
    sent = [{"type": "reasoning", "id": "rs_never_stored", "summary": []}, {"role": "user", "content": "x"}]
    create(emulator, input=sent)
    assert last_record(emulator)["context"] == sent


# -- the faults a GET takes, and upstreams that ignore previous_response_id but store ------

@pytest.mark.parametrize("endpoint,suffix", [("retrieve", ""), ("input_items", "/input_items")])
def test_a_get_fault_is_taken_by_the_endpoint_it_names_once(emulator, endpoint, suffix):
    created = create(emulator, input="hello")
    emulator.model.control({"fail_next": [{"kind": "status", "status": 503, "endpoint": endpoint},
                                          {"kind": "stall", "ms": 300, "endpoint": endpoint}]})
    create(emulator, input="a create leaves them queued")
    other = "/input_items" if not suffix else ""
    assert request(emulator, "GET", f"/v1/responses/{created['id']}{other}").status_code == 200  # not its endpoint
    failed = request(emulator, "GET", f"/v1/responses/{created['id']}{suffix}")
    assert (failed.status_code, failed.json()["error"]["type"]) == (503, "server_error")
    started = time.monotonic()
    assert request(emulator, "GET", f"/v1/responses/{created['id']}{suffix}").status_code == 200
    assert time.monotonic() - started >= 0.3  # late, but answered
    assert emulator.model.faults.next == []


def test_an_upstream_that_ignores_previous_response_id_stores_and_answers_from_the_input_alone(emulator):
    emulator.model.control({"ignore_previous": True, "echo_previous": "respelled", "input_items": "absent"})
    first = create(emulator, input="hello")
    second = create(emulator, input="again", previous_response_id=first["id"])
    record = last_record(emulator)
    assert (record["continued"], record["stored"], len(record["context"])) == (False, True, 1)
    echoed = second["previous_response_id"]
    assert isinstance(echoed, str) and echoed.startswith("resp_") and echoed != first["id"]
    assert request(emulator, "GET", f"/v1/responses/{second['id']}").json() == second  # stored, read back
    listing = request(emulator, "GET", f"/v1/responses/{second['id']}/input_items")
    assert (listing.status_code, listing.json()["error"]["message"]) == \
        (404, f"Invalid URL (GET /v1/responses/{second['id']}/input_items)")
