"""gemini-chat lifting: requests, JSON answers, SSE chunks and the streamed
JSON array, function calls without ids, and bytes in either base64 alphabet."""

from __future__ import annotations

import base64
import json

import pytest
from protocols_support import lift, lift_answer, same, sse_bytes
from stateful_responses.record.protocols import AnswerLifter, detect, lift_request

BASE = "https://generativelanguage.googleapis.com/v1beta/models/gemini-x"
URL = BASE + ":generateContent"
STREAM_URL = BASE + ":streamGenerateContent?alt=sse"
SIGNATURE = base64.b64encode(b"\xfb\xff\xbf\x00sig").decode()


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def response(parts: list, finish: str | None = "STOP", **fields) -> dict:
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "responseId": "r1", **fields}


def test_detect_by_endpoint():
    assert detect("POST", URL) == detect("POST", STREAM_URL) == "gemini-chat"
    vertex = "https://x-aiplatform.googleapis.com/v1/projects/p/locations/l/publishers/google/models/gemini-x:generateContent"
    assert detect("POST", vertex) == "gemini-chat"
    assert detect("POST", BASE + ":countTokens") is None


def test_request_model_stream_system_and_function_responses_without_ids():
    lifted = lift("gemini-chat", STREAM_URL, body(
        systemInstruction={"parts": [{"text": "Be brief."}]},
        contents=[
            {"role": "user", "parts": [{"text": "Weather in Paris and Oslo, and the time?"}]},
            {"role": "model", "parts": [
                {"functionCall": {"name": "get_weather", "args": {"city": "Paris"}}, "thoughtSignature": SIGNATURE},
                {"functionCall": {"name": "get_time", "args": {}}},
                {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}]},
            {"role": "user", "parts": [
                {"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}},
                {"functionResponse": {"name": "get_time", "response": {"result": "noon"}}},
                {"functionResponse": {"name": "get_weather", "response": {"result": "rain"}}}]},
        ]))
    assert (lifted.model, lifted.stream) == ("gemini-x", True)
    assert lifted.system == {"parts": [{"text": "Be brief."}]}
    assert [m["role"] for m in lifted.messages] == ["user", "model", "user"]
    assert [(r.call_id, r.name) for r in lifted.submitted_tool_results] == [
        ("get_weather#0", "get_weather"), ("get_time#0", "get_time"), ("get_weather#1", "get_weather")]
    assert lifted.hints == {"toolCallIds": "name#k"}
    assert ("functionResponse.id", "lossy") in [(e.field, e.disposition) for e in lifted.audit]


def test_responses_without_ids_take_their_calls_ids_by_name_and_order():
    """google-genai's automatic function calling answers calls that have ids
    with responses that have none: Gemini pairs them by name and order."""
    lifted = lift("gemini-chat", URL, body(contents=[
        {"role": "user", "parts": [{"text": "Weather in Paris and Oslo, and the time?"}]},
        {"role": "model", "parts": [
            {"functionCall": {"id": "a1", "name": "get_weather", "args": {"city": "Paris"}}},
            {"functionCall": {"id": "b2", "name": "get_time", "args": {}}},
            {"functionCall": {"id": "c3", "name": "get_weather", "args": {"city": "Oslo"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "get_time", "response": {"result": "noon"}}},
            {"functionResponse": {"id": "c3", "name": "get_weather", "response": {"result": "rain"}}},
            {"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}}]},
    ]))
    assert [r.call_id for r in lifted.submitted_tool_results] == ["b2", "c3", "a1"]
    assert "toolCallIds" not in lifted.hints  # nothing made up
    assert ("functionResponse.id", "lossy") not in [(e.field, e.disposition) for e in lifted.audit]


def test_function_call_ids_are_used_when_the_upstream_gives_them():
    answer = lift_answer("gemini-chat", json.dumps(response([
        {"functionCall": {"id": "fc_1", "name": "f", "args": {}}}])).encode(), sse=False)
    assert answer.pending_tool_calls == ["fc_1"]
    assert answer.hints == {}


def test_snake_case_fields_and_either_base64_alphabet_are_the_same_content():
    camel = {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {"snake_key": 1}},
                                         "thoughtSignature": SIGNATURE}]}
    snake = {"role": "model", "parts": [{"function_call": {"name": "f", "args": {"snake_key": 1}, "id": None},
                                         "thought_signature": SIGNATURE.replace("+", "-").replace("/", "_").rstrip("=")}]}
    a = lift("gemini-chat", URL, body(contents=[camel]))
    b = lift("gemini-chat", URL, body(contents=[snake]))
    assert same(a.messages, b.messages)
    assert a.messages[0]["parts"][0]["functionCall"]["args"] == {"snake_key": 1}  # free-form keys untouched


def test_cached_content_and_continuation_token_become_hints():
    lifted = lift("gemini-chat", URL, body(contents=[], cachedContent="cachedContents/abc", continuationToken="dG9rZW4="))
    assert lifted.hints["cachedContent"] == "cachedContents/abc"
    assert len(lifted.hints["continuationTokenDigest"]) == 32
    audit = {(e.field, e.disposition) for e in lifted.audit}
    assert {("cachedContent", "unsupported"), ("continuationToken", "preserved")} <= audit


@pytest.mark.parametrize("doc", [{"contents": {"role": "user"}}, {"model": "x"}, []])
def test_not_a_generate_content_body(doc):
    assert lift_request("gemini-chat", URL, json.dumps(doc).encode()) is None


STREAM = [
    response([{"text": "Plan", "thought": True}], None),
    response([{"text": "ning.", "thought": True}], None),
    response([{"text": "Sun"}], None),
    response([{"text": "ny."}], None),
    response([{"functionCall": {"name": "f", "args": {}}, "thoughtSignature": SIGNATURE}], None),
    response([{"text": "", "thoughtSignature": SIGNATURE}], "STOP", usageMetadata={"totalTokenCount": 3}),
]
MERGED = [{"role": "model", "parts": [
    {"text": "Planning.", "thought": True}, {"text": "Sunny."},
    {"functionCall": {"name": "f", "args": {}}, "thoughtSignature": SIGNATURE},
    {"text": "", "thoughtSignature": SIGNATURE}]}]


def test_sse_chunks_are_one_model_turn():
    answer = lift_answer("gemini-chat", sse_bytes(STREAM), sse=True)
    assert answer.messages == MERGED
    assert (answer.status, answer.response_id, answer.pending_tool_calls) == ("completed", "r1", ["f#0"])


def test_streamed_json_array_equals_sse():
    answer = lift_answer("gemini-chat", json.dumps(STREAM).encode(), sse=False)
    assert answer.messages == MERGED


def test_sse_is_complete_at_the_finish_reason():
    lifter = AnswerLifter("gemini-chat")
    lifter.event("", json.dumps(STREAM[0]))
    assert not lifter.complete
    lifter.event("", json.dumps(STREAM[-1]))
    assert lifter.complete


def test_signed_text_parts_are_never_joined():
    answer = lift_answer("gemini-chat", json.dumps(response([
        {"text": "a", "thoughtSignature": SIGNATURE}, {"text": "b"}])).encode(), sse=False)
    assert answer.messages[0]["parts"] == [{"text": "a", "thoughtSignature": SIGNATURE}, {"text": "b"}]


@pytest.mark.parametrize("finish, status", [("STOP", "completed"), ("MAX_TOKENS", "incomplete"), ("SAFETY", "incomplete"),
                                            ("MALFORMED_FUNCTION_CALL", "failed"), ("CONTINUATION", "incomplete"),
                                            (None, "unknown")])
def test_finish_reason_to_status(finish, status):
    assert lift_answer("gemini-chat", json.dumps(response([{"text": "x"}], finish)).encode(), sse=False).status == status


def test_continuation_token_digest_matches_the_request_that_resumes_it():
    answer_doc = response([{"text": "Part one"}], "CONTINUATION")
    answer_doc["candidates"][0]["continuationToken"] = SIGNATURE
    answer = lift_answer("gemini-chat", json.dumps(answer_doc).encode(), sse=False)
    resumed = lift("gemini-chat", URL, body(contents=[], continuationToken=SIGNATURE.replace("+", "-").replace("/", "_")))
    assert answer.hints["continuationTokenDigest"] == resumed.hints["continuationTokenDigest"]


def test_blocked_prompt_and_error_are_failed_answers():
    blocked = lift_answer("gemini-chat", b'{"promptFeedback": {"blockReason": "SAFETY"}}', sse=False)
    error = lift_answer("gemini-chat", json.dumps([STREAM[0], {"error": {"code": 500}}]).encode(), sse=False)
    assert (blocked.status, blocked.messages) == (error.status, error.messages) == ("failed", [])
