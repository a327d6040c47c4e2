"""Item identity: when two Responses API items are the same conversation content.

The addon compares what a client resends with what the upstream stored. Clients
re-shape upstream items without changing their meaning (FACTS.md, "What real
clients send"), so items are compared in a normal form. Normalizing only affects
comparison: the items sent upstream are always the client's own.

Equivalences, each chosen because the upstream's stored form is at least as
faithful as the client's re-shaped echo:

* volatile keys (``id``, ``status``, ``created_at``, ``completed_at``,
  ``annotations``, ``logprobs``, ``obfuscation``) are bookkeeping the upstream
  regenerates; they never reach the model as content.
* keys whose value is null: ``model_dump()`` adds them, the API treats a null
  field as absent.
* an "easy" message ``{"role": r, "content": "text"}`` is the typed message
  with one text part (``output_text`` for the assistant, ``input_text``
  otherwise): the API expands it exactly so.
* function-call ``arguments`` that are valid JSON compare as parsed JSON, so
  whitespace and key order do not matter; another value still differs (an int
  ``1`` and a float ``1.0`` differ too, on purpose).

Anything else, including ``phase``, roles, text, reasoning items and their
``encrypted_content``, must match exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from blake3 import blake3

VOLATILE_KEYS = frozenset(
    {"id", "status", "created_at", "completed_at", "annotations", "logprobs", "obfuscation"}
)
ITEM_DIGEST_SIZE = 16
SEQUENCE_DIGEST_SIZE = 32


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _strip(v)
            for k, v in value.items()
            if v is not None and k not in VOLATILE_KEYS
        }
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def normalize_item(item: Any) -> Any:
    """The comparison form of one input or output item."""
    if not isinstance(item, dict):
        return {"$non_object": item}
    kind = item.get("type")
    if kind == "item_reference":
        # The referenced id *is* the content of a reference.
        return {"type": "item_reference", "id": item.get("id")}
    out = _strip(item)
    if kind in (None, "message") and "role" in out:
        out["type"] = "message"
        content = out.get("content")
        if isinstance(content, str):
            part = "output_text" if out["role"] == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": content}]
    elif kind == "function_call" and isinstance(out.get("arguments"), str):
        try:
            out["arguments"] = {"$json": json.loads(out["arguments"])}
        except ValueError:
            pass
    return out


def canonical_json(value: Any) -> bytes:
    """Deterministic bytes for a JSON value: sorted keys, no whitespace."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True
    ).encode("ascii")


def item_digest(item: Any) -> bytes:
    return blake3(canonical_json(normalize_item(item))).digest(ITEM_DIGEST_SIZE)


class ItemSequence:
    """Rolling digests of an item sequence under a namespace root.

    ``digests[k - 1]`` names the first k items: blake3 over the root and the
    fixed-size item digests, read off one incremental hasher. One digest names
    a whole sequence, so the prefix store keeps one small entry per stored
    response instead of one per item, and the state can be extended later by
    the answer's output items.
    """

    def __init__(self, root: bytes, digests: Iterable[bytes] = ()) -> None:
        self._hasher = blake3(root)
        self.digests: list[bytes] = []
        self.extend(digests)

    def extend(self, digests: Iterable[bytes]) -> None:
        update, digest, out = self._hasher.update, self._hasher.digest, self.digests.append
        for d in digests:
            update(d)
            out(digest(SEQUENCE_DIGEST_SIZE))

    def extended(self, digests: Iterable[bytes]) -> ItemSequence:
        """A copy with more items; this one is unchanged."""
        other = ItemSequence.__new__(ItemSequence)
        other._hasher = self._hasher.copy()
        other.digests = list(self.digests)
        other.extend(digests)
        return other


def as_item_list(value: Any) -> list | None:
    """The request's ``input`` as a list of items, or None when it is neither
    a list nor a string. A string is one user message (the API's own rule)."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return None


class DigestCache:
    """Item digests by the exact raw bytes the client sent.

    An agent loop resends every earlier item byte for byte on every step, so
    recognising those bytes (one dict lookup: hashing and comparing bytes runs
    at memory speed) is far cheaper than parsing, normalizing and hashing them
    again. Keyed by the bytes themselves, so a hit is exact, never probable.

    Two generations bound it: when the current one holds half the byte budget
    it becomes the old one and the previous old one is dropped; a hit in the
    old generation moves the entry to the current one. Cheaper per hit than an
    LRU, and what is still in use survives.
    """

    def __init__(self, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._current: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}
        self._current_bytes = 0

    def __len__(self) -> int:
        return len(self._current) + len(self._old)

    def digests(self, raws: list[bytes]) -> list[bytes]:
        """Digests of JSON object spans; ValueError if one is not an object."""
        get = self._current.get
        found = [get(r) for r in raws]
        for i, d in enumerate(found):
            if d is None:
                found[i] = self._miss(raws[i])
        return found

    def _miss(self, raw: bytes) -> bytes:
        digest = self._old.pop(raw, None)
        if digest is None:
            if raw[:1] != b"{":
                raise ValueError("an item is not a JSON object")
            digest = item_digest(json.loads(raw))
        if len(raw) <= self.max_bytes // 4:
            if self._current_bytes + len(raw) > self.max_bytes // 2:
                self._old, self._current, self._current_bytes = self._current, {}, 0
            self._current[raw] = digest
            self._current_bytes += len(raw)
        return digest
