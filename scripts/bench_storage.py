"""The storage layer at scale, without a proxy: what a conversation costs each
store, and how fast reads and flushes stay once it holds 1 M of them.

``python scripts/bench_storage.py [--conversations N] [--quick]`` (or
``scripts/bench --only storage``) measures memory, SQLite (a file in a
temporary directory), one redis-server and a Redis Cluster of three masters
(started by the bench on 127.0.0.1, append-only files on, as the docs ask of
a store), and prints Markdown tables:

- N forward-mode conversations (1 M; 20,000 with ``--quick``), each the
  records its newest stored turn leaves: its prefix entry, the reference to
  its answer's item, and the continuation record's turn, response and chain
  tip, their sizes taken from the planner and the chain index themselves,
  each conversation under a credential of its own; written 1,000
  conversations to a batch, as the writer coalesces flushes. Then, the
  operations sampled in turn: a request's read (the prefix lookup: 32 keys,
  one present), one record's read, and the flush an answer waits for (one
  new turn's records), p50 and p99 as the event loop sees them. Memory per
  conversation is the store's own growth: Redis's ``used_memory`` (summed
  over the masters), the SQLite file, the process's RSS for the memory store.
- Store emulation's turns: conversations of 10 turns chained by
  ``previous_response_id`` (a user item of about 300 B, an answer of about
  400 B), recorded by the history itself (sealed), with their continuation
  records; bytes per emulated turn.

``latency(storage, n)`` is for ``scripts/bench.py``'s stores section.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

import redis  # noqa: E402
from protocols_support import lift, lift_answer  # noqa: E402
from redis_cluster import LocalCluster  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from stateful_responses.continuation.planner import Planner  # noqa: E402
from stateful_responses.request_reader import Request  # noqa: E402
from stateful_responses.record.index import ChainIndex  # noqa: E402
from stateful_responses.state.outbox import apply_writes  # noqa: E402
from stateful_responses.state.storage import SHARD_TAG_SIZE, Batch, Storage  # noqa: E402
from stateful_responses.state.storage.memory import MemoryStorage  # noqa: E402
from stateful_responses.state.storage.redis import RedisStorage  # noqa: E402
from stateful_responses.state.storage.sqlite import SQLiteStorage  # noqa: E402
from stateful_responses.store_emulation.history import History  # noqa: E402
from stateful_responses.store_emulation.turns import Tenant  # noqa: E402

TABLE = "bench"
BATCH = 200  # keys of one request's whole item sequence, looked up at once
TTL = 30 * 86400.0  # the default stateful_ttl_days
LOOKUP = 32  # keys of a request's prefix lookup: one of them present
FILL_BATCH = 1000  # conversations per write while filling
URL = "https://api.example.test/v1/responses"


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


# -- what a conversation leaves in the store ------------------------------------------------------------------

Template = list[tuple[str, int, bool, bytes]]  # (table, key length, tagged by its credential, value)


def forward_turn() -> Template:
    """The records of one forward-mode turn, as the planner and the chain
    index write them: one conversation's newest stored turn."""
    planner = Planner()
    messages = [{"role": "user", "content": "What is the weather in Paris? " + "p" * 200}]
    auth = {"authorization": "Bearer sk-bench"}
    plan = planner.plan(Request("POST", URL, auth, json.dumps({"model": "m", "input": messages}).encode()))
    answer = {"id": "resp_" + "0" * 48, "status": "completed", "store": True,
              "output": [{"type": "message", "id": "msg_" + "0" * 48, "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": "Sunny, 21 °C. " + "a" * 300}]}]}
    planner.settle(plan, 200, answer)
    index = ChainIndex()
    body = json.dumps({"model": "m", "input": messages}).encode()
    turn = index.begin(lift("openai-responses", URL, body), b"Bearer sk-bench", os.urandom(32), flow_id="f" * 32,
                       upstream="https://api.example.test")
    index.claim(turn)
    index.finish(turn, lift_answer("openai-responses", json.dumps(answer).encode(), sse=False))
    written = {(w.table, w.key): w for w in planner.take_writes() + index.take_writes() if w.value is not None}
    return [(w.table, len(w.key), w.table.startswith("chain-"), w.value) for w in written.values()]


def chain_turn() -> Template:
    """The continuation record's part of an emulated turn."""
    return [entry for entry in forward_turn() if entry[2]]


def conversation_records(template: Template, rng: random.Random) -> list[tuple[str, bytes, bytes]]:
    """One conversation's records: the template's, under new keys (a
    credential of its own for the tagged ones)."""
    tag = rng.randbytes(SHARD_TAG_SIZE)
    return [(table, (tag + rng.randbytes(size - SHARD_TAG_SIZE)) if tagged else rng.randbytes(size), value)
            for table, size, tagged, value in template]


def batch_of(records: list[tuple[str, bytes, bytes]]) -> Batch:
    tables: dict[str, dict[bytes, bytes]] = {}
    for table, key, value in records:
        tables.setdefault(table, {})[key] = value
    return Batch(puts=[(table, found, TTL) for table, found in tables.items()])


