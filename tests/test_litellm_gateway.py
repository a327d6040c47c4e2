"""LiteLLM's proxy (tests/litellm-requirements.txt) as a gateway, the real openai
SDK in front of it and the emulator behind it, no addon in between: what it does
to ``/v1/responses`` on each route, what README's LiteLLM rows rest on. The
addon may sit in front of such a gateway: these are the answers it would see.

- Native pass-through (``openai/<m>``): the emulator stores; every response id
  the client sees is LiteLLM's own, long and opaque, and LiteLLM turns it back
  into the emulator's on the way in; a continuation echoes the emulator's raw
  ``previous_response_id``; a refused one is 400 with ``"code": "400"``.
- Bridged onto chat completions (``openai/chat_completions/<m>``, and
  ``custom_openai/<m>``, a provider without a Responses API): without a
  database nothing is stored, yet ``store`` repeats the request's and a
  continuation is answered 200 with its history silently dropped.
- Streams on both end with ``data: [DONE]``, which neither OpenAI nor the
  emulator sends on ``/responses``."""

from __future__ import annotations

import json
import re

import openai
import pytest
from litellm_server import UPSTREAM_MODEL, module_emulator

# LiteLLM's response id: the provider, deployment and upstream id, with the key's user
# and team, sealed (XSalsa20-Poly1305, random nonce) with a key derived from the master
# key, in url-safe base64: a new string on every answer, even for the same response.
LITELLM_ID = re.compile(r"resp_[A-Za-z0-9_-]{100,}={0,2}")
UPSTREAM_ID = re.compile(r"resp_[0-9a-f]{32}")
CHAT_ID = re.compile(r"chatcmpl-\w+")


emulator = module_emulator()


@pytest.fixture
def client(litellm_gateway, fresh_emulator):
    return openai.OpenAI(base_url=litellm_gateway.base_url, api_key=litellm_gateway.master_key, max_retries=0)


def create(client, **body) -> dict:
    """The answer's JSON as sent (the SDK's ``Response`` has no ``store``)."""
    return client.responses.with_raw_response.create(**body).http_response.json()


def stream(client, **body) -> tuple[list[dict], str | None]:
    """The events of a streamed answer, and what follows its last event."""
    events, after = [], None
    with client.responses.with_streaming_response.create(stream=True, **body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                after = data
            else:
                events.append(json.loads(data))
    return events, after


def final(events: list[dict]) -> dict:
    [completed] = [event["response"] for event in events if event["type"] == "response.completed"]
    return completed


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def refusal(error: openai.APIStatusError) -> tuple[int, dict]:
    return error.status_code, error.response.json()["error"]


def test_native_pass_through_reencodes_ids_and_the_upstream_keeps_the_chain(litellm_gateway, client, emulator):
    model = litellm_gateway.native_model
    first = create(client, model=model, input="hello")
    [made] = emulator.model.snapshot_log()
    assert made["protocol"] == "openai-responses" and made["model"] == UPSTREAM_MODEL
    assert UPSTREAM_ID.fullmatch(made["response_id"]) and made["stored"]
    assert LITELLM_ID.fullmatch(first["id"]) and first["id"] != made["response_id"]
    assert first["model"] == model  # LiteLLM's model name, not the upstream's

    second = create(client, model=model, input="again", previous_response_id=first["id"])
    continued = emulator.model.snapshot_log()[-1]
    assert continued["previous_response_id"] == made["response_id"]  # decoded on the way in
    assert continued["continued"]
    assert continued["context"] == made["context"] + made["output"] + [user_text("again")]
    assert LITELLM_ID.fullmatch(second["id"]) and second["id"] not in (first["id"], continued["response_id"])
    # The echo is the upstream's raw id, not the one the client sent.
    assert second["previous_response_id"] == made["response_id"] != first["id"]

    # GET /v1/responses/{LiteLLM's id} reads the upstream's response back, under a new LiteLLM id.
    fetched = client.responses.with_raw_response.retrieve(first["id"]).http_response.json()
    assert LITELLM_ID.fullmatch(fetched["id"]) and fetched["id"] != first["id"]
    assert fetched["output"] == first["output"] and fetched["status"] == "completed"
    assert fetched["model"] == UPSTREAM_MODEL  # the upstream's model name this time

    # A continuation the upstream refuses: 400, the upstream's code only inside the message.
    emulator.model.control({"forget": [made["response_id"]]})
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, model=model, input="once more", previous_response_id=first["id"])
    status, error = refusal(refused.value)
    assert status == 400 and error["code"] == "400" and error["param"] is None
    assert error["type"] == "invalid_request_error"
    assert "previous_response_not_found" in error["message"] and made["response_id"] in error["message"]
    # An id LiteLLM never issued goes upstream as it is (the master key may address any id).
    with pytest.raises(openai.BadRequestError) as unknown:
        create(client, model=model, input="once more", previous_response_id="resp_unknown")
    status, error = refusal(unknown.value)
    assert status == 400 and error["code"] == "400" and "'resp_unknown' not found" in error["message"]
    assert emulator.model.snapshot_log()[-1]["previous_response_id"] == "resp_unknown"
    # Reading a forgotten response back: the upstream's 404, with "code": "404".
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first["id"])
    status, error = refusal(gone.value)
    assert status == 404 and error["code"] == "404" and made["response_id"] in error["message"]


