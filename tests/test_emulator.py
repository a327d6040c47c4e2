"""The emulator is an oracle: these tests pin it to the API's documented facts."""

from __future__ import annotations

import json
import time

import openai
import pytest
from driver import TOOLS, httpx


def post(emu, body, key="sk-a", stream=False):
    with httpx.Client(trust_env=False) as c:
        r = c.post(emu.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})
        return r.status_code, (r.text if stream else r.json())


def last(emu) -> dict:
    return emu.model.snapshot_log()[-1]


def test_continuation_context_is_the_stored_chain_plus_input(emulator):
    _, r1 = post(emulator, {"model": "m", "input": "one"})
    _, r2 = post(emulator, {"model": "m", "input": [{"role": "user", "content": "two"}], "previous_response_id": r1["id"]})
    context = last(emulator)["context"]
    assert [i.get("role") for i in context] == ["user", "assistant", "user"]
    assert context[1] == r1["output"][0]
    assert r2["previous_response_id"] == r1["id"] and r2["store"] is True


def test_instructions_are_not_inherited(emulator):
    _, r1 = post(emulator, {"model": "m", "input": "one", "instructions": "be brief"})
    assert "Instructions digest" in r1["output"][0]["content"][0]["text"]
    _, r2 = post(emulator, {"model": "m", "input": "two", "previous_response_id": r1["id"]})
    assert "Instructions digest" not in r2["output"][0]["content"][0]["text"]
    assert r2["instructions"] is None


def test_unknown_parent_gets_the_api_error_body(emulator):
    status, body = post(emulator, {"model": "m", "input": "x", "previous_response_id": "resp_missing"})
    assert status == 400
    assert body == {"error": {"message": "Previous response with id 'resp_missing' not found.",
                              "type": "invalid_request_error", "param": "previous_response_id",
                              "code": "previous_response_not_found"}}


def test_store_false_and_other_credentials_cannot_be_continued(emulator):
    _, unstored = post(emulator, {"model": "m", "input": "x", "store": False})
    assert unstored["store"] is False
    assert post(emulator, {"model": "m", "input": "y", "previous_response_id": unstored["id"]})[0] == 400
    _, stored = post(emulator, {"model": "m", "input": "x"}, key="sk-a")
    assert post(emulator, {"model": "m", "input": "y", "previous_response_id": stored["id"]}, key="sk-b")[0] == 400


@pytest.mark.parametrize("mode", ["reject", "ignore"])
def test_stateless_modes(emulator, mode):
    emulator.model.control({"stateless": mode})
    _, r1 = post(emulator, {"model": "m", "input": "x"})
    assert r1["store"] is False
    status, body = post(emulator, {"model": "m", "input": "y", "previous_response_id": r1["id"]})
    if mode == "reject":
        assert status == 400 and "previous_response_id" in body["error"]["message"]
    else:  # silently ignored, as Ollama does
        assert status == 200 and last(emulator)["context"] == [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "y"}]}]


def test_sse_event_order_sequence_numbers_and_terminal_event(emulator):
    status, text = post(emulator, {"model": "m", "input": "call:get_weather({\"city\": \"Oslo\"})",
                                   "tools": TOOLS, "stream": True}, stream=True)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["type"] == "function_call"
    assert events[0]["response"]["status"] == "in_progress"


@pytest.mark.parametrize("kind,terminal", [("failed", "response.failed"), ("incomplete", "response.incomplete")])
def test_injected_unfinished_answers(emulator, kind, terminal):
    emulator.model.control({"fail_next": [{"kind": kind}]})
    _, text = post(emulator, {"model": "m", "input": "x", "stream": True}, stream=True)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == terminal and events[-1]["response"]["status"] == kind
    assert last(emulator)["stored"] is False


def test_forgetting_by_id(emulator):
    _, r1 = post(emulator, {"model": "m", "input": "x"})
    emulator.model.control({"forget": [r1["id"]]})
    assert post(emulator, {"model": "m", "input": "y", "previous_response_id": r1["id"]})[0] == 400


def test_the_openai_sdk_reads_it(emulator):
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    r = client.responses.create(model="m", input="hello")
    assert r.status == "completed" and r.output_text.startswith("I saw 1 items")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    client.close()


def test_a_slow_uplink_paces_how_fast_request_bodies_are_read(emulator):
    emulator.model.control({"read_rate_bytes_per_s": 10_000_000})
    began = time.monotonic()
    status, _ = post(emulator, {"model": "m", "input": "x" * 1_000_000})
    assert status == 200 and time.monotonic() - began >= 0.08  # 1 MB at 10 MB/s: about 0.1 s
    assert last(emulator)["body_bytes"] > 1_000_000


def test_a_thinking_model_answers_after_think_ms_and_a_reset_with_settings_keeps_them(emulator):
    """Bounds a second apart, which no load on the machine blurs."""
    emulator.model.control({"think_ms": 6000})
    emulator.model.control({"reset": True, "think_ms": 1500})  # reset first, then the settings
    for body in ({"model": "m", "input": "x"}, {"model": "m", "input": "x", "stream": True}):
        began = time.monotonic()
        status, _ = post(emulator, body, stream=body.get("stream", False))
        assert status == 200 and 1.5 <= time.monotonic() - began < 5
    began = time.monotonic()
    status, queued = post(emulator, {"model": "m", "input": "x", "background": True})
    assert status == 200 and queued["status"] == "queued" and time.monotonic() - began < 1.5  # it did not think
    emulator.model.control({"reset": True})
    began = time.monotonic()
    post(emulator, {"model": "m", "input": "x"})
    assert time.monotonic() - began < 1.5  # the reset cleared think_ms


@pytest.mark.parametrize("options,obfuscated", [({}, True), ({"include_obfuscation": False}, False)])
def test_deltas_carry_obfuscation_unless_the_client_opts_out(emulator, options, obfuscated):
    _, text = post(emulator, {"model": "m", "input": "x", "stream": True, "stream_options": options}, stream=True)
    deltas = [e for e in map(json.loads, (line[6:] for line in text.splitlines() if line.startswith("data: ")))
              if e["type"].endswith(".delta")]
    assert deltas and all(("obfuscation" in e) is obfuscated for e in deltas)


def test_a_stream_error_fault_is_a_server_error_when_not_streaming(emulator):
    emulator.model.control({"fail_next": [{"kind": "stream_error"}]})
    status, body = post(emulator, {"model": "m", "input": "x"})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert last(emulator)["fault"] == "stream_error"