# -- the stores ----------------------------------------------------------------------------------------------------


class Store:
    """A backend under test, how to read its memory and, for Redis, its own
    time per command (summed over the masters)."""

    def __init__(self, name: str, storage: Storage, used: Callable[[], int], stop: Callable[[], None] = lambda: None,
                 keys_per_master: Callable[[], list[int]] | None = None, ports: list[int] | None = None) -> None:
        self.name, self.storage, self.used, self.stop, self.keys_per_master = name, storage, used, stop, keys_per_master
        self.ports = ports or []

    def reset_stats(self) -> None:
        for port in self.ports:
            with redis.Redis(host="127.0.0.1", port=port) as client:
                client.config_resetstat()

    def server_usec(self, command: str) -> float:
        total = 0.0
        for port in self.ports:
            with redis.Redis(host="127.0.0.1", port=port) as client:
                total += client.info("commandstats").get(f"cmdstat_{command}", {}).get("usec", 0)
        return total


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def redis_used(ports: list[int]) -> Callable[[], int]:
    def used() -> int:
        total = 0
        for port in ports:
            with redis.Redis(host="127.0.0.1", port=port) as client:
                total += client.info("memory")["used_memory"]
        return total
    return used


def sqlite_used(path: str) -> Callable[[], int]:
    """The database's pages in use (a cleared table leaves free pages behind), as a reader sees them."""
    def used() -> int:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
            return pages * db.execute("PRAGMA page_size").fetchone()[0]
        finally:
            db.close()
    return used


def stores(work: Path, limits: Mapping[str, int]) -> list[Callable[[], Store]]:
    """Each store, made when its turn comes (one at a time holds the fill)."""
    def memory() -> Store:
        gc.collect()
        return Store("memory", MemoryStorage(limits), rss)

    def sqlite() -> Store:
        path = str(work / "bench.sqlite3")
        return Store("SQLite", SQLiteStorage(path, limits, max_bytes=64 * 2**30), sqlite_used(path),
                     lambda: [os.remove(p) for p in (path, path + "-wal", path + "-shm") if os.path.exists(p)])

    def server() -> Store:
        redis_server = RedisServer(work / "redis", options=["--appendonly", "yes"])
        redis_server.start()
        return Store("Redis", RedisStorage(redis_server.url, limits, timeout=30, connect_timeout=5),
                     redis_used([redis_server.port]), redis_server.stop, ports=[redis_server.port])

    def cluster() -> Store:
        local = LocalCluster(work / "cluster")
        local.start()
        ports = [master.port for master in local.masters]
        return Store("Redis Cluster, 3 masters", RedisStorage(local.url, limits, timeout=30, connect_timeout=5),
                     redis_used(ports), local.stop, local.keys_per_master, ports)

    made = [memory, sqlite]
    if shutil.which("redis-server"):
        made.append(server)
        if shutil.which("redis-cli"):
            made.append(cluster)
    return made


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def fill(storage: Storage, template: Template, count: int, rng: random.Random) -> list[bytes]:
    """``count`` conversations of ``template``, a few batches on their way at
    once (as replicas write); the key of each one's first record."""
    firsts: list[bytes] = []
    in_flight: set[asyncio.Task] = set()
    for start in range(0, count, FILL_BATCH):
        records = []
        for _ in range(min(FILL_BATCH, count - start)):
            conversation = conversation_records(template, rng)
            firsts.append(conversation[0][1])
            records += conversation
        if len(in_flight) >= 4:
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        in_flight.add(asyncio.ensure_future(storage.write(batch_of(records))))
    for task in in_flight:
        await task
    return firsts


async def sample(storage: Storage, template: Template, present: list[bytes], samples: int,
                 rng: random.Random) -> dict[str, list[float]]:
    """A request's lookup, one record's read and one turn's flush, in turn."""
    table = template[0][0]
    times: dict[str, list[float]] = {"lookup": [], "read": [], "flush": []}
    for _ in range(samples):
        lookup = [rng.randbytes(len(present[0])) for _ in range(LOOKUP - 1)] + [rng.choice(present)]
        for name, call in (("lookup", storage.get(table, lookup)), ("read", storage.get(table, [rng.choice(present)])),
                           ("flush", storage.write(batch_of(conversation_records(template, rng))))):
            started = time.perf_counter()
            await call
            times[name].append((time.perf_counter() - started) * 1000)
    return times


