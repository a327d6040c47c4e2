"""The emulator's other conversation APIs, driven by the real SDKs.

Each SDK holds a conversation with a tool call and its result, JSON and
streamed. What the SDK parsed must be what the emulator logged as its answer
(so a streamed answer reassembles to the JSON one), the log's context must be
exactly what the SDK put on the wire, and the text answer must be the digest of
that context.
"""

from __future__ import annotations

import hashlib
import json

import anthropic
import openai
import pytest
from driver import httpx
from google import genai
from google.genai import types as genai_types
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionMessage
from stateful_responses.emulator import context_digest

CALL = 'Weather? call:get_weather({"city": "Paris"})'
SYSTEM = "Be brief."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Recorder:
    """An HTTP client for the SDKs that keeps every request they send: what
    really went on the wire."""

    def __init__(self) -> None:
        self.requests: list = []
        self.client = httpx.Client(trust_env=False, event_hooks={"request": [self.requests.append]})

    def body(self) -> dict:
        return json.loads(self.requests[-1].content)


@pytest.fixture
def recorder():
    recorder = Recorder()
    yield recorder
    recorder.client.close()


def expected_text(context: list, system: object) -> str:
    """The deterministic model's text answer over exactly this context."""
    text = f"I saw {len(context)} messages; context digest {context_digest(context)}."
    return text + (f" System digest {context_digest(system)}." if system is not None else "")


def logged(emulator, recorder: Recorder, protocol: str, context: list, system: object) -> dict:
    """The newest log record, checked against the request the SDK sent."""
    record = emulator.model.snapshot_log()[-1]
    sent = recorder.requests[-1].content
    assert (record["protocol"], record["status_code"]) == (protocol, 200)
    assert record["context"] == context and record["system"] == system
    assert record["body_bytes"] == len(sent) and record["body_sha256"] == hashlib.sha256(sent).hexdigest()
    return record


