"""The mitmproxy side of the backing store: connect, share the secret and the
marks, write every outbox, read what memory lacks, and carry on from
memory through any outage.

Nothing here blocks the event loop: the backends are async (SQLite runs in its
own thread), writes go through one writer task in order, and a read on a
request's path waits at most ``READ_TIMEOUT``. A write the store failed (or
the part of it a cluster could not take) waits, in order, ahead of every later
one, and is sent again once the store is back, for ``RETRY_FOR`` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mitmproxy import command, ctx

from ..settings import Config, Settings
from ..tenancy import Tenancy
from ..upstreams import MARKS, Upstreams
from .outbox import Remembers, Write, batch_of
from .storage import (
    LOG_INDEX_SIZE,
    ONCE_TTL,
    Batch,
    Storage,
    StorageError,
    log_entry,
    log_length,
    log_length_record,
    open_storage,
    parse_store_spec,
)
from .storage.observed import Observed, Observer

logger = logging.getLogger(__name__)

READ_TIMEOUT = 0.25  # a read on a request's path: past this, plan from memory
LANDED_LOOKBACK = 64  # entries others may have appended to a log after a write of ours landed unbeknown
STRICT_READ_TIMEOUT = 2.0  # a read whose miss would fail the request: past this, it goes as the client sent it
FLUSH_WAIT = 0.25  # an answer's end waits this long at most for its writes
RETRY_AFTER = 2.0  # between attempts to reach a store that failed
MARKS_EVERY = 5.0  # how often marks set by other processes are read
READY_WAIT = 2.0  # at start, requests wait this long at most for the store
DRAIN_WAIT = 3.0  # at shutdown, the last writes get this long
RETRY_FOR = min(300.0, ONCE_TTL / 2)  # a write the store failed is sent again for this long at most
RETRY_BYTES = 64 * 1024 * 1024  # writes waiting to be sent again, their keys' and values' bytes at most


@dataclass
class Unwritten:
    """Writes the store has not taken yet, as the outboxes gave them; once
    made into a batch, that batch (a retry sends the same ``once`` token),
    or the part of it that a failure left unwritten."""

    since: float
    writes: list[Write]
    size: int
    batch: Batch | None = None

    @classmethod
    def of(cls, writes: list[Write], since: float | None = None) -> Unwritten:
        """``since``: when they first waited (a part split off keeps its age: it is given up in time)."""
        return cls(time.monotonic() if since is None else since, writes,
                   sum(len(w.key) + len(w.value or b"") for w in writes))


class StateStore:
    """The backing store, as the other addons see it: ``get`` what memory
    lacks, ``flush`` what they learned, ``written`` to wait for it."""

    def __init__(self, config: Config, tenancy: Tenancy, upstreams: Upstreams, *others: Remembers) -> None:
        self.config = config
        self.tenancy = tenancy
        self.upstreams = upstreams
        self.sources: tuple[Remembers, ...] = (upstreams, *others)
        self.storage: Storage | None = None
        self.up = False  # connected, secret loaded: reads and writes go to the store
        self._opened = False  # it was up once: the store may answer a read while it is taken for down
        self._queue: asyncio.Queue[tuple[list[Write], asyncio.Future | None]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._warned = False  # one warning per outage
        self._attempted: asyncio.Event | None = None  # the first connection attempt is over
        self._answered: asyncio.Event | None = None  # a store taken for down answered a read: reconnect now
        self._tried_at = 0.0  # when the last attempt to connect began
        self._unwritten: deque[Unwritten] = deque()  # oldest first: the writer's next, then those behind it
        self._queued: deque[list[Write]] = deque()  # the writes in the queue, in its order
        self._gave_up = False  # writes were given up in this outage (and a warning said so)
        self._given_up = 0  # writes given up since the start, all outages together
        self._caught_up: asyncio.Future | None = None  # done once nothing waits to be sent again
        self.observer: Observer | None = None  # told of every backend call's time (telemetry)

    # -- lifecycle -------------------------------------------------------------

    def running(self) -> None:
        self._restart()

    def configure(self, updated: set[str]) -> None:
        if updated & {"stateful_store", "confdir", "stateful_store_max_mb", "stateful_store_scale"} and self._tasks:
            self._restart()

    def done(self) -> None:
        self._stop()

    def _restart(self) -> None:
        self._stop()
        loop = asyncio.get_running_loop()
        self._attempted = asyncio.Event()
        self._answered = asyncio.Event()
        self._queue, self._queued = asyncio.Queue(), deque()
        self._tasks = [loop.create_task(self._keep_connected()), loop.create_task(self._write_loop())]

    def _stop(self) -> None:
        """Stop, and write what is still queued before going: a turn an agent
        was just answered must survive a restart."""
        unwritten = self._take_unwritten()
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        storage, self.storage, self.up, self._opened = self.storage, None, False, False
        if storage is not None:
            if unwritten:
                _drain(storage.name, self.config.settings, self._limits(), self._spread(), unwritten)
            asyncio.get_running_loop().create_task(self._close_quietly(storage))

    def _take_unwritten(self) -> list[Unwritten]:
        """What waits to be sent again, the queued writes and the outboxes, in order."""
        unwritten, self._unwritten = list(self._unwritten), deque()
        writes = []
        while self._queue is not None and not self._queue.empty():
            batch, done = self._queue.get_nowait()
            self._took(batch)
            writes += batch
            if done is not None:
                done.set_result(False)  # drained at shutdown, if at all: nobody may count on it
        writes += [w for source in self.sources for w in source.take_writes()]
        return unwritten + [Unwritten.of(writes)] if writes else unwritten

    @staticmethod
    async def _close_quietly(storage: Storage) -> None:
        try:
            await storage.close()
        except StorageError:
            pass

    async def _keep_connected(self) -> None:
        """Connect, share the secret and marks; while up, read other
        processes' marks now and then; after a failure, try again."""
        s = self.config.settings
        confdir = os.path.expanduser(ctx.options.confdir)
        while True:
            self._tried_at = time.monotonic()
            try:
                if not self.up:
                    if self.storage is None:
                        self.storage = open_storage(s.store, confdir, self._limits(),
                                                    max_bytes=s.store_max_mb * 1024 * 1024, spread=self._spread())
                        if self.observer is not None:
                            self.storage = Observed(self.storage, parse_store_spec(s.store).kind, self.observer)
                    await self.storage.open()
                    await self._share_secret(self.storage)
                    self.upstreams.load(await self.storage.scan(MARKS))
                    self.up = self._opened = True
                    self._recovered()
                    if self._unwritten and self._queue is not None:
                        self._queue.put_nowait(([], None))  # what waits goes now, not with the next answer
                else:
                    await self._share_secret(self.storage)
                    self.upstreams.load(await self.storage.scan(MARKS))
            except StorageError as e:
                self._failed(e)
            if self._attempted is not None:
                self._attempted.set()
            answered = self._answered
            assert answered is not None
            answered.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(answered.wait(), MARKS_EVERY if self.up else RETRY_AFTER)

    async def _share_secret(self, storage: Storage) -> None:
        """Take the store's secret, giving it ours back if it lost its own (a
        Redis restarted without persistence, an evicted key): on every
        (re)connect, before any write, and now and then. Should the store hold
        another secret by now (another proxy started while it was empty), that
        one is used from now on and ours stays readable as an older one: what
        was written under it is never lost."""
        ours = self.tenancy.store_secret
        secret, older = await storage.keyring(ours)
        if ours is not None and secret != ours:
            logger.warning("stateful-responses: the state store %s has another secret than this proxy had; using "
                           "it from now on (records made under the old one stay readable)", storage.name)
        self.tenancy.use_secret(secret, older)

    def _failed(self, error: StorageError) -> None:
        self.up = False
        if not self._warned:
            self._warned = True
            name = self.storage.name if self.storage is not None else self.config.settings.store
            logger.warning("stateful-responses: state store %s unavailable (%s); working from memory "
                           "until it is back", name, error)

    def _recovered(self) -> None:
        assert self.storage is not None
        if not self._warned:
            logger.info("stateful-responses: state in %s", self.storage.name)

    def _worked(self) -> None:
        """A read or write went through: an outage is over only then (a full
        disk still connects, and fails at the next write). A store taken for
        down that answered a read is connected again at once, so that the
        writes waiting for it go too."""
        if not self.up and self._answered is not None and time.monotonic() - self._tried_at >= RETRY_AFTER / 4:
            self._answered.set()
        if self._warned and self.storage is not None:
            logger.warning("stateful-responses: state store %s is back", self.storage.name)
            self._warned = self._gave_up = False

    # -- the request path ------------------------------------------------------

    async def ready(self) -> None:
        """Until the first attempt to reach the store is over (at start only):
        what is learned before the store's secret arrives would be lost."""
        if self._attempted is not None and not self._attempted.is_set():
            await asyncio.wait({asyncio.ensure_future(self._attempted.wait())}, timeout=READY_WAIT)

    async def learn_secrets(self) -> bool:
        """Read the store's secrets again (another replica may have made one
        this process has not met yet); whether they changed."""
        if not self.up or self.storage is None:
            return False
        before = (self.tenancy.secret, self.tenancy.older_secrets)
        try:
            await asyncio.wait_for(self._share_secret(self.storage), READ_TIMEOUT)
        except (StorageError, asyncio.TimeoutError):
            return False
        return (self.tenancy.secret, self.tenancy.older_secrets) != before

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Records among ``keys``; nothing when the store is down or slow."""
        if not keys or not self.up or self.storage is None:
            return {}
        try:
            records = await asyncio.wait_for(self.storage.get(table, keys), READ_TIMEOUT)
        except (StorageError, asyncio.TimeoutError) as e:
            self._failed(e if isinstance(e, StorageError) else StorageError("read timed out"))
            return {}
        self._worked()
        return records

    async def get_strict(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Records among ``keys``; StorageError when the store cannot say
        (down or slow), so that "not found" is never a guess. Without them
        the client's request cannot be answered as it means (the chain or the
        conversation it names), so the store is asked even while a slow read
        elsewhere has it taken for down, and given ``STRICT_READ_TIMEOUT``: a
        store that is merely slow (a loaded machine) still answers."""
        if not keys:
            return {}
        if self.storage is None or not self._opened:
            raise StorageError("the state store is unavailable")
        logs = self._pending_logs(table, keys)  # before the read: whatever leaves them meanwhile has landed
        wanted = set(keys)
        records = await self._read_strict(table, [*keys, *(log for log in logs if log not in wanted)])
        if logs:
            await self._overlay_logs(table, records, logs)
        for key, value in self._pending(table, keys).items():  # this proxy's own writes, not yet in the store
            if value is None:
                records.pop(key, None)
            else:
                records[key] = value
        return {key: records[key] for key in keys if key in records} if logs else records

    async def _read_strict(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        assert self.storage is not None
        try:
            records = await asyncio.wait_for(self.storage.get(table, keys), STRICT_READ_TIMEOUT)
        except (StorageError, asyncio.TimeoutError) as e:
            error = e if isinstance(e, StorageError) else StorageError("read timed out")
            self._failed(error)
            raise error from None
        self._worked()
        return records

    def _pending_logs(self, table: str, keys: Sequence[bytes]) -> dict[bytes, list[Write]]:
        """This proxy's log writes the store may not have yet (waiting, the
        batch the writer is on included, or queued), per log that ``keys``
        name (its length record or an entry), in the order they land."""
        if not self._unwritten and not self._queued:
            return {}
        logs: dict[bytes, list[Write]] = {}
        for writes in (*(u.writes for u in self._unwritten), *self._queued):
            for w in writes:
                if w.log and w.table == table:
                    logs.setdefault(w.key, []).append(w)
        if not logs:
            return {}
        named = set(keys) | {key[:-LOG_INDEX_SIZE] for key in keys if len(key) > LOG_INDEX_SIZE}
        return {log: writes for log, writes in logs.items() if log in named}

    async def _overlay_logs(self, table: str, records: dict[bytes, bytes], logs: dict[bytes, list[Write]]) -> None:
        """Read this proxy's pending log writes on top of the store, as the
        store will number them: appends at the end, each once. Writes land
        in order, so those up to the last whose entry (sealed: no two alike)
        is among the log's last entries as read (``LANDED_LOOKBACK`` beyond
        theirs) landed before the read; the rest are added after them."""
        lengths = {log: log_length(records.get(log)) if log in records else None for log in logs}
        tails = [log_entry(log, n) for log, writes in logs.items() if (length := lengths[log])
                 for n in range(max(0, length - len(writes) - LANDED_LOOKBACK), length)]
        tail = await self._read_strict(table, tails) if tails else {}
        for log, writes in logs.items():
            stored = {value for key, value in tail.items() if key[:-LOG_INDEX_SIZE] == log}
            landed = max((n + 1 for n, w in enumerate(writes) if w.value is not None and w.value in stored), default=0)
            length, added, dropped = lengths[log], {}, False
            for write in writes[landed:]:
                if write.log == "drop":
                    length, added, dropped = None, {}, True
                elif length is not None or write.log == "start":
                    length = 0 if length is None else length
                    added[length], length = write.value, length + 1
            if dropped:
                for key in [key for key in records if key == log or key[:-LOG_INDEX_SIZE] == log]:
                    del records[key]
            if length is not None:
                records[log] = log_length_record(length)
                records.update({log_entry(log, n): value for n, value in added.items()})

    def _pending(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes | None]:
        """Of ``keys``, those this proxy wrote and the store may not have yet
        (queued, or waiting after a failure): the newest value of each, or
        None where it was deleted. Read on top of the store, they make it say
        what this proxy already told its clients."""
        if not self._unwritten and not self._queued:
            return {}
        wanted, found = set(keys), {}
        for writes in (*(u.writes for u in self._unwritten), *self._queued):
            for w in writes:
                if w.key in wanted and w.table == table and not w.touch and not w.log:
                    found[w.key] = w.value
        return found

    def _took(self, writes: list[Write]) -> None:
        """The writer took these from the queue (only flushes queue writes)."""
        if writes:
            self._queued.popleft()

    def flush(self) -> asyncio.Future | None:
        """Queue every outbox for the store; the future is done once written
        (True), or once the store failed (False: the writes wait to be sent
        again). None when nothing to write."""
        writes = [w for source in self.sources for w in source.take_writes()]
        if not writes or self._queue is None:
            return None
        done = asyncio.get_running_loop().create_future()
        self._queued.append(writes)
        self._queue.put_nowait((writes, done))
        return done

    async def written(self, done: asyncio.Future | None, timeout: float = FLUSH_WAIT, *,
                      through_outage: bool = False) -> bool:
        """Wait, ``timeout`` at most, until writes are durable and visible to
        the other processes; whether they are (nothing to write: they are).
        Writes the store failed are sent again once it is back; ``through_outage``
        waits for that too (an answer that must not be given before its writes
        land, and may as well wait), else a failure is the answer at once."""
        if done is None:
            return True
        deadline, given_up = time.monotonic() + timeout, self._given_up
        await asyncio.wait({done}, timeout=timeout)
        if not done.done() or done.result() is True or not through_outage:
            return done.done() and done.result() is True
        if not self._tasks:
            return False  # stopped: the last writes were drained, if at all
        if not self._unwritten and not self._queued:
            return self._given_up == given_up  # sent again and written already
        if self._caught_up is None or self._caught_up.done():
            self._caught_up = asyncio.get_running_loop().create_future()
        caught_up = self._caught_up
        await asyncio.wait({caught_up}, timeout=max(0.0, deadline - time.monotonic()))
        return caught_up.done() and self._given_up == given_up  # none given up meanwhile: ours among them

    async def _write_loop(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            try:  # what waits to be sent again is tried every RETRY_AFTER too
                writes, done = await asyncio.wait_for(queue.get(), RETRY_AFTER) if self._unwritten \
                    else await queue.get()
            except asyncio.TimeoutError:
                writes, done = [], None
            self._took(writes)
            finished = [done]
            while not queue.empty():  # what queued meanwhile goes in the same few calls
                more, also_done = queue.get_nowait()
                self._took(more)
                writes, finished = writes + more, finished + [also_done]
            if writes:
                self._unwritten.append(Unwritten.of(writes))
            durable = await self._write_unwritten()
            for future in finished:
                if future is not None and not future.done():
                    future.set_result(durable)

    async def _write_unwritten(self) -> bool:
        """Send what waits, oldest first, until the store fails; whether
        everything is written. A failed batch stays first in line, whole or
        the part the store says it lacks, so that no later write overtakes
        it."""
        while self._unwritten and self.up and self.storage is not None:
            first = self._unwritten[0]
            unchecked: list[Write] = []
            try:
                if first.batch is None:
                    first.batch = await batch_of(self.storage, first.writes, unchecked)
                    if unchecked:  # checked and written next, after what came with them
                        self._unwritten.insert(1, Unwritten.of(unchecked, first.since))
                await self.storage.write(first.batch)
            except StorageError as e:
                if e.unwritten is not None and first.batch is not None:
                    first.batch = e.unwritten
                self._failed(e)
                break
            if self._unwritten and self._unwritten[0] is first:
                self._unwritten.popleft()
            if unchecked:
                self._failed(StorageError(f"{self.storage.name}: unreachable for part of the records"))
                break
            self._worked()
        self._give_up_old()
        if not self._unwritten and self._caught_up is not None and not self._caught_up.done():
            self._caught_up.set_result(True)
        return not self._unwritten

    def _give_up_old(self) -> None:
        """Drop what waited past RETRY_FOR, and the oldest beyond
        RETRY_BYTES, with one warning per outage: a bound on what an outage
        costs memory, and on how late a write may still land."""
        now, size, dropped = time.monotonic(), sum(u.size for u in self._unwritten), 0
        while self._unwritten and (now - self._unwritten[0].since > RETRY_FOR or size > RETRY_BYTES):
            gone = self._unwritten.popleft()
            size, dropped = size - gone.size, dropped + len(gone.writes)
        self._given_up += dropped
        if dropped and not self._gave_up:
            self._gave_up = True
            name = self.storage.name if self.storage is not None else self.config.settings.store
            logger.warning("stateful-responses: writes to %s are given up after %.0f s, or beyond %d MiB, "
                           "unwritten (%d so far)", name, RETRY_FOR, RETRY_BYTES >> 20, dropped)

    def _limits(self) -> dict[str, int]:
        """Records per table: what each source declares, as the settings
        scale it (``Settings.record_cap``)."""
        return {table: self.config.settings.record_cap(n)
                for source in self.sources for table, n in source.tables.items()}

    def _spread(self) -> frozenset[str]:
        """The tables whose keys say nothing of whose a record is (``Remembers``)."""
        return frozenset(table for source in self.sources for table in getattr(source, "spread", ()))

    # -- commands ----------------------------------------------------------------

    @command.command("stateful.clear")
    def clear(self) -> None:
        """Forget everything the addon learned, in memory and in the store."""
        for source in self.sources:
            source.clear()
        self._unwritten.clear()
        if self.up and self.storage is not None:
            asyncio.get_running_loop().create_task(self._clear_store(self.storage))
        logger.info("stateful-responses: forgot everything it had learned")

    async def _clear_store(self, storage: Storage) -> None:
        try:
            await storage.clear()
        except StorageError as e:
            self._failed(e)


def _drain(name: str, settings: Settings, limits: dict[str, int], spread: frozenset[str],
           unwritten: list[Unwritten]) -> None:
    """Apply the last writes at shutdown (or when the store changes). The hook
    that stops us cannot wait on the event loop, so they go through a store
    of their own on a thread of their own, for at most DRAIN_WAIT seconds."""
    if settings.store.strip() == "memory":
        return  # nothing outlives the process anyway

    async def write() -> None:
        storage = open_storage(settings.store, os.path.expanduser(ctx.options.confdir), limits,
                               max_bytes=settings.store_max_mb * 1024 * 1024, spread=spread)
        try:
            await storage.open()
            for waiting in unwritten:
                await storage.write(waiting.batch or await batch_of(storage, waiting.writes))
        finally:
            await storage.close()

    def run() -> None:
        try:
            asyncio.run(write())
        except StorageError as e:
            logger.warning("stateful-responses: %d last writes to %s were lost (%s)",
                           sum(len(u.writes) for u in unwritten), name, e)

    thread = threading.Thread(target=run, name="stateful-responses-drain", daemon=True)
    thread.start()
    thread.join(DRAIN_WAIT)
