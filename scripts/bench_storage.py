"""Latency of the storage backends, as the event loop sees it.

``latency(storage, n)`` is for ``scripts/bench.py``; run alone,
``python scripts/bench_storage.py [N]`` measures memory, SQLite (a file in a
temporary directory) and Redis (a redis-server started on 127.0.0.1, when
installed) and prints a Markdown table.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from stateful_responses.state.storage import Storage  # noqa: E402
from stateful_responses.state.storage.memory import MemoryStorage  # noqa: E402
from stateful_responses.state.storage.redis import RedisStorage  # noqa: E402
from stateful_responses.state.storage.sqlite import SQLiteStorage  # noqa: E402

TABLE = "bench"
BATCH = 200  # keys of one request's whole item sequence, looked up at once


async def latency(storage: Storage, n: int = 1000) -> dict[str, dict[str, float]]:
    """p50 and p99 in microseconds of ``get`` of 1 present key, of ``BATCH``
    present keys, and of ``put`` of 1 new record: 32-byte digests and 64-byte
    values, as the prefix store writes them. The three are interleaved, so
    noise on the machine falls on all of them alike. The records written are
    deleted afterwards."""
    keys = [os.urandom(32) for _ in range(max(n, BATCH))]
    value = os.urandom(64)
    for start in range(0, len(keys), 500):
        await storage.put(TABLE, dict.fromkeys(keys[start:start + 500], value), ttl=600)
    samples: dict[str, list[float]] = {"get 1": [], f"get {BATCH}": [], "put 1": []}
    written = []
    for i in range(n):
        batch = [keys[(i + j) % len(keys)] for j in range(BATCH)]
        new_key = os.urandom(32)
        written.append(new_key)
        for name, call in (("get 1", storage.get(TABLE, [keys[i]])),
                           (f"get {BATCH}", storage.get(TABLE, batch)),
                           ("put 1", storage.put(TABLE, {new_key: value}, ttl=600))):
            started = time.perf_counter()
            await call
            samples[name].append((time.perf_counter() - started) * 1e6)
    await storage.delete(TABLE, keys + written)
    return {name: {"p50_us": statistics.median(values), "p99_us": statistics.quantiles(values, n=100)[98]}
            for name, values in samples.items()}


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        stores: list[Storage] = [MemoryStorage(), SQLiteStorage(os.path.join(directory, "bench.sqlite3"))]
        server = None
        if shutil.which("redis-server"):
            from redis_server import RedisServer

            server = RedisServer(Path(directory) / "redis")
            server.start()
            stores.append(RedisStorage(server.url))
        try:
            print(f"| backend | {' | '.join(f'{op} p50 / p99 µs' for op in ('get 1', f'get {BATCH}', 'put 1'))} |")
            print("|---|---|---|---|")
            for storage in stores:
                await storage.open()
                result = await latency(storage, n)
                cells = " | ".join(f"{r['p50_us']:.0f} / {r['p99_us']:.0f}" for r in result.values())
                print(f"| {storage.name.split(':')[0]} | {cells} |")
                await storage.close()
        finally:
            if server is not None:
                server.stop()
        if server is None:
            print("(redis-server not found: install the Debian package redis-server to measure Redis)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
