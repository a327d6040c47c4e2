"""Gemini, ``POST /v1beta/models/{model}:generateContent`` and
``:streamGenerateContent``: a ``GenerateContentResponse`` as JSON, or streamed
as chunks of it (an SSE stream with ``?alt=sse``, as google-genai asks for,
else one JSON array sent piece by piece). Shapes follow the Gemini API
reference and googleapis/python-genai (docs/emulator.md names the sources).

The system prompt is top-level ``systemInstruction``, outside ``contents``. The
API reads protobuf JSON, which takes field names in lowerCamel or snake_case,
so both spellings are read here.
"""

from __future__ import annotations

import json
from typing import Any

from .stateless_apis import Call, Conversation, Turn, positive_int, random_id, words
from .errors import APIError

FINISH_REASONS = {"tool_call": "STOP", "max_tokens": "MAX_TOKENS", "stop": "STOP"}
ROLES = ("user", "model")
STATUSES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
MESSAGES = {
    429: "Resource has been exhausted (e.g. check quota).",
    500: "An internal error has occurred. Please retry or report in"
         " https://developers.generativeai.google/guide/troubleshooting",
    503: "The model is overloaded. Please try again later.",
    504: "Deadline expired before operation could complete.",
}


def error(status: int, message: str | None = None) -> APIError:
    """``{"error": {"code", "message", "status"}}``, Google's error shape."""
    message = message or MESSAGES.get(status, f"HTTP {status}")
    name = STATUSES.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return APIError(status, message, body={"error": {"code": status, "message": message, "status": name}})


def camel_or_snake(value: dict, camel: str, snake: str) -> Any:
    """A field under either of the names protobuf JSON accepts for it."""
    return value.get(camel, value.get(snake))


class GenerateContent:
    name = "gemini-chat"

    def credential(self, call: Call) -> str:
        return call.headers.get("x-goog-api-key") or call.query.get("key") or ""

    def missing_credential(self) -> APIError:
        return error(403, "Method doesn't allow unregistered callers (callers without established identity)."
                          " Please use API Key or other form of API consumer identity to call this API.")

    def error(self, status: int) -> APIError:
        return error(status)

    def read(self, call: Call) -> Conversation:
        body = call.body
        if not isinstance(body, dict):
            raise error(400, "Invalid JSON payload received. Unexpected token.")
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            raise error(400, "* GenerateContentRequest.contents: contents is not specified\n")
        if not all(isinstance(c, dict) and c.get("role", "user") in ROLES for c in contents):
            raise error(400, "Please use a valid role: user, model.")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        declared = [d for tool in tools if isinstance(tool, dict)
                    for d in camel_or_snake(tool, "functionDeclarations", "function_declarations") or []
                    if isinstance(d, dict)]
        functions = frozenset(d["name"] for d in declared if isinstance(d.get("name"), str))
        config = camel_or_snake(body, "generationConfig", "generation_config")
        limit = camel_or_snake(config, "maxOutputTokens", "max_output_tokens") if isinstance(config, dict) else None
        newest = contents[-1]
        parts = newest.get("parts") if isinstance(newest.get("parts"), list) else []
        user_text = " ".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        return Conversation(
            model=call.path["model"], stream=call.path["method"] == "streamGenerateContent", context=contents,
            system=camel_or_snake(body, "systemInstruction", "system_instruction"), functions=functions,
            user_text=user_text if newest.get("role", "user") == "user" else None,
            max_tokens=positive_int(limit), body=body, query=call.query)

    def answer(self, conversation: Conversation, turn: Turn) -> dict:
        if turn.call:
            part: dict = {"functionCall": {"id": random_id(8).lower(), "name": turn.call.name,
                                           "args": turn.call.arguments}}
        else:
            part = {"text": turn.text}
        return {
            "candidates": [{"content": {"parts": [part], "role": "model"},
                            "finishReason": FINISH_REASONS[turn.ending], "index": 0}],
            "usageMetadata": {
                "promptTokenCount": turn.input_tokens, "candidatesTokenCount": turn.output_tokens,
                "totalTokenCount": turn.input_tokens + turn.output_tokens,
                "promptTokensDetails": [{"modality": "TEXT", "tokenCount": turn.input_tokens}],
            },
            "modelVersion": conversation.model,
            "responseId": random_id(22),
        }

    def answer_id(self, answer: dict) -> str:
        return answer["responseId"]

    def output(self, answer: dict) -> list:
        return [answer["candidates"][0]["content"]]

    def stream(self, conversation: Conversation, answer: dict) -> tuple[str, list[bytes]]:
        """Chunks of the answer: text a word a chunk (a function call whole),
        each with the prompt's usage; the last one adds the finish reason and
        the full usage."""
        candidate = answer["candidates"][0]
        part = candidate["content"]["parts"][0]
        pieces = [{"text": word} for word in words(part["text"])] if "text" in part else [part]
        usage = answer["usageMetadata"]
        prompt_usage = {"promptTokenCount": usage["promptTokenCount"], "totalTokenCount": usage["promptTokenCount"],
                        "promptTokensDetails": usage["promptTokensDetails"]}
        chunks = [{"candidates": [{"content": {"parts": [piece], "role": "model"}, "index": 0}],
                   "usageMetadata": prompt_usage, "modelVersion": answer["modelVersion"],
                   "responseId": answer["responseId"]} for piece in pieces]
        chunks[-1]["candidates"][0]["finishReason"] = candidate["finishReason"]
        chunks[-1]["usageMetadata"] = usage
        encoded = [json.dumps(chunk) for chunk in chunks]
        if conversation.query.get("alt") == "sse":
            return "text/event-stream", [f"data: {chunk}\r\n\r\n".encode() for chunk in encoded]
        array = ["[" + encoded[0]] + [",\r\n" + chunk for chunk in encoded[1:]]
        array[-1] += "]"
        return "application/json; charset=UTF-8", [piece.encode() for piece in array]
