"""What must outlive the process, as writes waiting for the backing store.

Every pure core keeps its knowledge in memory and says what the store must
keep as ``Write``s in an outbox of its own; the state store's glue takes them
all, writes them in order and feeds what it reads back in. The cores never do
I/O themselves (sans-IO, as hishel's cache policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class Write:
    """One change to the backing store: a put (value), a delete (None), or a
    touch: keep the record, if it is there, at least ``ttl`` from now. With
    ``log``, ``key`` names an append-only log (``storage.Batch``): "append"
    adds the value at its end, "start" too and starts the log if it is not
    there, "drop" removes it whole."""

    table: str
    key: bytes
    value: bytes | None
    ttl: float = 0.0
    touch: bool = False
    log: Literal["", "append", "start", "drop"] = ""
    # For a record that must not silently replace a different one: given the
    # stored value, what to store instead (None: this write as it is).
    merge: Callable[[bytes, bytes], bytes | None] | None = None
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


class Remembers(Protocol):
    """What keeps state for the store: the tables it writes (name: records a
    store on disk or on a server keeps at most), an outbox, a way to forget."""

    tables: Mapping[str, int]

    def take_writes(self) -> list[Write]: ...

    def clear(self) -> None: ...