async def emulated_turns(storage: Storage, conversations: int, rng: random.Random) -> int:
    """Conversations of 10 turns each, recorded by the history and written a
    conversation at a time, with their continuation records; turns written."""
    secret = (await storage.keyring())[0]
    history, chain = History(), chain_turn()
    for n in range(conversations):
        tenant = Tenant.of(secret, b"Bearer sk-emulated-%d" % n)
        previous = None
        for turn in range(10):
            response = {"id": f"resp_{n}_{turn}", "object": "response", "status": "completed", "model": "m",
                        "output": [{"type": "message", "id": f"msg_{n}_{turn}", "role": "assistant",
                                    "status": "completed", "content": [{"type": "output_text",
                                                                        "text": "a" * 400, "annotations": []}]}]}
            history.record(tenant, response=response, previous_response_id=previous,
                           raw_input=[json.dumps({"role": "user", "content": "u" * 300}).encode()],
                           stored_upstream=False)
            previous = response["id"]
        writes = history.take_writes()
        await apply_writes(storage, writes)
        await storage.write(batch_of([r for _ in range(10) for r in conversation_records(chain, rng)]))
    return 10 * conversations


async def measure(make: Callable[[], Store], count: int, emulated: int, samples: int) -> dict:
    rng = random.Random(1)
    store = make()
    try:
        await store.storage.open()
        template = forward_turn()
        gc.collect()
        before = store.used()
        started = time.perf_counter()
        present = await fill(store.storage, template, count, rng)
        filled = time.perf_counter() - started
        gc.collect()
        grown = store.used() - before
        spread = store.keys_per_master() if store.keys_per_master else None
        store.reset_stats()
        times = await sample(store.storage, template, present, samples, rng)
        server = {"server_read_us": store.server_usec("mget") / samples,
                  "server_flush_us": store.server_usec("evalsha") / samples} if store.ports else {}
        del present
        await store.storage.clear()
        gc.collect()
        before = store.used()
        turns = await emulated_turns(store.storage, emulated, rng)
        gc.collect()
        per_turn = (store.used() - before) / turns
        return {"name": store.name, "per_conversation": grown / count, "fill_s": filled, "spread": spread, **server,
                "per_turn": per_turn, "record_bytes": sum(len(v) for *_, v in template),
                **{f"{op}_{q}": (statistics.median(v) if q == "p50" else percentile(v, 99)) for op, v in times.items()
                   for q in ("p50", "p99")}}
    finally:
        await store.storage.close()
        store.stop()


async def scale(conversations: int, quick: bool) -> list[str]:
    """The Markdown rows of a run."""
    emulated, samples = (500, 300) if quick else (10_000, 2000)
    limits = {table: 2 * max(conversations, 10 * emulated) for table in
              ("entries", "refs", "chain-turns", "chain-responses", "chain-tips", "turns", "items", "dependents",
               "item-ids")}
    results = []
    with tempfile.TemporaryDirectory() as work:
        for make in stores(Path(work), limits):
            results.append(await measure(make, conversations, emulated, samples))
            print(f"  {results[-1]['name']}: done", file=sys.stderr, flush=True)
    rows = [f"| {conversations:,} forward-mode conversations | memory per conversation | filled in | request's lookup "
            f"({LOOKUP} keys) p50 / p99 | one record's read p50 / p99 | a turn's flush p50 / p99 | "
            "per emulated turn |", "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['name']} | {r['per_conversation']:,.0f} B | {r['fill_s']:.0f} s | "
                    f"{r['lookup_p50']:.2f} / {r['lookup_p99']:.2f} ms | "
                    f"{r['read_p50']:.2f} / {r['read_p99']:.2f} ms | "
                    f"{r['flush_p50']:.2f} / {r['flush_p99']:.2f} ms | {r['per_turn']:,.0f} B |")
    served = [r for r in results if "server_flush_us" in r]
    if served:
        rows += ["", "| Redis's own time (its `commandstats`, every master) | a request's two reads (the lookup "
                 "and one record) | a turn's flush (its scripts, the secret's included) |", "|---|---|---|"]
        rows += [f"| {r['name']} | {r['server_read_us']:.0f} µs | {r['server_flush_us']:.0f} µs |" for r in served]
    spread = next((r["spread"] for r in results if r["spread"]), None)
    rows += ["", f"A conversation's records hold {results[0]['record_bytes']} bytes of values (5 records: prefix "
             "entry, item reference, the continuation record's turn, response and chain tip); an emulated turn's, "
             f"{10 * emulated:,} of them, a 300 B user item and a 400 B answer sealed, its turn, item ids, relied-on "
             f"mark and continuation records. {samples:,} samples of each operation, interleaved, after the fill."]
    if spread:
        rows.append(f"Keys per master of the cluster after the fill: {', '.join(f'{n:,}' for n in spread)} "
                    f"({', '.join(f'{n / sum(spread):.1%}' for n in spread)}).")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, help="forward-mode conversations to fill each store with")
    parser.add_argument("--quick", action="store_true", help="20,000 conversations and fewer samples")
    args = parser.parse_args()
    count = args.conversations or (20_000 if args.quick else 1_000_000)
    started = time.monotonic()
    print("\n".join(asyncio.run(scale(count, args.quick))))
    print(f"\nRun time {(time.monotonic() - started) / 60:.1f} min; load average at the end: "
          + ", ".join(f"{load:.2f}" for load in os.getloadavg()) + ".")


if __name__ == "__main__":
    main()
