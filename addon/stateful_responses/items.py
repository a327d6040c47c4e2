"""Item identity: when two Responses API items are the same conversation content.

The addon compares what a client resends with what the upstream stored. Clients
re-shape upstream items without changing their meaning (captured from
openai-agents, langchain, Codex and others), so items are compared in a normal
form. Normalizing only affects comparison: the items sent upstream are always
the client's own.

Equivalences, each chosen because the upstream's stored form is at least as
faithful as the client's re-shaped echo:

* bookkeeping keys the API regenerates and never shows the model, and only
  where they are bookkeeping: an item's own top level, per item type
  (``TOP_LEVEL_BOOKKEEPING``), and a message's content parts
  (``annotations``, ``logprobs``). Deeper, or on item types where the same
  name is content, they are compared like everything else.
* keys whose value is null, in the API's own structures: ``model_dump()`` adds
  them and the API treats a null field as absent. Never inside a JSON schema
  or other client data (``OPAQUE_KEYS``), where a null is a value.
* an "easy" message ``{"role": r, "content": "text"}`` is the typed message
  with one text part (``output_text`` for the assistant, ``input_text``
  otherwise): the API expands it exactly so.
* function-call ``arguments`` that are valid, unambiguous JSON compare as
  parsed JSON, so whitespace and key order do not matter; another value still
  differs (an int ``1`` and a float ``1.0`` differ too, on purpose).

An item with an ``id`` and no type is an item reference (the API and the openai
SDK make ``type`` optional there): equal only to a reference to the same id.

Anything else, including ``phase``, roles, text, reasoning items and their
``id`` and ``encrypted_content``, must match exactly.

Items whose meaning depends on the JSON parser (duplicate keys, lone
surrogates, numbers a parser would round, NaN) are ``Ambiguous``: the addon
never changes a body holding one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from decimal import Decimal
from itertools import accumulate
from typing import Any, overload

import msgspec
from blake3 import blake3

ITEM_DIGEST_SIZE = 16
SEQUENCE_DIGEST_SIZE = 32

# Bookkeeping at an item's top level, per type. A type not listed here (a new
# one, say) keeps every key: comparing more strictly only costs a continuation.
_REGENERATED = frozenset({"id", "status", "created_at", "completed_at"})
TOP_LEVEL_BOOKKEEPING: dict[str | None, frozenset[str]] = {
    "message": _REGENERATED,
    "function_call": _REGENERATED,
    "function_call_output": _REGENERATED,
    "custom_tool_call": _REGENERATED,
    "custom_tool_call_output": _REGENERATED,
    "computer_call": _REGENERATED,
    "computer_call_output": _REGENERATED,
    "local_shell_call": _REGENERATED,
    "shell_call": _REGENERATED,
    "shell_call_output": _REGENERATED,
    "apply_patch_call": _REGENERATED,
    # The id names hidden reasoning the upstream fetches by it.
    "reasoning": _REGENERATED - {"id"},
    # The id links the output to its call.
    "local_shell_call_output": _REGENERATED - {"id"},
    # The status is the tool's result.
    "apply_patch_call_output": _REGENERATED - {"status"},
    "program_output": _REGENERATED - {"status"},
    # The window a compaction summarized is its encrypted content; the id is
    # the upstream's, and ``created_by`` is output only (never an input field).
    "compaction": frozenset({"id", "created_by"}),
    "compaction_summary": frozenset({"id", "created_by"}),
}
# Compaction (docs/compaction.md): an item that stands for every item before it
# in its window (``compaction_summary`` is its legacy name, still read by Codex),
# and Codex's trigger, a control signal that must stay the last input item and
# is never content: never stored, recorded, given an id or replayed.
COMPACTION_TYPES = frozenset({"compaction", "compaction_summary"})
COMPACTION_TRIGGER = "compaction_trigger"
# A message's content parts: citations and token probabilities the upstream
# attached to its own text; clients drop them (langchain) or keep them.
PART_BOOKKEEPING = frozenset({"annotations", "logprobs"})
# Client data inside an item, compared verbatim: a null there is a value.
OPAQUE_KEYS = frozenset({"parameters", "input_schema", "schema", "json_schema", "arguments", "input"})


class Ambiguous(ValueError):
    """Mainstream JSON parsers would not all read these bytes the same way."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise Ambiguous("duplicate key")  # first-wins, last-wins and refusing parsers disagree
    return obj


def _int(literal: str) -> Any:
    # "-0" and "0" are one value to some parsers and two to others.
    return Decimal(literal) if literal == "-0" else int(literal)


def _float(literal: str) -> Decimal:
    # Kept as written, so that 1.50 and 1.5 never merge by accident; refused
    # when parsers that read doubles would round it (1e400, 1.00000000000000000001).
    value = Decimal(literal)
    if Decimal(repr(float(literal))) != value:
        raise Ambiguous("a number that parsers read differently")
    return value


def _constant(literal: str) -> Any:
    raise Ambiguous(f"{literal} is not JSON")


_STRICT = json.JSONDecoder(object_pairs_hook=_pairs, parse_float=_float, parse_int=_int, parse_constant=_constant)