# Raw requests, for what the SDKs hide: event order, refusals, faults.
KEY_HEADERS = {"openai-chat": {"authorization": "Bearer sk-a"},
               "anthropic-messages": {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"},
               "gemini-chat": {"x-goog-api-key": "sk-a"}}
PATHS = {"openai-chat": "/v1/chat/completions", "anthropic-messages": "/v1/messages",
         "gemini-chat": "/v1beta/models/gemini-x:generateContent"}
PROTOCOLS = list(PATHS)


def post(emulator, protocol: str, body: dict, headers: dict | None = None, path: str | None = None):
    """A raw POST: the status, and the JSON body (the text when it is not JSON)."""
    with httpx.Client(trust_env=False) as client:
        r = client.post(emulator.url + (path or PATHS[protocol]), json=body,
                        headers=KEY_HEADERS[protocol] if headers is None else headers)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def hello(protocol: str, stream: bool = False) -> tuple[dict, str]:
    """The smallest request of each protocol saying "hi", and its path."""
    if protocol == "gemini-chat":
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, f"/v1beta/models/gemini-x:{method}"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if protocol == "anthropic-messages":
        body["max_tokens"] = 100
    return body, PATHS[protocol]


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an event stream."""
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# --- OpenAI Chat Completions ---------------------------------------------------

CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]


def chat_turn(client: openai.OpenAI, messages: list, streamed: bool):
    """One turn through the SDK: its parsed choice (a streamed one reassembled
    by the SDK's own stream state)."""
    if not streamed:
        return client.chat.completions.create(model="gpt-x", messages=messages, tools=CHAT_TOOLS).choices[0]
    state = ChatCompletionStreamState(input_tools=CHAT_TOOLS)
    for chunk in client.chat.completions.create(model="gpt-x", messages=messages, tools=CHAT_TOOLS, stream=True,
                                                stream_options={"include_usage": True}):
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def chat_essence(message) -> tuple:
    calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return message.role, message.content, calls


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_chat_completions_conversation_with_a_tool_call(emulator, recorder, streamed):
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-chat", max_retries=0, http_client=recorder.client)
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": CALL}]

    choice = chat_turn(client, messages, streamed)
    sent = recorder.body()["messages"]
    record = logged(emulator, recorder, "openai-chat", sent, [sent[0]])
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert chat_essence(choice.message) == chat_essence(ChatCompletionMessage.model_validate(record["output"][0]))
    assert record["response_id"].startswith("chatcmpl-") and record["stream"] is streamed

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    choice = chat_turn(client, messages, streamed)
    sent = recorder.body()["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    record = logged(emulator, recorder, "openai-chat", sent, [sent[0]])
    assert choice.finish_reason == "stop" and choice.message.content == expected_text(sent, [sent[0]])
    assert chat_essence(choice.message) == chat_essence(ChatCompletionMessage.model_validate(record["output"][0]))
    client.close()


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_fragments_tool_arguments_and_honours_include_usage(emulator, include_usage):
    body = {"model": "gpt-x", "messages": [{"role": "user", "content": CALL}], "tools": CHAT_TOOLS,
            "stream": True, "stream_options": {"include_usage": include_usage}}
    _, text = post(emulator, "openai-chat", body)
    data = sse_data(text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"]
             and "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert len(calls) > 2 and all(c["index"] == 0 for c in calls)
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert ("usage" in chunks[0]) is include_usage
    finishing = chunks[-2] if include_usage else chunks[-1]
    assert finishing["choices"][0]["finish_reason"] == "tool_calls"
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("options,obfuscated", [({}, True), ({"include_obfuscation": False}, False)])
def test_chat_chunks_carry_obfuscation_unless_the_client_opts_out(emulator, options, obfuscated):
    body = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": options}
    chunks = [json.loads(d) for d in sse_data(post(emulator, "openai-chat", body)[1])[:-1]]
    assert chunks and all(("obfuscation" in c) is obfuscated for c in chunks)


def test_chat_answer_stops_at_max_completion_tokens(emulator):
    client = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-chat", max_retries=0)
    choice = client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=3).choices[0]
    assert choice.finish_reason == "length" and choice.message.content == expected_text(
        [{"role": "user", "content": "hi"}], None)[:12]
    client.close()


# --- Anthropic Messages ----------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER_SCHEMA}]


def anthropic_turn(client: anthropic.Anthropic, messages: list, streamed: bool):
    request = dict(model="claude-x", max_tokens=200, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages)
    if not streamed:
        return client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        return stream.get_final_message()


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_anthropic_messages_conversation_with_a_tool_call(emulator, recorder, streamed):
    client = anthropic.Anthropic(base_url=emulator.url, api_key="sk-ant", max_retries=0, http_client=recorder.client)
    messages: list = [{"role": "user", "content": CALL}]

    message = anthropic_turn(client, messages, streamed)
    context = [{"role": "system", "content": SYSTEM}] + recorder.body()["messages"]
    record = logged(emulator, recorder, "anthropic-messages", context, SYSTEM)
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert [b.model_dump(exclude_none=True) for b in message.content] == record["output"][0]["content"]
    assert record["response_id"] == message.id and message.id.startswith("msg_")

    messages += [{"role": "assistant", "content": message.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}]
    message = anthropic_turn(client, messages, streamed)
    sent = recorder.body()["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"] and sent[1]["content"][0]["id"] == block.id
    context = [{"role": "system", "content": SYSTEM}] + sent
    record = logged(emulator, recorder, "anthropic-messages", context, SYSTEM)
    assert message.stop_reason == "end_turn" and message.content[0].text == expected_text(context, SYSTEM)
    assert [b.model_dump(exclude_none=True) for b in message.content] == record["output"][0]["content"]
    client.close()


def test_anthropic_stream_events_in_the_api_order(emulator):
    body = {"model": "claude-x", "max_tokens": 200, "tools": ANTHROPIC_TOOLS, "stream": True,
            "messages": [{"role": "user", "content": CALL}]}
    _, text = post(emulator, "anthropic-messages", body)
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    events = [json.loads(d) for d in sse_data(text)]
    assert [e["type"] for e in events] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[1]["content_block"]["input"] == {}
    partial = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert all(e["delta"]["type"] == "input_json_delta" for e in events if e["type"] == "content_block_delta")
    assert json.loads("".join(partial)) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] > 0


def test_anthropic_answer_stops_at_max_tokens(emulator):
    client = anthropic.Anthropic(base_url=emulator.url, api_key="sk-ant", max_retries=0)
    with client.messages.stream(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}]) as s:
        message = s.get_final_message()
    assert message.stop_reason == "max_tokens" and message.content[0].text == "I saw 1 "
    client.close()


