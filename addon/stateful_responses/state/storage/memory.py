"""The ``memory`` backend: state lives as long as the process and nothing is
written anywhere."""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from . import DEFAULT_TABLE_LIMIT, Batch, check_table, log_entry, log_length, log_length_record


@dataclass
class _Table:
    """Records by key, and a heap of (expiry, key) that finds the record to
    expire or evict next. A rewritten or deleted record leaves its old heap
    entry behind; such stale entries are skipped, and the heap is rebuilt when
    they outnumber the records."""

    records: dict[bytes, tuple[float, bytes]] = field(default_factory=dict)
    by_expiry: list[tuple[float, bytes]] = field(default_factory=list)

    def put(self, key: bytes, value: bytes, expires: float) -> None:
        self.records[key] = (expires, value)
        heapq.heappush(self.by_expiry, (expires, key))

    def drop_expired(self, now: float) -> None:
        while self.by_expiry and self.by_expiry[0][0] <= now:
            self._pop_soonest()

    def trim(self, limit: int) -> None:
        while len(self.records) > limit:
            self._pop_soonest()
        if len(self.by_expiry) > 2 * len(self.records) + 1024:
            self.by_expiry = [(expires, key) for key, (expires, _) in self.records.items()]
            heapq.heapify(self.by_expiry)

    def _pop_soonest(self) -> None:
        expires, key = heapq.heappop(self.by_expiry)
        record = self.records.get(key)
        if record is not None and record[0] == expires:
            del self.records[key]


class MemoryStorage:
    """Every table in a dict of this process. Bounds evict the records that
    expire soonest: the oldest written, for a table written with one ttl."""

    name = "memory"

    def __init__(self, limits: Mapping[str, int] | None = None, *, default_limit: int = DEFAULT_TABLE_LIMIT):
        self._limits = dict(limits or {})
        self._default_limit = default_limit
        self._tables: dict[str, _Table] = {}
        self._secret = os.urandom(32)
        self._older: set[bytes] = set()

    async def open(self) -> None:
        pass

    async def keyring(self, ours: bytes | None = None) -> tuple[bytes, tuple[bytes, ...]]:
        if ours is not None and ours != self._secret:
            self._older.add(ours)
        return self._secret, tuple(self._older)

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        records = self._tables.get(check_table(table), _Table()).records
        now = time.monotonic()
        found = {}
        for key in keys:
            record = records.get(key)
            if record is not None and record[0] > now:
                found[key] = record[1]
        return found

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        await self.write(Batch(puts=[(table, records, ttl)]))

    async def delete(self, table: str, keys: Sequence[bytes]) -> None:
        await self.write(Batch(deletes=[(table, keys)]))

    async def write(self, batch: Batch) -> None:
        for table, keys in batch.deletes:
            records = self._tables.get(check_table(table), _Table()).records
            for key in keys:
                records.pop(key, None)
        now = time.monotonic()
        for table, logs in batch.drops:
            records = self._tables.get(check_table(table), _Table()).records
            for log in logs:
                length = records.pop(log, (0.0, b""))[1]
                for index in range(log_length(length)):
                    records.pop(log_entry(log, index), None)
        for table, puts, ttl in batch.puts:
            stored = self._tables.setdefault(check_table(table), _Table())
            for key, value in puts.items():
                stored.put(key, value, now + ttl)
            stored.drop_expired(now)
            stored.trim(self._limits.get(table, self._default_limit))
        for table, log, values, ttl, start in batch.appends:
            stored = self._tables.setdefault(check_table(table), _Table())
            length = stored.records.get(log)
            if length is None or length[0] <= now:
                if not start:
                    continue
                length = (0.0, b"")
            first = log_length(length[1])
            for offset, value in enumerate(values):
                stored.put(log_entry(log, first + offset), value, now + ttl)
            stored.put(log, log_length_record(first + len(values)), max(length[0], now + ttl))
            stored.drop_expired(now)
            stored.trim(self._limits.get(table, self._default_limit))
        for table, keys, ttl in batch.touches:
            stored = self._tables.get(check_table(table), _Table())
            for key in keys:
                record = stored.records.get(key)
                if record is not None and now < record[0] < now + ttl:
                    stored.put(key, record[1], now + ttl)

    async def scan(self, table: str) -> dict[bytes, bytes]:
        records = self._tables.get(check_table(table), _Table()).records
        now = time.monotonic()
        return {key: value for key, (expires, value) in records.items() if expires > now}

    async def clear(self) -> None:
        self._tables.clear()

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        self._tables.clear()