def strict_loads(data: bytes | str) -> Any:
    """JSON read so that equal results mean equal to every mainstream parser:
    duplicate keys, NaN/Infinity and numbers a double would round (``1e400``,
    ``1.00000000000000000001``) refused, numbers otherwise kept as written
    (``-0`` apart from ``0``). Lone surrogates are caught when the value is
    encoded (``canonical_json``). Bytes must be
    UTF-8 (what JSON on the wire is); a BOM is not JSON."""
    return _STRICT.decode(data.decode("utf-8") if isinstance(data, bytes | bytearray) else data)


_CANONICAL = msgspec.json.Encoder(order="sorted", decimal_format="number")


def canonical_json(value: Any) -> bytes:
    """Deterministic bytes for a JSON value: sorted keys, no whitespace,
    numbers as written. Raises Ambiguous for a lone surrogate, which some
    parsers keep, some replace and some refuse."""
    try:
        return _CANONICAL.encode(value)
    except UnicodeEncodeError:
        raise Ambiguous("lone surrogate") from None


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: (v if k in OPAQUE_KEYS else _drop_nulls(v))
            for k, v in value.items()
            if v is not None
        }
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def normalize_item(item: Any, has_nulls: bool = True) -> Any:
    """The comparison form of one input or output item (parsed strictly).
    ``has_nulls=False`` says the item holds no null (its raw bytes hold no
    ``null``): nothing to drop, no need to walk it."""
    if not isinstance(item, dict):
        return {"$non_object": item}
    out = _drop_nulls(item) if has_nulls else dict(item)
    kind = out.get("type")
    if kind == "item_reference" or (kind is None and "id" in out and "role" not in out):
        # The referenced id *is* the content of a reference: nothing is
        # bookkeeping in it, so it equals only a reference to the same id.
        return {**out, "type": "item_reference"}
    if kind is None and "role" in out:
        kind = out["type"] = "message"
    bookkeeping = TOP_LEVEL_BOOKKEEPING.get(kind, frozenset()) if isinstance(kind, str) else frozenset()
    out = {k: v for k, v in out.items() if k not in bookkeeping}
    if kind == "message":
        content = out.get("content")
        if isinstance(content, str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": content}]
        elif isinstance(content, list):
            out["content"] = [
                {k: v for k, v in p.items() if k not in PART_BOOKKEEPING} if isinstance(p, dict) else p
                for p in content
            ]
    elif kind == "function_call" and isinstance(out.get("arguments"), str):
        try:
            out["arguments"] = {"$json": strict_loads(out["arguments"])}
            canonical_json(out["arguments"])
        except ValueError:  # not JSON, or ambiguous JSON: compare the text itself
            pass
    return out


def item_digest(item: Any) -> bytes:
    return _digest(normalize_item(item))


def _raw_normal_form(raw: bytes) -> Any:
    if raw[:1] != b"{":
        raise ValueError("an item is not a JSON object")
    return normalize_item(strict_loads(raw), has_nulls=b"null" in raw)


def unambiguous(raw: bytes) -> bool:
    """Whether every mainstream parser reads this JSON value the same way."""
    try:
        canonical_json(strict_loads(raw))
    except (ValueError, RecursionError):  # Ambiguous, and UTF-8 that is not
        return False
    return True


def _digest(normal: Any) -> bytes:
    return blake3(canonical_json(normal)).digest(ITEM_DIGEST_SIZE)


def raw_item_digest(raw: bytes) -> bytes:
    """The digest of one item's raw JSON (what the item cache keeps);
    Ambiguous when parsers could disagree."""
    return _digest(_raw_normal_form(raw))


class ItemSequence:
    """Rolling digests of an item sequence under a namespace root.

    ``digests[k - 1]`` names the first k items: blake3 over the root and the
    fixed-size item digests of those items. One digest names a whole
    sequence, so the prefix store keeps one small entry per stored response
    instead of one per item, and the state can be extended later by the
    answer's output items.
    """

    def __init__(self, root: bytes, digests: Iterable[bytes] = ()) -> None:
        self.root = root
        self.items = list(digests)
        self.digests = Prefixes(root, self.items)

    def extended(self, digests: Iterable[bytes]) -> ItemSequence:
        """A copy with more items; this one is unchanged."""
        return ItemSequence(self.root, [*self.items, *digests])


class Prefixes(Sequence[bytes]):
    """The prefix digests of a sequence, each computed when first asked for.

    A request is continued from one of its longest prefixes, so the few asked
    for are hashed at once (root and item digests in one call); the first
    question past ``EAGER_AFTER`` computes them all in one incremental pass,
    so asking for every prefix costs no more than computing them up front.
    """

    EAGER_AFTER = 4

    def __init__(self, root: bytes, items: list[bytes]) -> None:
        self._root = root
        self._items = items
        self._joined: bytes | None = None
        self._ends: list[int] = []
        self._asked: dict[int, bytes] = {}
        self._all: list[bytes] | None = None

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice) or self._all is not None:
            return self._every()[index]
        k = index + len(self._items) if index < 0 else index
        if not 0 <= k < len(self._items):
            raise IndexError(index)
        digest = self._asked.get(k)
        if digest is None:
            if len(self._asked) >= self.EAGER_AFTER:
                return self._every()[k]
            if self._joined is None:
                self._joined = b"".join(self._items)
                self._ends = list(accumulate(map(len, self._items)))
            hasher = blake3(self._root)
            hasher.update(memoryview(self._joined)[: self._ends[k]])
            digest = self._asked[k] = hasher.digest(SEQUENCE_DIGEST_SIZE)
        return digest

    def _every(self) -> list[bytes]:
        if self._all is None:
            hasher = blake3(self._root)
            update, digest = hasher.update, hasher.digest
            every = []
            for item in self._items:
                update(item)
                every.append(digest(SEQUENCE_DIGEST_SIZE))
            self._all = every
        return self._all


