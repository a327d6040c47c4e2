"""Compaction made by the proxy, for upstreams without it (pure: no mitmproxy).

Where an upstream lacks compaction, the proxy answers ``/responses/compact``
and Codex's ``compaction_trigger`` in the API's shapes. The summary comes from
a normal Responses request to the upstream's own model (``SUMMARY_INSTRUCTION``
as the last user message) and travels back inside the ``compaction`` item's
``encrypted_content``, sealed for the tenant (``store_emulation.turns.Tenant``:
a key from the store's secret, the credential and the seal key, so no other
tenant and no other proxy opens it). Nothing is stored: the item carries its
summary. When it comes back, the upstream gets the summary as a message in its
place (``substitute``); an item the proxy made but cannot open, or the real
API's opaque one on an upstream that cannot read it, is refused by name.
"""

from __future__ import annotations

import base64
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ..entropy import random_bytes
from ..items import COMPACTION_TYPES, is_compaction, is_compaction_trigger, strict_loads
from ..store_emulation.turns import Tenant

SEALED_PREFIX = "srcmp1."  # the proxy's own items: what follows is sealed for one tenant
_SEAL_CONTEXT = b"stateful-responses 2026-12 compaction item"
SUMMARY_INSTRUCTION = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION. Write a handoff summary of the conversation above for "
    "another model that will continue it without seeing it: the user's goals and constraints, every decision "
    "made, the current state of the work (files, commands, results, errors), what remains to be done and the "
    "next step. Keep names, paths, numbers and identifiers exact. Answer with the summary only."
)
SUMMARY_PREFACE = ("A summary of the conversation so far, written when its context was compacted (the earlier "
                   "messages are not shown):\n\n")


def _sealed_bytes(content: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(content[len(SEALED_PREFIX):].encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        return None


def seal(tenant: Tenant, summary: str) -> str:
    """The ``encrypted_content`` of a compaction item the proxy made."""
    plain = json.dumps({"summary": summary}).encode()
    return SEALED_PREFIX + base64.urlsafe_b64encode(tenant.seal(plain, _SEAL_CONTEXT)).decode("ascii")


def open_sealed(tenant: Tenant, content: str) -> str | None:
    """The summary a proxy-made item holds, or None: another tenant's, another
    proxy's key, or not such an item."""
    sealed = _sealed_bytes(content) if content.startswith(SEALED_PREFIX) else None
    plain = tenant.open(sealed, _SEAL_CONTEXT) if sealed else None
    try:
        summary = json.loads(plain)["summary"] if plain is not None else None
    except (ValueError, KeyError, TypeError):
        return None
    return summary if isinstance(summary, str) else None


def new_id(prefix: str) -> str:
    return f"{prefix}_{random_bytes(16).hex()}"


def compaction_item(encrypted_content: str) -> dict[str, Any]:
    return {"type": "compaction", "id": new_id("cmp"), "encrypted_content": encrypted_content}


def summary_message(summary: str) -> bytes:
    """What the upstream gets in place of a proxy-made compaction item."""
    return json.dumps({"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": SUMMARY_PREFACE + summary}]}).encode()


