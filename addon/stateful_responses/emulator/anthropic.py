"""Anthropic Messages, ``POST /v1/messages``: a ``message`` as JSON, or with
``stream: true`` the event stream ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` …, ``content_block_stop``, ``message_delta``,
``message_stop``. Shapes follow Anthropic's API reference and
anthropic-sdk-python's ``types`` (docs/emulator.md names the sources).

The system prompt is top-level ``system``; the log's ``context`` puts it first,
as ``{"role": "system", "content": system}``, before the messages.
"""

from __future__ import annotations

import json

from .stateless_apis import Call, Conversation, Turn, fragments, joined_text, positive_int, random_id, words
from .errors import APIError

STOP_REASONS = {"tool_call": "tool_use", "max_tokens": "max_tokens", "stop": "end_turn"}
# Anthropic's error types by status, and their wording where the API's is known.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
ERROR_MESSAGES = {"api_error": "Internal server error", "overloaded_error": "Overloaded",
                  "rate_limit_error": "Rate limit exceeded", "timeout_error": "Request timed out"}


def error(status: int, message: str | None = None) -> APIError:
    """``{"type": "error", "error": {"type", "message"}, "request_id"}``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = message or ERROR_MESSAGES.get(kind, kind.replace("_", " ").capitalize())
    return APIError(status, message, body={"type": "error", "error": {"type": kind, "message": message},
                                           "request_id": "req_011C" + random_id(20)})


def invalid(message: str) -> APIError:
    return error(400, message)


class Messages:
    name = "anthropic-messages"

    def credential(self, call: Call) -> str:
        """``x-api-key``, or ``Authorization: Bearer`` (the API takes OAuth tokens there)."""
        return call.headers.get("x-api-key") or call.headers.get("authorization") or ""

    def missing_credential(self) -> APIError:
        return error(401, "x-api-key header is required")

    def error(self, status: int) -> APIError:
        return error(status)

    def read(self, call: Call) -> Conversation:
        if "anthropic-version" not in call.headers:
            raise invalid("anthropic-version: header is required")
        body = call.body
        if not isinstance(body, dict):
            raise invalid("There was an issue with your request body: it is not valid JSON.")
        for required in ("model", "max_tokens", "messages"):
            if required not in body:
                raise invalid(f"{required}: Field required")
        model, messages = body["model"], body["messages"]
        if not isinstance(model, str):
            raise invalid("model: Input should be a valid string")
        if positive_int(body["max_tokens"]) is None:
            raise invalid("max_tokens: Input should be a valid integer greater than or equal to 1")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise invalid("messages: Input should be a valid list")
        if not messages:
            raise invalid("messages: at least one message is required")
        system = body.get("system")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        functions = frozenset(t["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)
                              and t.get("type", "custom") == "custom")  # typed tools are the server's own
        newest = messages[-1]
        return Conversation(
            model=model, stream=body.get("stream") is True,
            context=([{"role": "system", "content": system}] if system is not None else []) + messages,
            system=system, functions=functions,
            user_text=joined_text(newest.get("content")) if newest.get("role") == "user" else None,
            max_tokens=body["max_tokens"], body=body, query=call.query)

    def answer(self, conversation: Conversation, turn: Turn) -> dict:
        if turn.call:
            block = {"type": "tool_use", "id": "toolu_01" + random_id(22), "name": turn.call.name,
                     "input": turn.call.arguments}
        else:
            block = {"type": "text", "text": turn.text}
        return {
            "id": "msg_01" + random_id(22), "type": "message", "role": "assistant", "model": conversation.model,
            "content": [block], "stop_reason": STOP_REASONS[turn.ending], "stop_sequence": None,
            "usage": {"input_tokens": turn.input_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": turn.output_tokens, "service_tier": "standard"},
        }

    def answer_id(self, answer: dict) -> str:
        return answer["id"]

    def output(self, answer: dict) -> list:
        return [{"role": answer["role"], "content": answer["content"]}]

    def stream(self, conversation: Conversation, answer: dict) -> tuple[str, list[bytes]]:
        """The message opened empty; each block opened empty, filled by deltas
        (text a word at a time, tool input as ``partial_json`` fragments) and
        closed; a ``ping`` after the first block opens, as the API's examples
        show; then the stop reason and output tokens, and the end."""
        opening = {**answer, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**answer["usage"], "output_tokens": 1}}
        events: list[dict] = [{"type": "message_start", "message": opening}]
        for index, block in enumerate(answer["content"]):
            at = {"index": index}
            if block["type"] == "text":
                empty = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": word} for word in words(block["text"])]
            else:
                empty = {**block, "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": fragment}
                          for fragment in ["", *fragments(json.dumps(block["input"]))]]
            events.append({"type": "content_block_start", **at, "content_block": empty})
            if index == 0:
                events.append({"type": "ping"})
            events += [{"type": "content_block_delta", **at, "delta": delta} for delta in deltas]
            events.append({"type": "content_block_stop", **at})
        events.append({"type": "message_delta", "delta": {"stop_reason": answer["stop_reason"], "stop_sequence": None},
                       "usage": {"output_tokens": answer["usage"]["output_tokens"]}})
        events.append({"type": "message_stop"})
        frames = [f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode() for event in events]
        return "text/event-stream; charset=utf-8", frames
