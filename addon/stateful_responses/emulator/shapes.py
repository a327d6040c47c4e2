"""The API's objects as OpenAI's API writes them: the response object with
every field it echoes, function tools as echoed, and input items as the API
stores and lists them (typed, with ids)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from . import errors

# The prefixes OpenAI's ids carry; an input item the client sent without an id
# gets one when the API stores it (``fco`` is the convention clients copy).
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                  "custom_tool_call": "ctc", "custom_tool_call_output": "ctco", "compaction": "cmp"}
ITEMS_WITH_STATUS = frozenset({"message", "function_call", "function_call_output"})
SERVICE_TIERS = frozenset({"default", "flex", "priority", "scale"})  # a request's "auto" is answered "default"
LIST_ORDERS = ("asc", "desc")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _given(body: dict, key: str, default: Any) -> Any:
    """The API treats an explicit null like an absent field."""
    value = body.get(key)
    return default if value is None else value


def response_object(body: dict, *, response_id: str, created_at: int, status: str, output: list,
                    previous: Any, usage: dict | None, store: bool | None, conversation: str | None = None) -> dict:
    """The response object for ``body`` in ``status``. ``store=None`` leaves the
    ``store`` field out, as servers that do not echo it do. A response made in
    a conversation names it (``{"id": …}``); any other has no such field."""
    service_tier = body.get("service_tier")
    response = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": body.get("background") is True,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": {"code": "server_error", "message": "The model failed to answer."} if status == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": _given(body, "parallel_tool_calls", True),
        "presence_penalty": _given(body, "presence_penalty", 0.0),
        "frequency_penalty": _given(body, "frequency_penalty", 0.0),
        "previous_response_id": previous,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": echoed_reasoning(body.get("reasoning")),
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": service_tier if service_tier in SERVICE_TIERS else "default",
        "temperature": _given(body, "temperature", 1.0),
        "text": echoed_text(body.get("text")),
        "tool_choice": _given(body, "tool_choice", "auto"),
        "tools": echoed_tools(body.get("tools")),
        "top_logprobs": _given(body, "top_logprobs", 0),
        "top_p": _given(body, "top_p", 1.0),
        "truncation": _given(body, "truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
    if store is not None:
        response["store"] = store
    if conversation is not None:
        response["conversation"] = {"id": conversation}
    return response


def echoed_reasoning(reasoning: Any) -> dict:
    """A reasoning request is echoed with its effort ("medium" unless given)."""
    if not isinstance(reasoning, dict):
        return {"effort": None, "summary": None}
    return {"effort": reasoning.get("effort") or "medium", "summary": reasoning.get("summary")}


def echoed_text(text: Any) -> dict:
    text = text if isinstance(text, dict) else {}
    return {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity") or "medium"}


def echoed_tools(tools: Any) -> list:
    """Function tools come back with every field: ``description`` and
    ``parameters`` null when not given, and ``strict`` true when not given (the
    Responses API defaults to strict mode)."""
    echoed = []
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and tool.get("type") == "function":
            tool = {**tool, "description": tool.get("description"), "parameters": tool.get("parameters"),
                    "strict": _given(tool, "strict", True)}
        echoed.append(tool)
    return echoed


def is_item_reference(item: dict) -> bool:
    """``{"type": "item_reference", "id": …}``, or, as the API and the openai SDK
    allow, an item with an ``id`` and no ``type`` (a message without a type has a ``role``)."""
    if item.get("type") == "item_reference":
        return True
    return item.get("type") is None and "id" in item and "role" not in item


def reads_stored_reasoning(item: dict) -> bool:
    """A reasoning item the API completes from storage: it has an id and no encrypted content."""
    return (item.get("type") == "reasoning" and isinstance(item.get("id"), str) and bool(item["id"])
            and not item.get("encrypted_content"))


def page_parameters(query: dict[str, str]) -> tuple[int, str]:
    """A list endpoint's ``limit`` (1–100, default 20) and ``order`` (default
    ``desc``), refused as the API refuses them."""
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise errors.invalid_limit(limit_text)
    order = query.get("order", "desc")
    if order not in LIST_ORDERS:
        raise errors.invalid_order(order)
    return int(limit_text), order


def item_list(page: list, has_more: bool) -> dict:
    """The API's list envelope; an empty page has null ids."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def listed_item(item: dict) -> dict:
    """An input item as the API stores and lists it: typed, with an id, an easy
    message's text as one content part, and a status."""
    kind = item.get("type") or "message"
    listed = {"id": item.get("id") or new_id(ITEM_ID_PREFIX.get(kind, "item")), "type": kind}
    listed.update((key, value) for key, value in item.items() if key not in ("id", "type"))
    if kind == "message" and isinstance(item.get("content"), str):
        if item.get("role") == "assistant":
            listed["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
        else:
            listed["content"] = [{"type": "input_text", "text": item["content"]}]
    if kind in ITEMS_WITH_STATUS and listed.get("status") is None:
        listed["status"] = "completed"
    return listed
