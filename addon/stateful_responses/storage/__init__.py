"""Where the addon's state lives: one small interface, interchangeable backends.

The backends store bytes under keys, in named tables, each record with an
expiry, and know nothing of what the bytes mean: the planner and the emulation
decide what is worth keeping, the way hishel keeps its storages apart from its
cache policy. ``memory`` keeps everything in the process, ``sqlite`` in one
file (several proxies may share it), ``redis`` on a server shared by any
number of proxies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class StorageError(Exception):
    """The backing store failed or is unreachable. Callers carry on from memory;
    the message never holds a key, a value or a credential."""


class Storage(Protocol):
    """Async key-value tables with expiry and bounds. Every method may raise
    StorageError; none blocks the event loop."""

    name: str  # for logs: the kind and where, never a password

    async def open(self) -> None:
        """Connect or create. Idempotent."""

    async def secret(self) -> bytes:
        """The store's 32-byte keyed-hash secret: created once, shared by every
        process that uses the store, never expiring, never logged."""

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """The present, unexpired records among ``keys`` (one round trip)."""

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        """Write records that expire ``ttl`` seconds from now; the oldest
        records of the table go when it is over its bound."""

    async def delete(self, table: str, keys: Sequence[bytes]) -> None: ...

    async def scan(self, table: str) -> dict[bytes, bytes]:
        """Every unexpired record of a small table (marks), in one call."""

    async def clear(self) -> None:
        """Forget every record of every table (the secret stays)."""

    async def ping(self) -> None:
        """Cheap liveness check, for probing after an outage."""

    async def close(self) -> None: ...
