"""Where the addon's state lives: one small interface, interchangeable backends.

The backends store bytes under keys, in named tables, each record with an
expiry, and know nothing of what the bytes mean: the planner and the emulation
decide what is worth keeping, the way hishel keeps its storages apart from its
cache policy. ``memory`` keeps everything in the process, ``sqlite`` in one
file (several proxies may share it), ``redis`` on a server or a Redis Cluster
shared by any number of proxies.

A key's first ``SHARD_TAG_SIZE`` bytes are its shard tag: a backend that
spreads records over servers (a Redis Cluster) keeps the records of one tag
together, in every table, and writes them at once. Keys that are digests
spread record by record; a key whose records must change with others (a
tenant's) starts with the tag of what they share (``shard_tag``), in place
of its digest's first bytes. Memory and SQLite keep everything together
anyway and ignore tags.

A table may also hold append-only logs, for records that several processes
add to at once: a log named ``key`` is its length record at ``key`` (8 bytes,
big-endian) and its entries at ``log_entry(key, n)``, all of one shard tag.
The store numbers an append's entries itself, inside the transaction that
writes them, so that concurrent appends (two replicas, two responses) each get
their own places, in the order the store took them, and never overwrite one
another; reads are ordinary ``get``s of the length and the entries.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import urlsplit


class StorageError(Exception):
    """The backing store failed or is unreachable. Callers carry on from memory;
    the message never holds a key, a value or a credential. ``unwritten``:
    of a failed ``write``, the part that may not be in the store (None: all of
    it); the rest is."""

    def __init__(self, message: str = "", unwritten: Batch | None = None) -> None:
        super().__init__(message)
        self.unwritten = unwritten


class Storage(Protocol):
    """Async key-value tables with expiry and bounds. Every method may raise
    StorageError; none blocks the event loop."""

    name: str  # for logs: the kind and where, never a password

    async def open(self) -> None:
        """Connect or create. Idempotent."""

    async def keyring(self, ours: bytes | None = None) -> tuple[bytes, tuple[bytes, ...]]:
        """The store's 32-byte keyed-hash secret, and every other secret it has
        used (never expiring, never logged). The secret is created once and
        shared by every process that uses the store. ``ours`` is the secret
        this process has been using from this store: a store that lost its
        secret (a server restarted empty, an evicted key) gets it back, and a
        store that has another one by now keeps ``ours`` among the older ones,
        so that what was written under it stays readable."""

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """The present, unexpired records among ``keys`` (one round trip)."""

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        """Write records that expire ``ttl`` seconds from now; the oldest
        records of the table go when it is over its bound."""

    async def delete(self, table: str, keys: Sequence[bytes]) -> None: ...

    async def write(self, batch: Batch) -> None:
        """Apply ``batch`` in one call: its deletes, its drops, its puts, its
        appends, then its touches, in one transaction (SQLite, a Redis
        server), or in a Redis Cluster one per shard, which holds whole shard
        tags (and so whole logs). ``put`` and ``delete`` are one-table batches.
        A failure says which part may be unwritten (``StorageError.unwritten``):
        sending that part again is safe (see ``Batch.once``)."""

    async def scan(self, table: str) -> dict[bytes, bytes]:
        """Every unexpired record of a small table (marks), in one call."""

    async def clear(self) -> None:
        """Forget every record of every table (the secret stays)."""

    async def ping(self) -> None:
        """Cheap liveness check, for probing after an outage."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Batch:
    """Writes to several tables at once: each put is (table, records, ttl),
    each delete (table, keys). A key is in at most one of them per table.
    Each touch (table, keys, ttl) keeps the records among ``keys`` that are
    there at least ``ttl`` seconds from now (never shorter than they had).

    Each append (table, log, values, ttl, start) adds ``values`` at the end
    of the log ``log``, in order, each entry expiring ``ttl`` from now (and the
    length record no sooner); a log that is not there (never started, expired,
    dropped) takes nothing unless ``start`` says to start it. Each drop
    (table, logs) removes those logs whole, whatever was appended last.

    Puts, deletes, drops and touches may be applied twice; appends may not,
    so a batch with appends carries ``once``, a random token: a backend that
    may have applied part of it without knowing (a Redis call timed out, a
    cluster master failed mid-batch) remembers the token with each part that
    holds appends, for ``ONCE_TTL``, and skips that part when the batch comes
    again within that time."""

    puts: Sequence[tuple[str, Mapping[bytes, bytes], float]] = ()
    deletes: Sequence[tuple[str, Sequence[bytes]]] = ()
    touches: Sequence[tuple[str, Sequence[bytes], float]] = ()
    appends: Sequence[tuple[str, bytes, Sequence[bytes], float, bool]] = ()
    drops: Sequence[tuple[str, Sequence[bytes]]] = ()
    once: bytes = b""


