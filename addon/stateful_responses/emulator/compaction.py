"""Compaction as OpenAI's API does it (the ``compaction`` fault turns it off,
as on servers without it).

* ``POST /v1/responses/compact``: a ``CompactedResponse`` (``object:
  "response.compaction"``) whose output is every user message of the window,
  then one ``compaction`` item (openai-python's ``compacted_response.py``).
* A ``compaction_trigger`` input item (Codex's remote compaction v2) must be
  the final input item; the response's output is one ``compaction`` item.
* ``context_management: [{"type": "compaction", "compact_threshold": N}]``:
  once the context passes N tokens, a ``compaction`` item comes first in the
  output, before the reply.

A ``compaction`` item's ``encrypted_content`` is opaque and readable only by
the server that made it: here, an HMAC-signed blob bound to the credential
(another credential's, or another server's, is refused as the API refuses
encrypted content it cannot verify). The legacy name ``compaction_summary``
is read as the same item.

Without compaction (``{"compaction": "absent"}``, ``"not_allowed"``,
``"ignore"``): the endpoint answers 404 (405 ``not_allowed``, as FastAPI
answers a path it routes for other methods); a ``compaction`` item is refused
("item type 'compaction' is not supported", as third-party servers answer);
a trigger is refused as an unknown input type, or with ``ignore`` silently
dropped (the request answered without a compaction item, as gateways that do
not know it do); ``context_management`` is ignored.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from typing import Any

from .errors import APIError
from .shapes import new_id

COMPACTION_TYPES = ("compaction", "compaction_summary")
TRIGGER = "compaction_trigger"
_KEY = os.urandom(32)  # this server's: an item made by another server (another process) does not verify


def compaction_item(credential: str, context: list) -> dict:
    """An opaque compaction item over ``context``, readable by this server for this credential only."""
    payload = json.dumps({"items": len(context), "digest": hashlib.sha256(
        json.dumps(context, sort_keys=True).encode()).hexdigest()[:16]}).encode()
    tag = hmac.new(_KEY, credential.encode() + b"\x00" + payload, hashlib.sha256).digest()
    return {"type": "compaction", "id": new_id("cmp"),
            "encrypted_content": "gAAAAA" + base64.urlsafe_b64encode(tag + payload).decode()}


def verify(credential: str, item: dict) -> None:
    """Refuse a compaction item this server did not make for this credential."""
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith("gAAAAA"):
        raise _unverifiable()
    try:
        raw = base64.urlsafe_b64decode(content[6:].encode())
    except (ValueError, TypeError):
        raise _unverifiable() from None
    tag, payload = raw[:32], raw[32:]
    if not hmac.compare_digest(tag, hmac.new(_KEY, credential.encode() + b"\x00" + payload,
                                             hashlib.sha256).digest()):
        raise _unverifiable()


def _unverifiable() -> APIError:
    return APIError(400, "The encrypted content for a compaction item could not be verified.",
                    param="input", code="invalid_encrypted_content")


def check_input(items: list, mode: str | None) -> list:
    """The request's input as the model reads it: the trigger checked (last,
    no other keys) and left out; refusals as this server's mode answers them."""
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in COMPACTION_TYPES and mode is not None:
            raise APIError(400, f"Invalid input at index {index}: item type '{kind}' is not supported.",
                           param="input")
        if kind == TRIGGER:
            if mode in ("absent", "not_allowed"):
                raise APIError(400, f"Invalid input type '{TRIGGER}' at index {index}.", param="input")
            if index != len(items) - 1:
                raise APIError(400, f"The '{TRIGGER}' item must be the final input item.", param="input")
            if mode is None and set(item) != {"type"}:
                extra = sorted(set(item) - {"type"})[0]
                raise APIError(400, f"Unknown parameter: 'input[{index}].{extra}'.", param=f"input[{index}].{extra}",
                               code="unknown_parameter")
    return [i for i in items if not (isinstance(i, dict) and i.get("type") == TRIGGER)]


def triggered(items: list) -> bool:
    return bool(items) and isinstance(items[-1], dict) and items[-1].get("type") == TRIGGER


def threshold_passed(body: dict, context_tokens: int) -> bool:
    """Whether ``context_management`` asks for a compaction of a context this large."""
    entries = body.get("context_management")
    if not isinstance(entries, list):
        return False
    for entry in entries:
        if isinstance(entry, dict) and entry.get("type") == "compaction":
            threshold = entry.get("compact_threshold")
            if isinstance(threshold, int) and context_tokens >= threshold:
                return True
    return False


def compacted_response(body: dict, context: list, output_context: list, credential: str,
                       created_at: int, usage: dict) -> dict[str, Any]:
    """The API's ``CompactedResponse``: the window's user messages, then one compaction item."""
    retained = [item for item in output_context
                if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message"]
    return {"id": new_id("resp"), "object": "response.compaction", "created_at": created_at,
            "output": retained + [compaction_item(credential, context)], "usage": usage}
