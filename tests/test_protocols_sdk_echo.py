"""The crux: a real SDK's echo of an answer compares equal to the lifted answer.

Each test runs a real client against a loopback stub that serves canned
answers (JSON and SSE), lets the client put the answer back into its history
the way its docs show, and lifts what it really sent next. The next request's
conversation must extend the first request's plus the lifted answer.
"""

from __future__ import annotations

import base64
import json

import anthropic
import openai
import pytest
from google import genai
from google.genai import types as genai_types
from protocols_support import Stub, assert_continues, lift, lift_answer
from stateful_responses.emulator import sse_events


@pytest.fixture
def stub():
    with Stub() as server:
        yield server


def lift_sent(stub: Stub, protocol: str, index: int = -1):
    path, body = stub.sent(index)
    return lift(protocol, stub.url + path, body)


def lift_turn(stub: Stub, protocol: str, answer_bytes: bytes, sse: bool, index: int = -2):
    """The lifted request at ``index`` and the lifted answer to it."""
    answer = lift_answer(protocol, answer_bytes, sse)
    assert answer is not None
    return lift_sent(stub, protocol, index), answer


# --- openai-chat -------------------------------------------------------------

CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT_TOOL_CALL = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-x",
    "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "refusal": None, "annotations": [],
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\":   \"Paris\"}"}}]}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
CHAT_TEXT = {
    "id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "gpt-x",
    "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Sunny.", "refusal": None, "annotations": []}}]}


def chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-3", "object": "chat.completion.chunk", "created": 1, "model": "gpt-x",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


CHAT_STREAM = [
    chat_chunk({"role": "assistant", "content": "", "refusal": None}),
    chat_chunk({"content": "Let me"}),
    chat_chunk({"content": " check."}),
    chat_chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
    chat_chunk({"tool_calls": [{"index": 1, "id": "call_10", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": " \"Oslo\"}"}}]}),
    chat_chunk({}, "tool_calls"),
    "[DONE]",
]
CHAT_ECHOES = {
    "object": lambda m: m,
    "model_dump": lambda m: m.model_dump(),
    "model_dump_exclude_none": lambda m: m.model_dump(exclude_none=True),
}


@pytest.mark.parametrize("echo", CHAT_ECHOES)
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_openai_chat_echo(stub, echo, streamed):
    client = openai.OpenAI(base_url=stub.url + "/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    if streamed:
        answer_bytes = stub.answer_sse(CHAT_STREAM)
        with client.chat.completions.stream(model="gpt-x", messages=messages, tools=CHAT_TOOLS) as stream:
            message = stream.get_final_completion().choices[0].message
    else:
        answer_bytes = stub.answer_json(CHAT_TOOL_CALL)
        message = client.chat.completions.create(model="gpt-x", messages=messages, tools=CHAT_TOOLS).choices[0].message
    messages.append(CHAT_ECHOES[echo](message))
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in message.tool_calls]
    stub.answer_json(CHAT_TEXT)
    client.chat.completions.create(model="gpt-x", messages=messages, tools=CHAT_TOOLS)

    before, answer = lift_turn(stub, "openai-chat", answer_bytes, streamed)
    after = lift_sent(stub, "openai-chat")
    assert_continues(before, answer, after)
    assert [r.call_id for r in after.submitted_tool_results] == answer.pending_tool_calls
    if streamed:  # the SDK's stream helper really sends its accumulator's index
        assert json.loads(stub.sent()[1])["messages"][2]["tool_calls"][1]["index"] == 1


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
def test_langchain_openai_chat_echo(stub, streaming):
    """langchain rebuilds the assistant message and re-serializes the arguments."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(model="gpt-x", base_url=stub.url + "/v1", api_key="sk-test", max_retries=0,
                        streaming=streaming).bind_tools(CHAT_TOOLS)
    answer_bytes = stub.answer_sse(CHAT_STREAM) if streaming else stub.answer_json(CHAT_TOOL_CALL)
    history = [HumanMessage("Weather?")]
    reply = llm.invoke(history)
    history += [reply] + [ToolMessage("sunny", tool_call_id=call["id"]) for call in reply.tool_calls]
    if streaming:
        stub.answer_sse([chat_chunk({"role": "assistant", "content": "Sunny."}), chat_chunk({}, "stop"), "[DONE]"])
    else:
        stub.answer_json(CHAT_TEXT)
    llm.invoke(history)

    before, answer = lift_turn(stub, "openai-chat", answer_bytes, streaming)
    assert_continues(before, answer, lift_sent(stub, "openai-chat"))



@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
async def test_openai_agents_chat_completions_model_echo(stub, streamed):
    """openai-agents rebuilds Chat messages from its own run items."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    client = openai.AsyncOpenAI(base_url=stub.url + "/v1", api_key="sk-test", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Be brief.", tools=[get_weather],
                         model=agents.OpenAIChatCompletionsModel(model="gpt-x", openai_client=client))
    if streamed:
        answer_bytes = stub.answer_sse(CHAT_STREAM)
        stub.answer_sse([chat_chunk({"role": "assistant", "content": "Sunny."}), chat_chunk({}, "stop"), "[DONE]"])
        run = agents.Runner.run_streamed(agent, "Weather?")
        async for _ in run.stream_events():
            pass
    else:
        answer_bytes = stub.answer_json(CHAT_TOOL_CALL)
        stub.answer_json(CHAT_TEXT)
        await agents.Runner.run(agent, "Weather?")

    before, answer = lift_turn(stub, "openai-chat", answer_bytes, streamed, index=0)
    assert_continues(before, answer, lift_sent(stub, "openai-chat", 1))