ONCE_TTL = 3600.0  # seconds a backend remembers a batch's ``once``: a batch is sent again sooner, or never
LOG_INDEX_SIZE = 8


def log_entry(log: bytes, index: int) -> bytes:
    """Where entry ``index`` (from 0) of the log ``log`` is."""
    return log + index.to_bytes(LOG_INDEX_SIZE, "big")


def log_length_record(length: int) -> bytes:
    return length.to_bytes(LOG_INDEX_SIZE, "big")


def log_length(record: bytes | None) -> int:
    """A log's length, from its length record (None: no such log, 0)."""
    return int.from_bytes(record, "big") if record else 0


# Bytes that lead a key and say which records belong together (the whole key, if shorter): two, 65,536 tags
# (1,024 for each shard of a cluster), so that a digest that starts with a tag loses only 16 of its bits.
SHARD_TAG_SIZE = 2


def shard_tag(tag: bytes) -> bytes:
    """The shard tag made from ``tag``: records whose keys start with it stay
    together (one slot of a Redis Cluster), so that one write of them is
    atomic wherever they live."""
    return hashlib.blake2b(tag, digest_size=SHARD_TAG_SIZE).digest()


def shard_key(tag: bytes, key: bytes) -> bytes:
    """``key`` led by the shard tag made from ``tag``."""
    return shard_tag(tag) + key


DEFAULT_SQLITE_FILE = "stateful-responses.sqlite3"
DEFAULT_TABLE_LIMIT = 100_000  # records, for a table ``limits`` does not name
_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_STORE_KINDS = "memory, sqlite, sqlite:PATH, redis://[:password@]host:port/db or rediss://…"


def check_table(table: str) -> str:
    """Table names become part of Redis keys and of SQLite rows: plain names only."""
    if not isinstance(table, str) or not _TABLE_NAME.match(table):
        raise ValueError(f"table names are 1 to 64 letters, digits, '_', '.' or '-', got {table!r}")
    return table


@dataclass(frozen=True)
class StoreSpec:
    """Where the state lives, as parsed from the option value."""

    kind: Literal["memory", "sqlite", "redis"]
    path: str | None = None  # sqlite: the file; None means DEFAULT_SQLITE_FILE in mitmproxy's confdir
    url: str | None = field(default=None, repr=False)  # redis: as given, so it may hold a password


def parse_store_spec(value: str) -> StoreSpec:
    """Parse the store option; a ValueError names what is wrong and never holds a password."""
    text = value.strip()
    if text in ("", "sqlite"):
        return StoreSpec("sqlite")
    if text == "memory":
        return StoreSpec("memory")
    if text.startswith("sqlite:"):
        path = text.removeprefix("sqlite:").strip()
        if not path:
            raise ValueError("sqlite:PATH needs a file path after 'sqlite:'")
        return StoreSpec("sqlite", path=os.path.abspath(os.path.expanduser(path)))
    scheme = text.partition(":")[0].lower()
    if scheme in ("redis", "rediss"):
        _check_redis_url(text, scheme)
        return StoreSpec("redis", url=text)
    if "@" in text:  # may be a URL with a password and a mistyped scheme: do not echo it
        raise ValueError(f"not a store: expected {_STORE_KINDS}")
    raise ValueError(f"unknown store {text!r}: expected {_STORE_KINDS}")


def _check_redis_url(url: str, scheme: str) -> None:
    if not url.lower().startswith(f"{scheme}://"):
        raise ValueError(f"a Redis store is written {scheme}://[:password@]host:port/db")
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"the {scheme}:// URL has no host")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"the {scheme}:// URL's port must be a number from 1 to 65535")
    database = parts.path.removeprefix("/")
    if database and not database.isdigit():
        raise ValueError(f"the {scheme}:// URL's database must be a number, got {database!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the {scheme}:// URL takes no query or fragment")


def open_storage(spec: str, confdir: str, limits: Mapping[str, int], *, max_bytes: int = 512 * 1024 * 1024,
                 spread: Collection[str] = ()) -> Storage:
    """The backend the option value names, built but not yet connected
    (``await storage.open()``). Raises ValueError for a bad value. ``spread``:
    the tables whose keys are digests, each its own shard tag, where a tag
    says nothing of whose a record is."""
    parsed = parse_store_spec(spec)
    # Imported here: the backends import this module, and only a Redis store needs redis-py.
    if parsed.kind == "memory":
        from .memory import MemoryStorage

        return MemoryStorage(limits)
    if parsed.kind == "sqlite":
        from .sqlite import SQLiteStorage

        path = parsed.path or os.path.join(os.path.expanduser(confdir), DEFAULT_SQLITE_FILE)
        return SQLiteStorage(path, limits, max_bytes=max_bytes, spread=spread)
    from .redis import RedisStorage

    assert parsed.url is not None
    return RedisStorage(parsed.url, limits)