class ApiError(Exception):
    """A refusal in the API's error shape."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def unreadable(index: int) -> ApiError:
    return ApiError(400, f"The compaction item at input[{index}] was made by this proxy for another tenant, or "
                    "under another key, and cannot be read: send the history it replaced, or compact again.",
                    f"input[{index}]", "invalid_encrypted_content")


def foreign(index: int) -> ApiError:
    return ApiError(400, f"The compaction item at input[{index}] was made by another server (its encrypted "
                    "content is readable only there), and this upstream does not support compaction items: "
                    "send the history it replaced, or compact it through this proxy.", f"input[{index}]",
                    "unsupported_compaction_item")


def context_management_refused(threshold: int, estimated: int) -> ApiError:
    return ApiError(400, f"context_management asks for a compaction past {threshold} tokens and this request's "
                    f"input is about {estimated} tokens, but the upstream does not support server-side compaction: "
                    "compact with POST /v1/responses/compact (which this proxy provides) and send its output as "
                    "the input.", "context_management", "unsupported_context_management")


@dataclass
class Substituted:
    items: list[bytes]  # the input the upstream gets
    replaced: int  # proxy-made items replaced by their summaries
    foreign: list[int]  # positions of items the proxy did not make (the real API's)


class _Compaction(msgspec.Struct):
    encrypted_content: Any = None


_COMPACTION = msgspec.json.Decoder(_Compaction)


def substitute(raw_items: list[bytes], tenant: Tenant) -> Substituted:
    """Each proxy-made compaction item replaced by its summary as a message;
    ApiError (``unreadable``) for one the proxy made but cannot open."""
    items, replaced, others = list(raw_items), 0, []
    for index, raw in enumerate(raw_items):
        if not is_compaction(raw):
            continue
        content = _COMPACTION.decode(raw).encrypted_content
        if not isinstance(content, str) or not content.startswith(SEALED_PREFIX):
            others.append(index)
            continue
        summary = open_sealed(tenant, content)
        if summary is None:
            raise unreadable(index)
        items[index] = summary_message(summary)
        replaced += 1
    return Substituted(items, replaced, others)


def summary_request(model: str, items: list[bytes], previous_response_id: str | None = None) -> bytes:
    """A normal Responses request for the summary of ``items`` (every trigger
    left out), to the upstream's own model; stored nowhere. A chain the proxy
    does not keep (``previous_response_id``) is the upstream's to expand."""
    content = [raw for raw in items if not is_compaction_trigger(raw)]
    ask = json.dumps({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": SUMMARY_INSTRUCTION}]}).encode()
    chain = b"" if previous_response_id is None else \
        b',"previous_response_id":' + json.dumps(previous_response_id).encode()
    return (b'{"model":' + json.dumps(model).encode() + b',"store":false' + chain + b',"input":['
            + b",".join(content + [ask]) + b"]}")


def summary_of(answer: Any) -> str | None:
    """The summary text of the upstream's answer (its assistant messages' text), or None."""
    if not isinstance(answer, dict) or answer.get("status") not in (None, "completed"):
        return None
    texts = [part.get("text") for item in answer.get("output") or [] if isinstance(item, dict)
             and item.get("type", "message") == "message" for part in item.get("content") or []
             if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str)]
    text = "\n".join(texts).strip()
    return text or None


def retained_user_messages(raw_items: list[bytes]) -> list[Any]:
    """The user messages of a window, as the API's compact output keeps them (its other items are summarized)."""
    kept = []
    for raw in raw_items:
        if b'"user"' not in raw:
            continue
        item = strict_loads(raw)
        if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message":
            content = item.get("content")
            if isinstance(content, str):
                content = [{"type": "input_text", "text": content}]
            kept.append({"type": "message", "role": "user", "content": content})  # as the API lists it
    return kept


def compacted_response(retained: list[Any], item: dict, usage: Any) -> dict[str, Any]:
    """The API's ``CompactedResponse``: the retained user messages, then one compaction item."""
    return {"id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
            "output": [*retained, item], "usage": usage if isinstance(usage, dict) else _NO_USAGE}


# What a compaction cost, when the summary's answer did not say (the API's CompactedResponse always has it).
_NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def trigger_response(model: str, item: dict, usage: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The response to a compaction trigger: one compaction item, completed."""
    now = int(time.time())
    return {"id": new_id("resp"), "object": "response", "created_at": now, "completed_at": now,
            "status": "completed", "error": None, "incomplete_details": None, "model": model,
            "output": [item], "parallel_tool_calls": fields.get("parallel_tool_calls", True),
            "previous_response_id": None, "store": False, "tools": fields.get("tools") or [],
            "usage": usage if isinstance(usage, dict) else None, "metadata": {}}


def trigger_events(response: dict[str, Any]) -> bytes:
    """The stream Codex reads for a trigger: created, in progress, the one
    compaction item added and done, completed."""
    item = response["output"][0]
    opening = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    events = [
        {"type": "response.created", "response": opening},
        {"type": "response.in_progress", "response": opening},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response},
    ]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n".encode()
                    for n, e in enumerate(events))


def compact_threshold(value: Any) -> int | None:
    """The threshold a request's ``context_management`` sets for compaction, if any."""
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("type") == "compaction" \
                    and isinstance(entry.get("compact_threshold"), int):
                return entry["compact_threshold"]
    return None


def estimated_tokens(items: list[bytes]) -> int:
    """About four bytes a token, as the upstream would count the input."""
    return sum(map(len, items)) // 4


# Verdicts: does an upstream have compaction? ------------------------------------------

_REFUSES = re.compile(r"not supported|unsupported|invalid input type|unknown|not recognized|invalid value|"
                      r"does not support|no such|invalid tag|unexpected", re.I)


def endpoint_verdict(status: int, body: bytes) -> bool | None:
    """What an answer to ``POST /responses/compact`` says: True (it has the
    endpoint), False (404/405: it lacks it), None (nothing: a transient
    failure, the request's own error)."""
    if status in (404, 405):
        return False
    if status < 300:
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return True if isinstance(answer, dict) and isinstance(answer.get("output"), list) else None
    return None


def refuses_compaction(status: int, body: bytes) -> bool:
    """A 4xx that refuses compaction items or a trigger as unknown (the
    API's own "must be the final input item" says it knows them)."""
    if not 400 <= status < 500 or status in (408, 409, 425, 429):
        return False
    text = body.decode("utf-8", "replace")
    lowered = text.lower()
    return ("compaction" in lowered and "must be the final" not in lowered
            and "could not be verified" not in lowered and _REFUSES.search(text) is not None)


def has_compaction_item(answer: Any) -> bool | None:
    """Whether a completed answer holds a compaction item (None: no completed answer to judge)."""
    if not isinstance(answer, dict) or answer.get("status") != "completed":
        return None
    return any(isinstance(i, dict) and i.get("type") in COMPACTION_TYPES for i in answer.get("output") or [])