# --- anthropic-messages --------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ANTHROPIC_TOOL_USE = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
    "content": [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": "c2lnLTE="},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "text", "text": "Checking.", "citations": None},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
    ],
    "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
ANTHROPIC_TEXT = {
    "id": "msg_2", "type": "message", "role": "assistant", "model": "claude-x",
    "content": [{"type": "text", "text": "Sunny."}],
    "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


def anthropic_stream() -> list:
    def delta(index: int, **d):
        return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})

    return [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_3", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        delta(0, type="thinking_delta", thinking="The user "),
        delta(0, type="thinking_delta", thinking="wants weather."),
        delta(0, type="signature_delta", signature="c2lnLTM="),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        delta(1, type="text_delta", text="Check"),
        delta(1, type="text_delta", text="ing."),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {}}}),
        delta(2, type="input_json_delta", partial_json=""),
        delta(2, type="input_json_delta", partial_json="{\"city\": \"Os"),
        delta(2, type="input_json_delta", partial_json="lo\", \"days\": 2}"),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]


ANTHROPIC_ECHOES = {
    "objects": lambda content: content,
    "model_dump": lambda content: [b.model_dump() for b in content],
    "model_dump_exclude_none": lambda content: [b.model_dump(exclude_none=True) for b in content],
    "to_dict": lambda content: [b.to_dict() for b in content],
}


@pytest.mark.parametrize("echo", ANTHROPIC_ECHOES)
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_anthropic_echo(stub, echo, streamed):
    client = anthropic.Anthropic(base_url=stub.url, api_key="sk-test", max_retries=0)
    messages = [{"role": "user", "content": "Weather?"}]
    request = dict(model="claude-x", max_tokens=100, system="Be brief.", tools=ANTHROPIC_TOOLS)
    if streamed:
        answer_bytes = stub.answer_sse(anthropic_stream())
        with client.messages.stream(messages=messages, **request) as stream:
            message = stream.get_final_message()
    else:
        answer_bytes = stub.answer_json(ANTHROPIC_TOOL_USE)
        message = client.messages.create(messages=messages, **request)
    messages.append({"role": "assistant", "content": ANTHROPIC_ECHOES[echo](message.content)})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in message.content if b.type == "tool_use"]})
    stub.answer_json(ANTHROPIC_TEXT)
    client.messages.create(messages=messages, **request)

    before, answer = lift_turn(stub, "anthropic-messages", answer_bytes, streamed)
    after = lift_sent(stub, "anthropic-messages")
    assert_continues(before, answer, after)
    assert [r.call_id for r in after.submitted_tool_results] == answer.pending_tool_calls
    assert after.submitted_tool_results[0].name == "get_weather"


