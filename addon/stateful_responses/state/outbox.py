"""What must outlive the process, as writes waiting for the backing store.

Every pure core keeps its knowledge in memory and says what the store must
keep as ``Write``s in an outbox of its own; the state store's glue takes them
all, writes them in order and feeds what it reads back in. The cores never do
I/O themselves (sans-IO, as hishel's cache policy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from ..entropy import random_bytes
from .storage import SHARD_TAG_SIZE, Batch, Storage, StorageError

logger = logging.getLogger(__name__)


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
    store on disk or on a server keeps at most), an outbox, a way to forget.
    One whose keys are digests rather than led by the shard tag of whose they
    are also names those tables in ``spread`` (``state.storage.open_storage``)."""

    tables: Mapping[str, int]

    def take_writes(self) -> list[Write]: ...

    def clear(self) -> None: ...


async def apply_writes(storage: Storage, writes: list[Write]) -> None:
    """Apply writes in one batch (``batch_of``)."""
    await storage.write(await batch_of(storage, writes))


async def batch_of(storage: Storage, writes: list[Write], unchecked: list[Write] | None = None) -> Batch:
    """Writes as one batch: what counts is each key's last put or delete, so
    puts are grouped by table and expiry, deletes by table; a record that
    must not replace another is checked first (one read per table and shard
    tag). Appends to a log keep their order, each one, and drops go whole; a
    batch with appends gets a ``once`` token, so that sending it again after a
    failure appends nothing twice. Touches only ever lengthen a record's life,
    so they are applied last, the longest of each key's.

    A record whose check the store cannot make (its server is down) is left
    out with every write of its key, onto ``unchecked`` in their order, to be
    checked and written later; without ``unchecked`` the error is raised."""
    checks = {(w.table, w.key): w for w in writes if w.merge is not None and w.value is not None and not w.log}
    groups: dict[tuple[str, bytes], list[bytes]] = {}  # one read per table and shard tag, one after another
    for table, key in checks:
        groups.setdefault((table, key[:SHARD_TAG_SIZE]), []).append(key)
    checked: dict[tuple[str, bytes], Write] = {}
    for (table, _), keys in groups.items():
        try:
            stored = await storage.get(table, keys)
        except StorageError:
            if unchecked is None:
                raise
            continue
        checked.update(((table, key), merged(checks[(table, key)], stored.get(key))) for key in keys)
    if unchecked is not None and len(checked) < len(checks):
        unchecked += [w for w in writes if (w.table, w.key) in checks and (w.table, w.key) not in checked]
        writes = [w for w in writes if (w.table, w.key) not in checks or (w.table, w.key) in checked]
    last: dict[tuple[str, bytes], Write] = {}
    touches: dict[tuple[str, bytes], float] = {}
    appends: list[tuple[str, bytes, list[bytes], float, bool]] = []
    drops: dict[str, list[bytes]] = {}
    for write in writes:
        where = (write.table, write.key)
        if write.log == "drop":  # the batch drops before it appends: what came before goes too
            drops.setdefault(write.table, []).append(write.key)
            appends = [a for a in appends if a[:2] != where]
            continue
        if write.log and write.value is not None:
            appends.append((write.table, write.key, [write.value], write.ttl, write.log == "start"))
            continue
        if write.touch:
            touches[where] = max(write.ttl, touches.get(where, 0.0))
            continue
        last.pop(where, None)  # the newest write of a key keeps its place
        last[where] = write
    puts: dict[tuple[str, float], dict[bytes, bytes]] = {}
    deletes: dict[str, list[bytes]] = {}
    for write in last.values():
        if write.merge is not None and write.value is not None:
            write = checked[(write.table, write.key)]
        if write.value is None:
            deletes.setdefault(write.table, []).append(write.key)
        else:
            puts.setdefault((write.table, write.ttl), {})[write.key] = write.value
    renewals: dict[tuple[str, float], list[bytes]] = {}
    for (table, key), ttl in touches.items():
        renewals.setdefault((table, ttl), []).append(key)
    return Batch(puts=[(table, records, ttl) for (table, ttl), records in puts.items()],
                 deletes=list(deletes.items()),
                 touches=[(table, keys, ttl) for (table, ttl), keys in renewals.items()],
                 appends=appends, drops=list(drops.items()), once=random_bytes(16) if appends else b"")


def merged(write: Write, existing: bytes | None) -> Write:
    """A record that is already stored with another value (an upstream reusing
    ids) becomes what the write's ``merge`` says: continuing from it is then
    "not found", never someone else's context."""
    assert write.value is not None and write.merge is not None
    merged = write.merge(existing, write.value) if existing is not None else None
    if merged is None:
        return write
    logger.warning("stateful-responses: response %s was recorded before with other content; both dropped "
                   "(continuing from it is 'not found')", write.label)
    return Write(write.table, write.key, merged, write.ttl)
