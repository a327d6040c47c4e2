"""The normal forms absorb only what the model cannot tell apart.

Each protocol has one conversation; every change the model would see must
change its normal form, and every change an SDK makes without changing
meaning must not.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest
from protocols_support import lift, same

CHAT = ("openai-chat", "http://127.0.0.1/v1/chat/completions", {"model": "m", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
]})
ANTHROPIC = ("anthropic-messages", "http://127.0.0.1/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Look it up.", "signature": "c2lnLTE="},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"}]},
]})
SIGNATURE = "+/+/AHNpZw=="
GEMINI = ("gemini-chat", "http://127.0.0.1/v1beta/models/g:generateContent", {"contents": [
    {"role": "user", "parts": [{"text": "Weather?"}]},
    {"role": "model", "parts": [
        {"text": "Thinking it over.", "thought": True},
        {"text": "Checking."},
        {"functionCall": {"name": "get_weather", "args": {"city": "Paris", "days": 1}}, "thoughtSignature": SIGNATURE}]},
    {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"result": "sunny"}}}]},
]})
RESPONSES = ("openai-responses", "http://127.0.0.1/v1/responses", {"model": "m", "input": [
    {"role": "user", "content": "Weather?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-1"},
    {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
]})


def changed(case: tuple, edit: Callable[[dict], None]) -> tuple[list, list]:
    protocol, url, doc = case
    variant = copy.deepcopy(doc)
    edit(variant)
    return (lift(protocol, url, json.dumps(doc).encode()).messages,
            lift(protocol, url, json.dumps(variant).encode()).messages)


def chat_m(doc: dict) -> list:
    return doc["messages"]


def tool_calls(doc: dict) -> list:
    return doc["messages"][2]["tool_calls"]


def model_parts(doc: dict) -> list:
    return doc["contents"][1]["parts"]


def anthropic_blocks(doc: dict) -> list:
    return doc["messages"][1]["content"]


def swap(items: list, i: int, j: int) -> None:
    items[i], items[j] = items[j], items[i]


MEANINGFUL = {
    "chat text": (CHAT, lambda d: chat_m(d)[1].update(content="Weather in Paris and Oslo!")),
    "chat role": (CHAT, lambda d: chat_m(d)[0].update(role="developer")),
    "chat tool call id": (CHAT, lambda d: tool_calls(d)[0].update(id="call_z")),
    "chat tool name": (CHAT, lambda d: tool_calls(d)[0]["function"].update(name="get_forecast")),
    "chat argument value": (CHAT, lambda d: tool_calls(d)[0]["function"].update(arguments="{\"city\": \"Lyon\", \"days\": 1}")),
    "chat argument int vs float": (CHAT, lambda d: tool_calls(d)[0]["function"].update(
        arguments="{\"city\": \"Paris\", \"days\": 1.0}")),
    "chat tool call order": (CHAT, lambda d: swap(tool_calls(d), 0, 1)),
    "chat result order": (CHAT, lambda d: swap(chat_m(d), 3, 4)),
    "chat result for another call": (CHAT, lambda d: chat_m(d)[3].update(tool_call_id="call_b")),
    "chat reasoning": (CHAT, lambda d: chat_m(d)[2].update(reasoning_content="One call.")),
    "chat reasoning dropped": (CHAT, lambda d: chat_m(d)[2].pop("reasoning_content")),
    "chat text split in two parts (not known to be equal)": (CHAT, lambda d: chat_m(d)[1].update(content=[
        {"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": " and Oslo?"}])),
    "anthropic thinking": (ANTHROPIC, lambda d: anthropic_blocks(d)[0].update(thinking="Look it up!")),
    "anthropic signature": (ANTHROPIC, lambda d: anthropic_blocks(d)[0].update(signature="c2lnLTI=")),
    "anthropic thinking dropped": (ANTHROPIC, lambda d: anthropic_blocks(d).pop(0)),
    "anthropic redacted thinking": (ANTHROPIC, lambda d: anthropic_blocks(d)[1].update(data="b3BhcXVm")),
    "anthropic tool use id": (ANTHROPIC, lambda d: anthropic_blocks(d)[3].update(id="toolu_z")),
    "anthropic input value": (ANTHROPIC, lambda d: anthropic_blocks(d)[3].update(input={"city": "Paris", "days": 2})),
    "anthropic block order": (ANTHROPIC, lambda d: swap(anthropic_blocks(d), 2, 3)),
    "anthropic role": (ANTHROPIC, lambda d: d["messages"][0].update(role="assistant")),
    "anthropic error result": (ANTHROPIC, lambda d: d["messages"][2]["content"][0].update(is_error=True)),
    "gemini text": (GEMINI, lambda d: model_parts(d)[1].update(text="Checking!")),
    "gemini thought vs answer text": (GEMINI, lambda d: model_parts(d)[0].pop("thought")),
    "gemini function name": (GEMINI, lambda d: model_parts(d)[2]["functionCall"].update(name="get_forecast")),
    "gemini args": (GEMINI, lambda d: model_parts(d)[2]["functionCall"].update(args={"city": "Paris", "days": 2})),
    "gemini call id": (GEMINI, lambda d: model_parts(d)[2]["functionCall"].update(id="fc_1")),
    "gemini signature bytes": (GEMINI, lambda d: model_parts(d)[2].update(thoughtSignature="+/+/AHNpZg==")),
    "gemini signature dropped": (GEMINI, lambda d: model_parts(d)[2].pop("thoughtSignature")),
    "gemini part order": (GEMINI, lambda d: swap(model_parts(d), 1, 2)),
    "gemini role": (GEMINI, lambda d: d["contents"][1].update(role="user")),
    "gemini signature moved to the text": (GEMINI, lambda d: model_parts(d)[1].update(
        thoughtSignature=model_parts(d)[2].pop("thoughtSignature"))),
    "responses encrypted reasoning": (RESPONSES, lambda d: d["input"][1].update(encrypted_content="gAAAA-2")),
    "responses call id": (RESPONSES, lambda d: d["input"][2].update(call_id="call_z")),
    "responses item order": (RESPONSES, lambda d: swap(d["input"], 1, 2)),
}


@pytest.mark.parametrize("name", MEANINGFUL)
def test_a_change_the_model_sees_changes_the_normal_form(name):
    case, edit = MEANINGFUL[name]
    before, after = changed(case, edit)
    assert not same(before, after)


def split_model_turn(doc: dict) -> None:
    """google-genai's chat sends a streamed answer as one content per chunk."""
    text = model_parts(doc)[1]["text"]
    parts = model_parts(doc)
    doc["contents"][1:2] = [
        {"role": "model", "parts": [parts[0]]},
        {"role": "model", "parts": [{"text": text[:4]}]},
        {"role": "model", "parts": [{"text": text[4:]}]},
        {"role": "model", "parts": [parts[2]]},
    ]


