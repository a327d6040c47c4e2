"""What the addon remembers, as records for the backing store.

The planner keeps its knowledge in memory (``store.PrefixStore``, ``Marks``)
and says what must outlive the process as ``Write``s in an outbox; the glue
hands them to a ``storage`` backend and feeds what it reads back in. The
planner itself never does I/O (sans-IO, as hishel's cache policy).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

ENTRIES = "entries"  # sequence digest -> StoredEntry
REFS = "refs"  # namespace + output item id -> that item's digest (item_reference resolution)
MARKS = "marks"  # kind + scope -> when it expires

MarkKind = Literal["unsupported", "no_forced_store", "honours_previous", "refuses_previous"]
MARK_KINDS = frozenset(MarkKind.__args__)  # type: ignore[attr-defined]


class Bounded(OrderedDict):
    """A least-recently-used dict of at most ``limit`` entries."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def hit(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value



@dataclass(frozen=True)
class Write:
    """One change to the backing store: a put (value) or a delete (None)."""

    table: str
    key: bytes
    value: bytes | None
    ttl: float = 0.0
    new: bool = False  # a record that must not silently replace a different one (turns.conflict)
    label: str = ""  # what to name in a warning about it (an id, never content)


class Outbox:
    """Writes waiting for the backing store, oldest first, until the glue
    takes them all."""

    def __init__(self) -> None:
        self._writes: list[Write] = []

    def append(self, write: Write) -> None:
        self._writes.append(write)

    def take(self) -> list[Write]:
        writes, self._writes = self._writes, []
        return writes

    def clear(self) -> None:
        self._writes.clear()


class StoredEntry(msgspec.Struct, array_like=True, frozen=True):
    """A prefix-store entry as stored: which response stores a sequence."""

    response_id: str
    length: int
    scope: str
    expires: float


_ENTRY = msgspec.msgpack.Decoder(StoredEntry)
_ENCODE = msgspec.msgpack.Encoder().encode


def encode_entry(entry: StoredEntry) -> bytes:
    return _ENCODE(entry)


def decode_entry(data: bytes) -> StoredEntry | None:
    """None for a record this version cannot read (never an exception)."""
    try:
        return _ENTRY.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _mark_key(kind: MarkKind, scope: str) -> bytes:
    return f"{kind}\x00{scope}".encode()


class Marks:
    """What the addon learned about an upstream + credential (a scope): that it
    does not store, refuses a forced store, honours previous_response_id, or
    refused (or ignored) a previous_response_id the record held.
    Each mark expires; setting one yields the write that shares it."""

    def __init__(self) -> None:
        self._expires: dict[tuple[str, str], float] = {}

    def has(self, kind: MarkKind, scope: str, now: float) -> bool:
        expires = self._expires.get((kind, scope))
        return expires is not None and expires > now

    def add(self, kind: MarkKind, scope: str, now: float, ttl: float) -> Write | None:
        """Set a mark; the write to share it, or None when it was already set."""
        if self.has(kind, scope, now):
            return None
        self._expires[(kind, scope)] = now + ttl
        return Write(MARKS, _mark_key(kind, scope), struct.pack("!d", now + ttl), ttl)

    def load(self, records: Mapping[bytes, bytes]) -> None:
        """Take in the marks other processes set (a scan of the store)."""
        for key, value in records.items():
            kind, _, scope = key.decode(errors="replace").partition("\x00")
            if kind in MARK_KINDS and len(value) == 8:
                expires = struct.unpack("!d", value)[0]
                self._expires[(kind, scope)] = max(expires, self._expires.get((kind, scope), 0.0))

    def clear(self) -> None:
        self._expires.clear()


def entries_found(records: Mapping[bytes, bytes]) -> dict[bytes, StoredEntry]:
    """The readable entries among records read from the store."""
    found = {}
    for key, value in records.items():
        entry = decode_entry(value)
        if entry is not None:
            found[key] = entry
    return found