@pytest.mark.parametrize("headers,status,kind,message", [
    ({"anthropic-version": "2023-06-01"}, 401, "authentication_error", "x-api-key header is required"),
    ({"x-api-key": "sk-ant"}, 400, "invalid_request_error", "anthropic-version: header is required"),
])
def test_anthropic_refusals_in_anthropics_shape(emulator, headers, status, kind, message):
    with httpx.Client(trust_env=False) as client:
        r = client.post(emulator.url + "/v1/messages", headers=headers,
                        json={"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    body = r.json()
    assert r.status_code == status and body["type"] == "error" and body["error"] == {"type": kind, "message": message}


def test_anthropic_takes_a_bearer_token_too(emulator):
    status, body = post(emulator, "anthropic-messages", {"model": "claude-x", "max_tokens": 50, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"authorization": "Bearer oauth-token",
                                                     "anthropic-version": "2023-06-01"})
    assert status == 200 and body["type"] == "message"


# --- Gemini ----------------------------------------------------------------------

GEMINI_CONFIG = genai_types.GenerateContentConfig(
    system_instruction=SYSTEM,
    tools=[genai_types.Tool(function_declarations=[
        genai_types.FunctionDeclaration(name="get_weather", parameters_json_schema=WEATHER_SCHEMA)])],
    automatic_function_calling=genai_types.AutomaticFunctionCallingConfig(disable=True))


def gemini_client(emulator, recorder: Recorder | None = None) -> genai.Client:
    return genai.Client(api_key="g-key", http_options=genai_types.HttpOptions(
        base_url=emulator.url, httpx_client=recorder.client if recorder else None,
        retry_options=genai_types.HttpRetryOptions(attempts=1)))


def gemini_turn(client: genai.Client, contents: list, streamed: bool) -> genai_types.Content:
    """The model's content as the SDK parsed it; streamed, the chunks' parts
    joined (text pieces into one text part)."""
    if not streamed:
        return client.models.generate_content(model="gemini-x", contents=contents, config=GEMINI_CONFIG
                                              ).candidates[0].content
    parts = [part for chunk in client.models.generate_content_stream(model="gemini-x", contents=contents,
                                                                     config=GEMINI_CONFIG)
             for part in chunk.candidates[0].content.parts]
    if all(part.text is not None for part in parts):
        parts = [genai_types.Part(text="".join(part.text for part in parts))]
    return genai_types.Content(role="model", parts=parts)


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_gemini_conversation_with_a_function_call(emulator, recorder, streamed):
    client = gemini_client(emulator, recorder)
    contents: list = [genai_types.Content(role="user", parts=[genai_types.Part(text=CALL)])]

    content = gemini_turn(client, contents, streamed)
    sent = recorder.body()
    assert str(recorder.requests[-1].url).endswith(
        ":streamGenerateContent?alt=sse" if streamed else ":generateContent")
    record = logged(emulator, recorder, "gemini-chat", sent["contents"], sent["systemInstruction"])
    assert sent["systemInstruction"]["parts"] == [{"text": SYSTEM}]
    [part] = content.parts
    call = part.function_call
    assert (call.name, call.args) == ("get_weather", {"city": "Paris"}) and call.id
    assert content == genai_types.Content.model_validate(record["output"][0])

    contents += [content, genai_types.Content(role="user", parts=[genai_types.Part(
        function_response=genai_types.FunctionResponse(id=call.id, name=call.name, response={"result": "sunny"}))])]
    content = gemini_turn(client, contents, streamed)
    sent = recorder.body()
    assert [c["role"] for c in sent["contents"]] == ["user", "model", "user"]
    assert sent["contents"][1]["parts"][0]["functionCall"]["id"] == call.id
    record = logged(emulator, recorder, "gemini-chat", sent["contents"], sent["systemInstruction"])
    assert content.parts[0].text == expected_text(sent["contents"], sent["systemInstruction"])
    assert content == genai_types.Content.model_validate(record["output"][0])
    client.close()


def test_gemini_streams_a_json_array_without_alt_sse(emulator):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    status, chunks = post(emulator, "gemini-chat", body, path="/v1beta/models/gemini-x:streamGenerateContent")
    assert status == 200 and isinstance(chunks, list) and len(chunks) > 1
    assert "".join(c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks) == expected_text(
        body["contents"], None)
    assert [c["candidates"][0].get("finishReason") for c in chunks][-2:] == [None, "STOP"]
    assert len({c["responseId"] for c in chunks}) == 1 and "candidatesTokenCount" in chunks[-1]["usageMetadata"]


def test_gemini_key_in_the_query_and_refusals_in_googles_shape(emulator):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    status, _ = post(emulator, "gemini-chat", body, headers={}, path="/v1beta/models/gemini-x:generateContent?key=q")
    assert status == 200
    status, refused = post(emulator, "gemini-chat", body, headers={})
    assert status == 403 and refused["error"]["status"] == "PERMISSION_DENIED" and refused["error"]["code"] == 403
    status, refused = post(emulator, "gemini-chat", {"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]})
    assert status == 400 and refused == {"error": {"code": 400, "message": "Please use a valid role: user, model.",
                                                   "status": "INVALID_ARGUMENT"}}


def test_gemini_answer_stops_at_max_output_tokens(emulator):
    client = gemini_client(emulator)
    response = client.models.generate_content(model="gemini-x", contents="hi",
                                              config=genai_types.GenerateContentConfig(max_output_tokens=2))
    assert response.candidates[0].finish_reason == genai_types.FinishReason.MAX_TOKENS
    assert response.text == "I saw 1 "
    client.close()


# --- every protocol: routes, the log, faults --------------------------------------

@pytest.mark.parametrize("protocol,path", [
    ("openai-chat", "/chat/completions"), ("anthropic-messages", "/messages"),
    ("gemini-chat", "/v1/models/gemini-x:generateContent")])
def test_paths_the_apis_also_answer_on(emulator, protocol, path):
    body, _ = hello(protocol)
    status, _ = post(emulator, protocol, body, path=path)
    assert status == 200 and emulator.model.snapshot_log()[-1]["protocol"] == protocol


ANSWER_IDS = {"openai-chat": "id", "anthropic-messages": "id", "gemini-chat": "responseId"}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_log_records_every_field_and_no_credential(emulator, protocol):
    body, path = hello(protocol)
    _, answer = post(emulator, protocol, body, path=path)
    other_key = {name: value.replace("sk-a", "sk-b") for name, value in KEY_HEADERS[protocol].items()}
    post(emulator, protocol, body, headers=other_key, path=path)
    first, second = emulator.model.snapshot_log()
    for field in ("protocol", "context", "system", "status_code", "response_id", "output", "stream", "body_bytes",
                  "body_sha256", "credential", "model"):
        assert field in first, field
    assert first["model"] in ("m", "gemini-x") and first["stream"] is False and first["system"] is None
    assert first["response_id"] == answer[ANSWER_IDS[protocol]]
    assert first["credential"] != second["credential"] and "sk-a" not in json.dumps(first)


def test_responses_records_name_their_protocol(emulator):
    with httpx.Client(trust_env=False) as client:
        client.post(emulator.url + "/v1/responses", json={"model": "m", "input": "hi"},
                    headers={"authorization": "Bearer sk-a"})
    assert emulator.model.snapshot_log()[-1]["protocol"] == "openai-responses"


def test_sdks_read_injected_server_errors(emulator):
    emulator.model.control({"fail_next": [{"kind": "status", "status": status} for status in (503, 529, 503)]})
    chat = openai.OpenAI(base_url=emulator.url + "/v1", api_key="sk-a", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 503
    messages = anthropic.Anthropic(base_url=emulator.url, api_key="sk-a", max_retries=0)
    with pytest.raises(anthropic.OverloadedError) as failed:
        messages.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    gemini = gemini_client(emulator)
    with pytest.raises(genai.errors.ServerError) as failed:
        gemini.models.generate_content(model="gemini-x", contents="hi")
    assert (failed.value.code, failed.value.status) == (503, "UNAVAILABLE")
    assert [(r["fault"], r["status_code"]) for r in emulator.model.snapshot_log()] == [
        ("status", 503), ("status", 529), ("status", 503)]
    for client in (chat, messages, gemini):
        client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_reset_html_and_cut_faults(emulator, protocol):
    body, path = hello(protocol)
    emulator.model.control({"fail_next": [{"kind": "reset"}, {"kind": "html"}]})
    with pytest.raises(httpx.TransportError):
        post(emulator, protocol, body, path=path)
    status, page = post(emulator, protocol, body, path=path)
    assert status == 200 and page.startswith("<html>")
    body, path = hello(protocol, stream=True)
    emulator.model.control({"fail_next": [{"kind": "cut", "after_events": 2}]})
    with pytest.raises(httpx.TransportError):
        post(emulator, protocol, body, path=path)
    assert [r["fault"] for r in emulator.model.snapshot_log()] == ["reset", "html", "cut"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_end_fault_ends_the_stream_early_as_a_whole_http_answer(emulator, protocol):
    body, path = hello(protocol, stream=True)
    status, whole = post(emulator, protocol, body, path=path)
    emulator.model.control({"fail_next": [{"kind": "end", "after_events": 2}]})
    status, ended = post(emulator, protocol, body, path=path)  # no transport error: the stream's end came
    assert status == 200 and len(sse_data(ended)) == 2 < len(sse_data(whole))
    log = emulator.model.snapshot_log()
    assert [r["fault"] for r in log] == [None, "end"] and log[-1]["sse"] == ended

def test_a_fault_waits_for_the_protocol_and_kind_it_applies_to(emulator):
    emulator.model.control({"fail_next": [{"kind": "failed"}, {"kind": "status", "protocol": "gemini-chat"}]})
    for protocol in ("openai-chat", "anthropic-messages", "gemini-chat"):
        body, path = hello(protocol)
        post(emulator, protocol, body, path=path)
    assert [r["status_code"] for r in emulator.model.snapshot_log()] == [200, 200, 500]
    assert emulator.model.faults.next == [{"kind": "failed"}]  # a Responses-only fault stays for Responses


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_streams_are_gzipped_when_asked_and_logged_as_sent(emulator, protocol):
    emulator.model.control({"gzip": True})
    body, path = hello(protocol, stream=True)
    with httpx.Client(trust_env=False) as client:
        r = client.post(emulator.url + path, json=body, headers=KEY_HEADERS[protocol])
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert emulator.model.snapshot_log()[-1]["sse"] == r.text