def add_stream_helper_fields(doc: dict) -> None:
    tool_calls(doc)[0]["index"] = 0
    tool_calls(doc)[0]["function"]["parsed_arguments"] = {"city": "Paris", "days": 1}
    chat_m(doc)[2]["parsed"] = None


def snake_case_result(doc: dict) -> None:
    """google-genai's model_dump() field names, with its nulls."""
    doc["contents"][2] = {"role": "user", "parts": [
        {"function_response": {"name": "get_weather", "response": {"result": "sunny"}, "id": None}, "inline_data": None}]}


MEANINGLESS = {
    "chat string vs one text part": (CHAT, lambda d: chat_m(d)[1].update(
        content=[{"type": "text", "text": chat_m(d)[1]["content"]}])),
    "chat nulls and annotations": (CHAT, lambda d: chat_m(d)[2].update(refusal=None, audio=None, annotations=[], parsed=None)),
    "chat stream helper's index and parses": (CHAT, add_stream_helper_fields),
    "chat argument whitespace and key order": (CHAT, lambda d: tool_calls(d)[0]["function"].update(
        arguments="{\"days\":1,\"city\":\"Paris\"}")),
    "anthropic string vs text block": (ANTHROPIC, lambda d: d["messages"][0].update(
        content=[{"type": "text", "text": "Weather?"}])),
    "anthropic dump nulls": (ANTHROPIC, lambda d: anthropic_blocks(d)[3].update(caller=None, toolset_name=None)),
    "anthropic cache control": (ANTHROPIC, lambda d: d["messages"][2]["content"][0].update(
        cache_control={"type": "ephemeral"})),
    "anthropic result string vs text block": (ANTHROPIC, lambda d: d["messages"][2]["content"][0].update(
        content=[{"type": "text", "text": "sunny"}])),
    "gemini url-safe signature": (GEMINI, lambda d: model_parts(d)[2].update(thoughtSignature="-_-_AHNpZw==")),
    "gemini snake case and nulls": (GEMINI, snake_case_result),
    "gemini one content per chunk": (GEMINI, split_model_turn),
    "responses dump nulls and ids": (RESPONSES, lambda d: d["input"][2].update(status="completed", namespace=None)),
}


@pytest.mark.parametrize("name", MEANINGLESS)
def test_a_change_the_model_cannot_see_keeps_the_normal_form(name):
    case, edit = MEANINGLESS[name]
    before, after = changed(case, edit)
    assert same(before, after)


def test_an_assistants_empty_content_is_no_content():
    """A streamed tool-call turn accumulates content "" in openai-python;
    langchain echoes it as null."""
    protocol, url, doc = CHAT
    calls = doc["messages"][2]["tool_calls"]
    empty, null = ({"model": "m", "messages": [{"role": "assistant", "content": c, "tool_calls": calls}]} for c in ("", None))
    assert same(*(lift(protocol, url, json.dumps(doc).encode()).messages for doc in (empty, null)))
    user = {"model": "m", "messages": [{"role": "user", "content": ""}]}
    assert lift(protocol, url, json.dumps(user).encode()).messages == [
        {"role": "user", "content": [{"type": "text", "text": ""}]}]