def as_item_list(value: Any) -> list | None:
    """The request's ``input`` as a list of items, or None when it is neither
    a list nor a string. A string is one user message (the API's own rule)."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return None


_MISSING = object()


class _Type(msgspec.Struct):
    type: Any = None


_TYPE = msgspec.json.Decoder(_Type)


def item_type(raw: bytes) -> Any:
    """The ``type`` of one raw item (None when it has none or is not an object)."""
    try:
        return _TYPE.decode(raw).type
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def is_compaction_trigger(raw: bytes) -> bool:
    """Whether a raw item is Codex's ``compaction_trigger`` (its bytes looked at
    first: a long history is scanned at memory speed)."""
    return b"compaction_trigger" in raw and item_type(raw) == COMPACTION_TRIGGER


def is_compaction(raw: bytes) -> bool:
    """Whether a raw item is a ``compaction`` item (or its legacy ``compaction_summary``)."""
    return b"compaction" in raw and item_type(raw) in COMPACTION_TYPES


def window_start(items: list[bytes], turns: list[tuple[int, int]]) -> int | None:
    """Where a recorded chain's context starts once compacted: ``items`` are
    its turns' inputs and outputs in order, ``turns`` each turn's (input,
    output) lengths. A compaction item stands for everything before it, so
    the context starts at the newest one: at the item itself when a response
    made it (an output: ``context_management``, a trigger), at the start of
    its turn's input when the client sent it (a compacted window, the user
    messages it retained in front of it included). None: nothing compacted."""
    start = end = 0
    found = None
    for input_length, output_length in turns:
        output_start, end = start + input_length, start + input_length + output_length
        made = [i for i in range(output_start, end) if is_compaction(items[i])]
        if made:
            found = made[-1]
        elif any(is_compaction(items[i]) for i in range(start, output_start)):
            found = start
        start = end
    return found


def without_triggers(raw_items: list[bytes]) -> list[bytes]:
    """The items that are content: every ``compaction_trigger`` left out."""
    return [raw for raw in raw_items if not is_compaction_trigger(raw)]




class DigestCache:
    """Item digests by the exact raw bytes the client sent.

    An agent loop resends every earlier item byte for byte on every step, so
    recognising those bytes (one dict lookup: hashing and comparing bytes runs
    at memory speed) is far cheaper than parsing, normalizing and hashing them
    again. Keyed by the bytes themselves, so a hit is exact, never probable.
    An ambiguous item is remembered too (as None), so its bytes are checked once.

    Two generations bound it: when the current one holds half the byte budget
    it becomes the old one and the previous old one is dropped; a hit in the
    old generation moves the entry to the current one. Cheaper per hit than an
    LRU, and what is still in use survives.
    """

    def __init__(self, max_bytes: int = 32 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._current: dict[bytes, bytes | None] = {}
        self._old: dict[bytes, bytes | None] = {}
        self._current_bytes = 0
        # Digests of pure item references ({"type": "item_reference", "id": X})
        # and the ids they name: one small lookup per item tells them apart.
        self.references: dict[bytes, str] = {}

    def __len__(self) -> int:
        return len(self._current) + len(self._old)

    def digests(self, raws: list[bytes]) -> list[bytes]:
        """Digests of JSON object spans; ValueError if one is not an object,
        Ambiguous if one could be read differently by another parser."""
        get = self._current.get
        found = [get(r, _MISSING) for r in raws]
        for i, d in enumerate(found):
            if d is _MISSING:
                d = found[i] = self._miss(raws[i])
            if d is None:
                raise Ambiguous("an item reads differently in other parsers")
        return found  # type: ignore[return-value]

    def _miss(self, raw: bytes) -> bytes | None:
        if raw in self._old:
            digest = self._old.pop(raw)
        else:
            try:
                normal = _raw_normal_form(raw)
                digest = _digest(normal)
            except Ambiguous:
                digest = None
            else:
                if normal.keys() == {"type", "id"} and normal["type"] == "item_reference" \
                        and isinstance(normal["id"], str):
                    self.references[digest] = normal["id"]
        if len(raw) <= self.max_bytes // 4:
            if self._current_bytes + len(raw) > self.max_bytes // 2:
                self._old, self._current, self._current_bytes = self._current, {}, 0
                if len(self.references) > 65536:
                    self.references.clear()
            self._current[raw] = digest
            self._current_bytes += len(raw)
        return digest
