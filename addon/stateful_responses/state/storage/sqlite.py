"""The ``sqlite`` backend: one file, which any number of processes on this
machine may share.

SQLite calls block, so one dedicated worker thread owns the connection and
runs every write; reads have a thread and a connection of their own, so that
a read never waits behind a write that waits for another process's lock. The
event loop only awaits them. The file is created owner-only
before SQLite opens it (SQLite gives its -wal and -shm files the same mode)
and runs in WAL mode, so readers in other processes never wait for a writer.
A second thread copies the WAL into the file (a checkpoint, which ends in an
fsync: 8-10 ms here) within 50 ms of writes, so that commits, which answers
wait on, seldom have to; another evicts records past the byte cap, a few
thousand a transaction, while writes go on.

Layout: ``records(tbl, key, value, expires)`` holds every table's records,
``counts(tbl, n)`` their number per table (kept by triggers, so a bound check
costs no count over the rows), ``meta(name, value)`` the secret. ``expires``
is wall-clock time, shared by every process on the machine.
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar
from urllib.parse import quote

from . import (
    DEFAULT_TABLE_LIMIT,
    SHARD_TAG_SIZE,
    Batch,
    StorageError,
    check_table,
    log_entry,
    log_length,
    log_length_record,
)

T = TypeVar("T")

SCHEMA_VERSION = 1
SCHEMA = (
    """CREATE TABLE records (
        tbl TEXT NOT NULL,
        key BLOB NOT NULL,
        value BLOB NOT NULL,
        expires REAL NOT NULL,
        PRIMARY KEY (tbl, key))""",
    "CREATE INDEX records_by_expiry ON records (tbl, expires)",
    "CREATE TABLE counts (tbl TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
    """CREATE TRIGGER count_insert AFTER INSERT ON records BEGIN
        INSERT INTO counts VALUES (NEW.tbl, 1) ON CONFLICT (tbl) DO UPDATE SET n = n + 1;
    END""",
    """CREATE TRIGGER count_delete AFTER DELETE ON records BEGIN
        UPDATE counts SET n = n - 1 WHERE tbl = OLD.tbl;
    END""",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID",
)
# The unary + keeps SQLite from choosing the expiry index, which would walk
# every record of the table, over the primary key, which finds each key.
GET = "SELECT key, value FROM records WHERE tbl = ? AND +expires > ? AND key IN ({})"
UPSERT = ("INSERT INTO records (tbl, key, value, expires) VALUES (?, ?, ?, ?) "
          "ON CONFLICT (tbl, key) DO UPDATE SET value = excluded.value, expires = excluded.expires")
# A log's length record: a later append never shortens its life.
LOG_LENGTH = ("INSERT INTO records (tbl, key, value, expires) VALUES (?, ?, ?, ?) "
              "ON CONFLICT (tbl, key) DO UPDATE SET value = excluded.value, expires = max(expires, excluded.expires)")
LIVE_VALUE = "SELECT value, expires FROM records WHERE tbl = ? AND key = ? AND expires > ?"
TOUCH = "UPDATE records SET expires = ? WHERE tbl = ? AND key = ? AND expires > ? AND expires < ?"
DELETE_SOONEST = ("DELETE FROM records WHERE rowid IN "
                  "(SELECT rowid FROM records WHERE tbl = ? ORDER BY expires LIMIT ?)")
DELETE_EXPIRED = ("DELETE FROM records WHERE rowid IN "
                  "(SELECT rowid FROM records WHERE tbl = ? AND expires <= ? LIMIT ?)")
MAX_PARAMETERS = 500  # keys per SELECT ... IN (...), well under SQLite's limit
SWEEP_BATCH = 10_000  # expired rows deleted per table per sweep, so one put never stalls long
CATCH_UP_TRIES = 50  # 10 ms apart: the writer waits out the checkpoint thread this long at most
CHECKPOINT_EVERY = 0.05  # seconds between background checkpoints, while there were writes
SIZE_TARGET = 0.9  # over the byte cap, delete down to this fraction of it: not again on the next put
EVICT_AT_ONCE = 2_000  # rows deleted per transaction past the byte cap: the lock is never held long
OVERSHOOT = 1.05  # past this much of the byte cap, writes wait for the eviction under way
EVICTION_ROUNDS = 4  # over the cap, passes over the owners at most: freed space may not free whole pages at once
# What a row holds on disk, about: its key twice (the row and the primary key), its value, the table's name
# twice, and SQLite's headers and the expiry index's entry.
ROW_BYTES = "2 * length(key) + length(value) + 2 * length(tbl) + 40"

# What went wrong, by SQLite's primary result code; and which failures leave
# the connection unusable, so the next call opens a new one.
_FAILURES = {
    sqlite3.SQLITE_BUSY: "locked by another connection",
    sqlite3.SQLITE_LOCKED: "locked by another connection",
    sqlite3.SQLITE_READONLY: "read-only (the file or its directory)",
    sqlite3.SQLITE_PERM: "permission denied",
    sqlite3.SQLITE_CANTOPEN: "cannot open the file",
    sqlite3.SQLITE_FULL: "disk full",
    sqlite3.SQLITE_IOERR: "I/O error",
    sqlite3.SQLITE_CORRUPT: "the file is corrupt",
    sqlite3.SQLITE_NOTADB: "the file is not a database",
}
_REOPEN = {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
# Held while a connection opens, and while a new file is created: see SQLiteStorage._connect.
_CONNECTING = threading.Lock()


def _busy(message: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_BUSY, "SQLITE_BUSY"
    return exc


class SQLiteStorage:
    """Records in one SQLite file. Bounds evict the records that expire
    soonest (the oldest written, for a table written with one ttl); past
    ``max_bytes`` of live pages the owners holding the most bytes (a shard
    tag's records; each table of ``spread``, whose keys are digests, whole)
    lose their soonest-expiring rows until the file is back under 90% of it,
    and SQLite reuses the freed pages, so the file stops growing there."""

    def __init__(
        self,
        path: str,
        limits: Mapping[str, int] | None = None,
        *,
        max_bytes: int = 512 * 1024 * 1024,
        spread: Collection[str] = (),
        busy_timeout: float = 2.0,
        sweep_interval: float = 60.0,
        default_limit: int = DEFAULT_TABLE_LIMIT,
    ):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = f"sqlite:{self.path}"
        self._limits = dict(limits or {})
        self._default_limit = default_limit
        self._max_bytes = max_bytes
        self._spread = frozenset(spread)
        self._busy_timeout = busy_timeout
        self._sweep_interval = sweep_interval
        self._next_sweep = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None  # used by the worker thread only
        self._reads: ThreadPoolExecutor | None = None
        self._read_db: sqlite3.Connection | None = None  # used by the reads' thread only
        # Checkpoints: a thread and a connection of their own (see _checkpoint_soon).
        self._checkpoints: ThreadPoolExecutor | None = None
        self._checkpoint_db: sqlite3.Connection | None = None
        self._checkpoint_queued = False
        # Evictions past the byte cap: a thread and a connection of their own (see _keep_under_max_bytes).
        self._evictions: ThreadPoolExecutor | None = None
        self._evict_db: sqlite3.Connection | None = None
        self._eviction: Future[None] | None = None
        # The WAL holds at most a quarter of the byte cap (up to 8 MiB) between checkpoints.
        self._wal_bytes = min(8 * 1024 * 1024, max_bytes // 4)

    # The event loop's side: every call is one job for the worker thread.

    async def _run(self, job: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stateful-sqlite")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._in_worker, job, *args)

    async def open(self) -> None:
        await self._run(lambda db: None)

    async def keyring(self, ours: bytes | None = None) -> tuple[bytes, tuple[bytes, ...]]:
        return await self._run(self._keyring, ours)

    async def _read(self, job: Callable[..., T], *args: object) -> T:
        if self._reads is None:
            self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stateful-sqlite-read")
        return await asyncio.get_running_loop().run_in_executor(self._reads, self._in_reader, job, *args)

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        check_table(table)
        return await self._read(self._get, table, list(keys)) if keys else {}

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        await self.write(Batch(puts=[(table, records, ttl)]))

    async def delete(self, table: str, keys: Sequence[bytes]) -> None:
        await self.write(Batch(deletes=[(table, keys)]))

    async def write(self, batch: Batch) -> None:
        # One job and one transaction for the whole batch: every hop to the
        # worker costs the event loop a wake-up and a turn of the GIL.
        for table, *_ in (*batch.deletes, *batch.drops, *batch.puts, *batch.appends, *batch.touches):
            check_table(table)
        deletes = [(table, list(keys)) for table, keys in batch.deletes if keys]
        drops = [(table, list(logs)) for table, logs in batch.drops if logs]
        puts = [(table, dict(records), ttl) for table, records, ttl in batch.puts if records]
        appends = [(table, log, list(values), ttl, start) for table, log, values, ttl, start in batch.appends
                   if values]
        touches = [(table, list(keys), ttl) for table, keys, ttl in batch.touches if keys]
        if deletes or drops or puts or appends or touches:
            await self._run(self._write, deletes, drops, puts, appends, touches)

    async def scan(self, table: str) -> dict[bytes, bytes]:
        check_table(table)
        return await self._read(self._scan, table)

    async def clear(self) -> None:
        await self._run(self._clear)

    async def ping(self) -> None:
        await self._run(lambda db: db.execute("SELECT count(*) FROM meta").fetchone())

    async def close(self) -> None:
        reads, self._reads = self._reads, None
        if reads is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(reads, self._disconnect, "_read_db")
            finally:
                reads.shutdown(wait=True)
        executor, self._executor = self._executor, None
        if executor is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(executor, self._close_in_worker)
            finally:
                executor.shutdown(wait=True)  # the worker has nothing left to do: this joins it at once

    # The worker thread's side.

    def _in_worker(self, job: Callable[..., T], *args: object) -> T:
        return self._on("_db", job, *args)

    def _in_reader(self, job: Callable[..., T], *args: object) -> T:
        return self._on("_read_db", job, *args)

    def _on(self, connection: str, job: Callable[..., T], *args: object) -> T:
        """Run ``job`` on the connection named (opened if need be), a
        failure as a StorageError."""
        db = getattr(self, connection)
        try:
            if db is None:
                db = self._connect()
                setattr(self, connection, db)
            return job(db, *args)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", sqlite3.SQLITE_ERROR) & 0xFF
            if db is not None:
                self._recover(db, connection, reopen=code in _REOPEN)
            what = _FAILURES.get(code, f"failed ({getattr(exc, 'sqlite_errorname', type(exc).__name__)})")
            raise StorageError(f"{self.name}: {what}") from exc
        except OSError as exc:
            raise StorageError(f"{self.name}: cannot open or create the file ({os.strerror(exc.errno or 0)})") from exc

    def _recover(self, db: sqlite3.Connection, connection: str, reopen: bool) -> None:
        """Leave no transaction open after a failure (a COMMIT that met a lock
        leaves one); a connection that met corruption or an I/O error is
        dropped, and the next call opens the file afresh."""
        try:
            if not reopen and db.in_transaction:
                db.rollback()
        except sqlite3.Error:
            reopen = True
        if reopen:
            self._disconnect(connection)

    def _connect(self) -> sqlite3.Connection:
        """Open the file, creating it owner-only first if it is not there.
        Opening retries while another process holds a lock, up to the busy
        timeout: switching a new file to WAL answers SQLITE_BUSY at once,
        without waiting, when several processes open it at the same moment.

        Closing any descriptor of a file drops every POSIX lock the process
        holds on it, SQLite's included, after which another process may take
        itself for the file's last user and delete the WAL in use here. So no
        descriptor is opened by hand on a file that exists: only a new one is
        created (O_EXCL), and never while a connection of this process opens."""
        with _CONNECTING:
            try:
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            except FileExistsError:
                if not os.access(self.path, os.R_OK | os.W_OK):  # SQLite would open it read-only
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.path) from None
            deadline = time.monotonic() + self._busy_timeout
            while True:
                try:
                    return self._open_database()
                except sqlite3.OperationalError as exc:
                    if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.01)

    def _open_database(self) -> sqlite3.Connection:
        # mode=rw: a file deleted since is not created again, with the umask's mode
        db = sqlite3.connect(f"file:{quote(self.path)}?mode=rw", uri=True, timeout=self._busy_timeout,
                             isolation_level=None)
        try:
            page_size = db.execute("PRAGMA page_size").fetchone()[0]
            wal_bytes = self._wal_bytes
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                # Another process switching it at once may leave it as it was: wait as for a lock.
                if db.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
                    raise _busy("the file is not in WAL mode yet")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute(f"PRAGMA journal_size_limit = {wal_bytes}")
            db.execute(f"PRAGMA wal_autocheckpoint = {max(16, wal_bytes // page_size)}")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                with _transaction(db):
                    if db.execute("PRAGMA user_version").fetchone()[0] == 0:  # not created meanwhile
                        for statement in SCHEMA:
                            db.execute(statement)
                        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION:
                raise StorageError(f"{self.name}: written by another version (schema {version})")
        except BaseException:
            db.close()
            raise
        return db

    def _disconnect(self, connection: str = "_db") -> None:
        db = getattr(self, connection)
        setattr(self, connection, None)
        if db is not None:
            db.close()

    def _close_in_worker(self) -> None:
        evictions, self._evictions = self._evictions, None
        if evictions is not None:  # an eviction under way ends first: it deletes a tenth of the cap at most
            evictions.submit(self._disconnect, "_evict_db")
            evictions.shutdown(wait=True)
        checkpoints, self._checkpoints = self._checkpoints, None
        if checkpoints is not None:
            checkpoints.submit(self._close_checkpoint_db)
            checkpoints.shutdown(wait=True)
        self._disconnect()

    def _checkpoint_soon(self) -> None:
        """Have the WAL copied into the file CHECKPOINT_EVERY seconds from now,
        by a thread of its own. PASSIVE: it neither waits for nor blocks the
        writer or readers. A checkpoint ends in an fsync (8-10 ms here), which
        SQLite's automatic checkpoint would run inside a commit that answers
        wait on; it stays, as the WAL's bound should this thread fall behind.
        Failures here are left to the writer's next call to meet and report."""
        if self._checkpoint_queued:
            return
        if self._checkpoints is None:
            self._checkpoints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stateful-sqlite-checkpoint")
        self._checkpoint_queued = True
        self._checkpoints.submit(self._checkpoint)

    def _checkpoint(self) -> None:
        time.sleep(CHECKPOINT_EVERY)  # what is written meanwhile goes in the same checkpoint
        self._checkpoint_queued = False
        try:
            if self._checkpoint_db is None:
                with _CONNECTING:  # mode=rw: a file deleted meanwhile is not created again, with the umask's mode
                    self._checkpoint_db = sqlite3.connect(
                        f"file:{quote(self.path)}?mode=rw", uri=True, timeout=0, isolation_level=None)
            self._checkpoint_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            self._close_checkpoint_db()

    def _close_checkpoint_db(self) -> None:
        db, self._checkpoint_db = self._checkpoint_db, None
        if db is not None:
            db.close()

    def _keyring(self, db: sqlite3.Connection, ours: bytes | None) -> tuple[bytes, tuple[bytes, ...]]:
        row = db.execute("SELECT value FROM meta WHERE name = 'secret'").fetchone()
        if row is None or (ours is not None and ours != row[0]):
            with _transaction(db):
                db.execute("INSERT OR IGNORE INTO meta VALUES ('secret', ?)", (ours or os.urandom(32),))
                row = db.execute("SELECT value FROM meta WHERE name = 'secret'").fetchone()
                if ours is not None and ours != row[0]:
                    db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", ("older:" + ours.hex(), ours))
        older = db.execute("SELECT value FROM meta WHERE name LIKE 'older:%'").fetchall()
        return row[0], tuple(value for (value,) in older if value != row[0])

    def _get(self, db: sqlite3.Connection, table: str, keys: list[bytes]) -> dict[bytes, bytes]:
        now = time.time()
        found: dict[bytes, bytes] = {}
        for start in range(0, len(keys), MAX_PARAMETERS):
            chunk = keys[start:start + MAX_PARAMETERS]
            found.update(db.execute(
                GET.format(",".join("?" * len(chunk))), (table, now, *chunk)))
        return found

    def _write(self, db: sqlite3.Connection, deletes: list[tuple[str, list[bytes]]],
               drops: list[tuple[str, list[bytes]]], puts: list[tuple[str, dict[bytes, bytes], float]],
               appends: list[tuple[str, bytes, list[bytes], float, bool]],
               touches: list[tuple[str, list[bytes], float]]) -> None:
        now = time.time()
        with _transaction(db):
            for table, keys in deletes:
                db.executemany("DELETE FROM records WHERE tbl = ? AND key = ?", ((table, key) for key in keys))
            for table, logs in drops:
                for log in logs:
                    row = db.execute(LIVE_VALUE, (table, log, float("-inf"))).fetchone()
                    keys = [log, *(log_entry(log, n) for n in range(log_length(row[0] if row else None)))]
                    db.executemany("DELETE FROM records WHERE tbl = ? AND key = ?", ((table, key) for key in keys))
            for table, records, ttl in puts:
                db.executemany(UPSERT, ((table, key, value, now + ttl) for key, value in records.items()))
                self._keep_to_limit(db, table)
            for table, log, values, ttl, start in appends:
                # Numbered here, inside the write lock: a concurrent append,
                # from this process or another, takes the places after these.
                row = db.execute(LIVE_VALUE, (table, log, now)).fetchone()
                if row is None and not start:
                    continue  # the log is gone: nothing joins it
                first = log_length(row[0] if row else None)
                db.executemany(UPSERT, ((table, log_entry(log, first + n), value, now + ttl)
                                        for n, value in enumerate(values)))
                db.execute(LOG_LENGTH, (table, log, log_length_record(first + len(values)), now + ttl))
                self._keep_to_limit(db, table)
            for table, keys, ttl in touches:
                db.executemany(TOUCH, ((now + ttl, table, key, now, now + ttl) for key in keys))
            if (puts or appends) and now >= self._next_sweep:
                self._next_sweep = now + self._sweep_interval
                for (name,) in db.execute("SELECT tbl FROM counts WHERE n > 0").fetchall():
                    db.execute(DELETE_EXPIRED, (name, now, SWEEP_BATCH))
        if puts or appends:
            self._keep_under_max_bytes(db)
        try:
            over = os.path.getsize(self.path + "-wal") > 2 * self._wal_bytes
        except OSError:
            over = False
        # The checkpoints fell behind (a busy machine): catch up here, where writes
        # wait anyway, waiting out a checkpoint the other thread is running. Each
        # try may wait the busy timeout for another process's reader or writer:
        # the tries stop once that much time went by.
        deadline = time.monotonic() + self._busy_timeout
        for _ in range(CATCH_UP_TRIES if over else 0):
            if db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        self._checkpoint_soon()

    def _keep_to_limit(self, db: sqlite3.Connection, table: str) -> None:
        over = self._count(db, table) - self._limits.get(table, self._default_limit)
        if over > 0:
            db.execute(DELETE_SOONEST, (table, over))

    def _keep_under_max_bytes(self, db: sqlite3.Connection) -> None:
        """Over the cap, what expired goes, then the owners that hold the most
        bytes lose their soonest-expiring records (``_cuts``), until the live
        pages fit in SIZE_TARGET of the cap. An owner is a shard tag (one
        credential's records, whatever their table) or a spread table whole:
        one credential's traffic evicts its own older records, never the
        records of a credential that holds less.

        In a thread and a connection of their own, after the batch's own
        transaction: writes go on meanwhile (past OVERSHOOT of the cap they
        wait for it), and a failure there leaves the batch written (the next
        write past the cap tries again). What to delete is read outside any
        transaction and deleted EVICT_AT_ONCE rows a transaction, so that no
        write, of this process or another, waits long for the lock."""
        used = self._used_bytes(db)
        if used <= self._max_bytes:
            return
        if self._eviction is not None and not self._eviction.done():
            if used > self._max_bytes * OVERSHOOT:  # the writes outran it: they wait for it
                self._eviction.result()
            return
        if self._evictions is None:
            self._evictions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stateful-sqlite-evict")
        self._eviction = self._evictions.submit(self._evict_in_thread)

    def _evict_in_thread(self) -> None:
        try:
            self._evict_db = self._evict_db or self._connect()
            self._evict(self._evict_db)
        except (sqlite3.Error, StorageError, OSError):
            self._disconnect("_evict_db")

    def _evict(self, db: sqlite3.Connection) -> None:
        now = time.time()
        for (name,) in db.execute("SELECT tbl FROM counts WHERE n > 0").fetchall():
            with _transaction(db):
                db.execute(DELETE_EXPIRED, (name, now, SWEEP_BATCH))
        target = self._max_bytes * SIZE_TARGET
        owners = self._owners(db)  # counted once: each round takes off what it deleted
        for _ in range(EVICTION_ROUNDS):
            used = self._used_bytes(db)
            if used <= target:
                return
            doomed: list[tuple[int, float]] = []
            for owner, cut in _cuts(owners, (used - target) * sum(owners.values()) / used).items():
                rows, freed = self._soonest(db, owner, cut)
                doomed += rows
                owners[owner] -= freed
            if not doomed:
                return
            doomed.sort()  # in the file's order: each page is written once
            for start in range(0, len(doomed), EVICT_AT_ONCE):
                with _transaction(db):  # a row renewed since it was read (its expiry moved) stays
                    db.executemany("DELETE FROM records WHERE rowid = ? AND expires = ?",
                                   doomed[start:start + EVICT_AT_ONCE])

    def _owners(self, db: sqlite3.Connection) -> dict[str | bytes, int]:
        """The bytes each owner holds: a spread table by its name, the others'
        records by their shard tag. One pass over the rows (their lengths
        only, never their values' pages)."""
        spread = ",".join("?" * len(self._spread))
        owner = f"CASE WHEN tbl IN ({spread}) THEN tbl ELSE substr(key, 1, {SHARD_TAG_SIZE}) END"
        return dict(db.execute(f"SELECT {owner} AS owner, sum({ROW_BYTES}) FROM records GROUP BY owner",
                               tuple(self._spread)))

    def _soonest(self, db: sqlite3.Connection, owner: str | bytes, cut: float) -> tuple[list[tuple[int, float]], int]:
        """The rows of ``owner`` that expire soonest and hold ``cut`` bytes (their
        rowids and expiry times), and the bytes they hold."""
        if isinstance(owner, str):
            cursors = [db.execute(f"SELECT expires, rowid, {ROW_BYTES} FROM records WHERE tbl = ? ORDER BY expires",
                                  (owner,))]
        else:  # the tag's range of keys in each table: found by the primary key
            upper = _after(owner)
            bound = "AND key < ?" if upper is not None else ""
            tables = [name for (name,) in db.execute("SELECT tbl FROM counts WHERE n > 0") if name not in self._spread]
            cursors = [db.execute(f"SELECT expires, rowid, {ROW_BYTES} FROM records WHERE tbl = ? AND key >= ? "
                                  f"{bound} AND substr(key, 1, {SHARD_TAG_SIZE}) = ? ORDER BY expires",
                                  (name, owner, *((upper,) if upper is not None else ()), owner))
                       for name in tables]
        doomed: list[tuple[int, float]] = []
        freed = 0
        for expires, rowid, size in heapq.merge(*cursors):
            if freed >= cut:
                break
            doomed.append((rowid, expires))
            freed += size
        return doomed, freed

    @staticmethod
    def _used_bytes(db: sqlite3.Connection) -> int:
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * db.execute("PRAGMA page_size").fetchone()[0]

    @staticmethod
    def _count(db: sqlite3.Connection, table: str) -> int:
        row = db.execute("SELECT n FROM counts WHERE tbl = ?", (table,)).fetchone()
        return row[0] if row else 0

    def _scan(self, db: sqlite3.Connection, table: str) -> dict[bytes, bytes]:
        return dict(db.execute("SELECT key, value FROM records WHERE tbl = ? AND expires > ?", (table, time.time())))

    def _clear(self, db: sqlite3.Connection) -> None:
        with _transaction(db):
            db.execute("DELETE FROM records")


def _cuts(owners: Mapping[str | bytes, int], excess: float) -> dict[str | bytes, float]:
    """How many bytes each owner loses so that ``excess`` go: the largest are
    cut down to one level, and no owner under that level loses anything."""
    largest = sorted(owners.items(), key=lambda owner: owner[1], reverse=True)
    held = 0
    for k, (_, size) in enumerate(largest, 1):
        held += size
        level = max((held - excess) / k, 0)
        if level >= (largest[k][1] if k < len(largest) else 0):
            return {owner: size - level for owner, size in largest[:k] if size > level}
    return {}


def _after(prefix: bytes) -> bytes | None:
    """The least key above every key that starts with ``prefix`` (None: none is)."""
    prefix = prefix.rstrip(b"\xff")
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else None


class _transaction:
    """A write transaction that takes the write lock at once (waiting up to
    the busy timeout), so it can never fail half way on a lock upgrade."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:  # SQLite may have rolled back already (disk full, I/O error)
            self.db.execute("ROLLBACK")
