"""OpenAI Chat Completions, ``POST /v1/chat/completions``: a ``chat.completion``
as JSON, or with ``stream: true`` ``chat.completion.chunk`` events ending in
``data: [DONE]``. Shapes follow openai-python's ``types/chat`` and streams
captured from the live API (docs/emulator.md names the sources).

The system prompt is where the API has it, a ``system`` (or ``developer``)
message in ``messages``; the log's ``system`` lists those messages.
"""

from __future__ import annotations

import hashlib
import json
import time

from . import errors
from .stateless_apis import Call, Conversation, Turn, fragments, joined_text, positive_int, random_id, words
from .errors import APIError
from .sse import obfuscation_padding

SYSTEM_ROLES = ("system", "developer")
FINISH_REASONS = {"tool_call": "tool_calls", "max_tokens": "length", "stop": "stop"}


class ChatCompletions:
    name = "openai-chat"

    def credential(self, call: Call) -> str:
        """As for Responses: ``Authorization``, or Azure's ``api-key``."""
        return call.headers.get("authorization") or call.headers.get("api-key") or ""

    def missing_credential(self) -> APIError:
        return errors.missing_api_key()

    def error(self, status: int) -> APIError:
        return errors.server_error(status)

    def read(self, call: Call) -> Conversation:
        body = call.body
        if not isinstance(body, dict):
            raise errors.unparsable_json()
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "you must provide a model parameter")
        messages = body.get("messages")
        if messages is None:
            raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                           code="missing_required_parameter")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise APIError(400, "Invalid type for 'messages': expected an array of objects.", param="messages",
                           code="invalid_type")
        if not messages:
            raise APIError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an"
                                " empty array instead.", param="messages", code="empty_array")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        declared = [t["function"] for t in tools
                    if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)]
        functions = frozenset(f["name"] for f in declared if isinstance(f.get("name"), str))
        newest = messages[-1]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        return Conversation(
            model=model, stream=body.get("stream") is True, context=messages,
            system=[m for m in messages if m.get("role") in SYSTEM_ROLES] or None, functions=functions,
            user_text=joined_text(newest.get("content")) if newest.get("role") == "user" else None,
            max_tokens=positive_int(limit), body=body, query=call.query)

    def answer(self, conversation: Conversation, turn: Turn) -> dict:
        message: dict = {"role": "assistant", "content": turn.text, "refusal": None, "annotations": []}
        if turn.call:
            message["tool_calls"] = [{"id": "call_" + random_id(24), "type": "function", "function": {
                "name": turn.call.name, "arguments": json.dumps(turn.call.arguments)}}]
        return {
            "id": "chatcmpl-" + random_id(29), "object": "chat.completion", "created": int(time.time()),
            "model": conversation.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": FINISH_REASONS[turn.ending]}],
            "usage": {
                "prompt_tokens": turn.input_tokens, "completion_tokens": turn.output_tokens,
                "total_tokens": turn.input_tokens + turn.output_tokens,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
            },
            "service_tier": "default",
            "system_fingerprint": "fp_" + hashlib.sha256(conversation.model.encode()).hexdigest()[:10],
        }

    def answer_id(self, answer: dict) -> str:
        return answer["id"]

    def output(self, answer: dict) -> list:
        return [answer["choices"][0]["message"]]

    def stream(self, conversation: Conversation, answer: dict) -> tuple[str, list[bytes]]:
        """One chunk per word (or argument fragment), then the finish reason;
        with ``stream_options.include_usage`` every chunk has ``usage: null`` and
        a last chunk with no choices carries the usage. Chunks carry
        ``obfuscation`` unless ``stream_options.include_obfuscation`` is false."""
        options = conversation.body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
                "model": answer["model"], "service_tier": answer["service_tier"],
                "system_fingerprint": answer["system_fingerprint"]}
        choice = answer["choices"][0]
        chunks = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
                  for delta in _deltas(choice["message"])]
        chunks.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                            "finish_reason": choice["finish_reason"]}]})
        if options.get("include_usage") is True:
            for chunk in chunks:
                chunk["usage"] = None
            chunks.append({**head, "choices": [], "usage": answer["usage"]})
        if options.get("include_obfuscation") is not False:
            for chunk in chunks:
                chunk["obfuscation"] = obfuscation_padding(_streamed_text(chunk))
        frames = [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks]
        return "text/event-stream; charset=utf-8", frames + [b"data: [DONE]\n\n"]


def _deltas(message: dict) -> list[dict]:
    """The message as the API streams it: the role first, then the content a
    word at a time, or each tool call opened with its id and name and its
    arguments sent as fragments keyed by the call's index."""
    if not message.get("tool_calls"):
        return [{"role": "assistant", "content": "", "refusal": None}] + [
            {"content": word} for word in words(message["content"])]
    deltas: list[dict] = []
    for index, call in enumerate(message["tool_calls"]):
        opening = {"index": index, "id": call["id"], "type": "function",
                   "function": {"name": call["function"]["name"], "arguments": ""}}
        deltas.append({"role": "assistant", "content": None, "tool_calls": [opening], "refusal": None}
                      if index == 0 else {"tool_calls": [opening]})
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
                   for fragment in fragments(call["function"]["arguments"])]
    return deltas


def _streamed_text(chunk: dict) -> str:
    """The text a chunk streams (content or arguments), which its padding hides the length of."""
    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
    calls = delta.get("tool_calls") or [{}]
    return delta.get("content") or calls[0].get("function", {}).get("arguments", "")