def test_anthropic_moved_cache_control(stub):
    """Claude Code marks the newest message for caching and unmarks it next turn."""
    client = anthropic.Anthropic(base_url=stub.url, api_key="sk-test", max_retries=0)
    cached = {"type": "ephemeral"}
    answer_bytes = stub.answer_json(ANTHROPIC_TEXT)
    client.messages.create(model="claude-x", max_tokens=100, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": cached}]}])
    stub.answer_json(ANTHROPIC_TEXT)
    client.messages.create(model="claude-x", max_tokens=100, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny.", "cache_control": cached}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks", "cache_control": cached}]}])

    before, answer = lift_turn(stub, "anthropic-messages", answer_bytes, False)
    after = lift_sent(stub, "anthropic-messages")
    assert_continues(before, answer, after)
    assert any(e.field == "cache_control" and e.disposition == "dropped" for e in after.audit)


# --- gemini-chat ---------------------------------------------------------------

# Bytes whose standard base64 has "+" and "/": google-genai re-encodes them URL-safe.
SIGNATURE = base64.b64encode(b"\xfb\xff\xbf\x00signature").decode()


def gemini_response(parts: list, finish: str | None = "STOP", response_id: str = "r1") -> dict:
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "modelVersion": "gemini-x", "responseId": response_id,
            "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}}


GEMINI_CALL = gemini_response([{"functionCall": {"name": "get_weather", "args": {"city": "Paris"}},
                                "thoughtSignature": SIGNATURE}])
GEMINI_TEXT = gemini_response([{"text": "Sunny."}])
GEMINI_STREAM = [
    gemini_response([{"text": "Considering", "thought": True}], None, "r2"),
    gemini_response([{"text": " the sky.", "thought": True}], None, "r2"),
    gemini_response([{"text": "Hel"}], None, "r2"),
    gemini_response([{"text": "lo"}], None, "r2"),
    gemini_response([{"text": "", "thoughtSignature": SIGNATURE}], "STOP", "r2"),
]


def gemini_client(stub: Stub) -> genai.Client:
    return genai.Client(api_key="test-key", http_options=genai_types.HttpOptions(base_url=stub.url))


NO_AFC = genai_types.AutomaticFunctionCallingConfig(disable=True)


def test_gemini_chat_function_call_echo(stub):
    client = gemini_client(stub)  # held: a chat does not keep its client open
    chat = client.chats.create(model="gemini-x", config=genai_types.GenerateContentConfig(
        system_instruction="Be brief.", automatic_function_calling=NO_AFC))
    answer_bytes = stub.answer_json(GEMINI_CALL)
    chat.send_message("Weather?")
    stub.answer_json(GEMINI_TEXT)
    chat.send_message(genai_types.Part.from_function_response(name="get_weather", response={"result": "sunny"}))

    before, answer = lift_turn(stub, "gemini-chat", answer_bytes, False)
    after = lift_sent(stub, "gemini-chat")
    assert_continues(before, answer, after)
    assert [r.call_id for r in after.submitted_tool_results] == answer.pending_tool_calls == ["get_weather#0"]
    echoed = json.loads(stub.sent()[1])["contents"][1]["parts"][0]["thoughtSignature"]
    assert echoed != SIGNATURE and echoed == SIGNATURE.replace("+", "-").replace("/", "_")


def test_gemini_chat_stream_echo_one_content_per_chunk(stub):
    client = gemini_client(stub)
    chat = client.chats.create(model="gemini-x")
    answer_bytes = stub.answer_sse(GEMINI_STREAM)
    for _ in chat.send_message_stream("Hi"):
        pass
    stub.answer_json(GEMINI_TEXT)
    chat.send_message("More")

    path, _ = stub.sent(-2)
    assert path.endswith(":streamGenerateContent?alt=sse")
    before, answer = lift_turn(stub, "gemini-chat", answer_bytes, True)
    after = lift_sent(stub, "gemini-chat")
    assert len(json.loads(stub.sent()[1])["contents"]) == 2 + len(GEMINI_STREAM)
    assert_continues(before, answer, after)
    assert answer.messages == [{"role": "model", "parts": [
        {"text": "Considering the sky.", "thought": True}, {"text": "Hello"}, {"text": "", "thoughtSignature": SIGNATURE}]}]