def test_native_pass_through_streamed(litellm_gateway, client, emulator):
    model = litellm_gateway.native_model
    events, after = stream(client, model=model, input="hello")
    [made] = emulator.model.snapshot_log()
    first = final(events)
    assert {event["response"]["id"] for event in events if "response" in event} == {first["id"]}
    assert LITELLM_ID.fullmatch(first["id"]) and first["id"] != made["response_id"]
    assert after == "[DONE]"  # LiteLLM adds it; the emulator, like OpenAI, ends at response.completed
    assert all(event["model"] == model for event in events)  # LiteLLM adds its model name to every event
    assert first["model"] == UPSTREAM_MODEL

    events, _ = stream(client, model=model, input="again", previous_response_id=first["id"])
    continued = emulator.model.snapshot_log()[-1]
    assert continued["previous_response_id"] == made["response_id"] and continued["continued"]
    assert continued["context"] == made["context"] + made["output"] + [user_text("again")]
    echoed = {event["response"]["previous_response_id"] for event in events if "response" in event}
    assert echoed == {made["response_id"]}
    assert LITELLM_ID.fullmatch(final(events)["id"])

    # A refused continuation is an HTTP 400 before any event, not an error event.
    emulator.model.control({"forget": [made["response_id"]]})
    with pytest.raises(openai.BadRequestError) as refused:
        stream(client, model=model, input="once more", previous_response_id=first["id"])
    status, error = refusal(refused.value)
    assert status == 400 and error["code"] == "400" and "previous_response_not_found" in error["message"]


# GET /v1/responses/{id} of a bridged answer: openai/ asks the upstream's Responses API
# for the chat completion's id (404 there); custom_openai/ refuses without asking.
BRIDGED_GET = {
    "chat-bridge": (404, "Response with id '{chat_id}' not found."),
    "provider-bridge": (500, "GET responses is not supported for custom_openai"),
}


def assert_bridged_get_fails(client, model: str, response_id: str, chat_id: str) -> None:
    status, message = BRIDGED_GET[model]
    with pytest.raises(openai.APIStatusError) as failed:
        client.responses.retrieve(response_id)
    assert failed.value.status_code == status
    assert message.format(chat_id=chat_id) in failed.value.response.json()["error"]["message"]


def test_bridged_store_repeats_the_request(litellm_gateway, client, emulator):
    """Nothing is stored, whatever ``store`` says. The JSON answer repeats the
    request's (null when it had none); a stream's first events say true even
    to ``store: false``, and only its last one repeats the request (no
    ``store`` at all when the request had none)."""
    for model in (litellm_gateway.chat_bridge_model, litellm_gateway.provider_bridge_model):
        for store in (True, False, None):
            asked = {} if store is None else {"store": store}
            answer = create(client, model=model, input="hello", **asked)
            assert emulator.model.snapshot_log()[-1]["protocol"] == "openai-chat"
            assert answer["store"] is store
            events, _ = stream(client, model=model, input="hello", **asked)
            assert [event["type"] for event in events if "response" in event] == [
                "response.created", "response.in_progress", "response.completed"]
            assert [event["response"]["store"] for event in events[:2]] == [True, True]
            assert final(events).get("store", "absent") == ("absent" if store is None else store)


def test_bridged_continuation_drops_the_history(litellm_gateway, client, emulator):
    for model in (litellm_gateway.chat_bridge_model, litellm_gateway.provider_bridge_model):
        first = create(client, model=model, input="hello", store=True)
        made = emulator.model.snapshot_log()[-1]
        assert CHAT_ID.fullmatch(made["response_id"])
        assert LITELLM_ID.fullmatch(first["id"])

        second = create(client, model=model, input="again", previous_response_id=first["id"])
        seen = emulator.model.snapshot_log()[-1]
        assert seen["protocol"] == "openai-chat"
        assert seen["context"] == [{"role": "user", "content": "again"}]  # the history is gone
        assert second["status"] == "completed"
        assert second["previous_response_id"] == made["response_id"]  # "chatcmpl-…"
        assert_bridged_get_fails(client, model, first["id"], made["response_id"])


def test_bridged_continuation_streamed(litellm_gateway, client, emulator):
    for model in (litellm_gateway.chat_bridge_model, litellm_gateway.provider_bridge_model):
        events, after = stream(client, model=model, input="hello", store=True)
        made = emulator.model.snapshot_log()[-1]
        first = final(events)
        assert LITELLM_ID.fullmatch(first["id"]) and after == "[DONE]"

        events, _ = stream(client, model=model, input="again", previous_response_id=first["id"])
        seen = emulator.model.snapshot_log()[-1]
        assert seen["stream"] and seen["context"] == [{"role": "user", "content": "again"}]
        # Only the last event echoes the parent's chat completion id; the first ones lack the field.
        assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
        assert not any("previous_response_id" in event["response"] for event in events[:2])
        assert final(events)["previous_response_id"] == made["response_id"]
        assert_bridged_get_fails(client, model, first["id"], made["response_id"])