@pytest.mark.parametrize("echo", ["object", "model_dump", "model_dump_exclude_none"])
def test_gemini_generate_content_echo(stub, echo):
    client = gemini_client(stub)
    contents: list = [{"role": "user", "parts": [{"text": "Weather?"}]}]
    answer_bytes = stub.answer_json(GEMINI_CALL)
    content = client.models.generate_content(model="gemini-x", contents=contents).candidates[0].content
    contents.append({"object": content, "model_dump": content.model_dump(mode="json"),
                     "model_dump_exclude_none": content.model_dump(mode="json", exclude_none=True)}[echo])
    contents.append({"role": "user", "parts": [
        {"function_response": {"name": "get_weather", "response": {"result": "sunny"}}}]})
    stub.answer_json(GEMINI_TEXT)
    client.models.generate_content(model="gemini-x", contents=contents)

    before, answer = lift_turn(stub, "gemini-chat", answer_bytes, False)
    assert_continues(before, answer, lift_sent(stub, "gemini-chat"))


def test_gemini_automatic_function_calling_history(stub):
    """With a Python function as a tool, google-genai runs the call itself and
    sends the model's call and the function's result in its next request."""

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    client = gemini_client(stub)
    chat = client.chats.create(model="gemini-x", config=genai_types.GenerateContentConfig(tools=[get_weather]))
    call_bytes = stub.answer_json(GEMINI_CALL)
    text_bytes = stub.answer_json(GEMINI_TEXT)
    chat.send_message("Weather?")
    stub.answer_json(GEMINI_TEXT)
    chat.send_message("Thanks")

    first, call = lift_turn(stub, "gemini-chat", call_bytes, False, index=0)
    second, text = lift_turn(stub, "gemini-chat", text_bytes, False, index=1)
    third = lift_sent(stub, "gemini-chat", 2)
    assert_continues(first, call, second)
    assert_continues(second, text, third)
    assert [r.call_id for r in second.submitted_tool_results] == call.pending_tool_calls


# --- openai-responses ----------------------------------------------------------

RESPONSES_CALL = {
    "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-x",
    "store": True, "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-secret"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
    ], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": None}
RESPONSES_TEXT = {
    "id": "resp_2", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-x",
    "output": [{"type": "message", "id": "msg_2", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]}],
    "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


@pytest.mark.parametrize("echo", ["objects", "model_dump"])
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_openai_responses_echo(stub, echo, streamed):
    client = openai.OpenAI(base_url=stub.url + "/v1", api_key="sk-test", max_retries=0)
    items: list = [{"role": "user", "content": "Weather?"}]
    if streamed:
        answer_bytes = stub.answer_sse([(e["type"], e) for e in sse_events(json.loads(json.dumps(RESPONSES_CALL)))])
        with client.responses.stream(model="gpt-x", input=items, instructions="Be brief.") as stream:
            output = stream.get_final_response().output
    else:
        answer_bytes = stub.answer_json(RESPONSES_CALL)
        output = client.responses.create(model="gpt-x", input=items, instructions="Be brief.").output
    items += output if echo == "objects" else [o.model_dump() for o in output]
    items.append({"type": "function_call_output", "call_id": "call_1", "output": "sunny"})
    stub.answer_json(RESPONSES_TEXT)
    client.responses.create(model="gpt-x", input=items, instructions="Be brief.")

    before, answer = lift_turn(stub, "openai-responses", answer_bytes, streamed)
    after = lift_sent(stub, "openai-responses")
    assert_continues(before, answer, after)
    assert [r.call_id for r in after.submitted_tool_results] == answer.pending_tool_calls == ["call_1"]
    assert after.submitted_tool_results[0].name == "get_weather"
