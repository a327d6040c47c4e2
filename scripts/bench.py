"""Benchmarks, measured side by side in one run and reported as ratios.

  bytes    upstream bytes over N-turn tool-using conversations, against full
           replay and against the delta-only limit (and docs/upstream-bytes.png)
  uplink   turn time over a 10 Mbit/s uplink as the history grows to 1 MB:
           plain mitmdump, the addon, and client and upstream alone
  tax      wall time through mitmdump with the addon vs without, where it
           cannot help (a stateless upstream, 20 KB turns)
  plan     planning cost vs a bare json.loads of the same bytes
  sse      time to first event and whole-stream time: addon vs plain mitmdump
           (and the upstream reached directly)
  memory   RSS of the planner over 10,000 requests across 1,000 conversations
  stores   latency per request through mitmdump with each state store
           (memory, SQLite, Redis), one proxy and two sharing the store
  agents   32 concurrent agent loops through one mitmdump: addon vs plain
  record   store emulation's record on SQLite: expanding a 1,000-response
           chain, recording an answer, and what a conversation costs on disk
  seal     sealing's share of record + expand (AEAD vs identity)
  conversation  a turn on a 200-item conversation the proxy keeps, warm and
           cold, next to the same turn via previous_response_id (the core on
           SQLite, and through mitmdump)
  websocket  the WebSocket bridge: upstream bytes vs the delta-only limit, turn
           time over a 10 Mbit/s uplink next to HTTP continuation and plain
           mitmdump, first-event time next to a socket of the client's own,
           memory per held socket and per bridged turn, the time a request
           takes next to HTTP continuation, the event loop held by a 16 MB
           turn with permessage-deflate (websocket_bytes, websocket_uplink,
           websocket_latency, websocket_first_event, websocket_deflate,
           websocket_memory: one part)
  metrics  stateful_metrics on vs off, side by side: the time a request
           takes through each, and the telemetry hooks' own cost per request
  client_websocket  the WebSocket mode the proxy serves over an upstream without
           it: first event on the proxy's socket next to SSE through the proxy
           over HTTP, and the client's uplink bytes per turn on each
  storage  the storage layer alone with 1 M forward-mode conversations (20,000
           with --quick) in each store, a Redis Cluster of three masters
           included: memory per conversation and per emulated turn, p50 / p99
           of a request's read and of a turn's flush (scripts/bench_storage.py)

``scripts/bench [--quick] [--only NAME ...]``; results go to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import platform
import random
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from bench_storage import latency as storage_latency  # noqa: E402
from bench_storage import scale as storage_scale  # noqa: E402
from driver import httpx  # noqa: E402
from harness import start_mitmdump  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from stateful_responses.emulator import Emulator  # noqa: E402
from stateful_responses.continuation.planner import Planner  # noqa: E402
from stateful_responses.request_reader import Request  # noqa: E402
from stateful_responses.settings import Config, Settings  # noqa: E402
from stateful_responses.state.outbox import apply_writes  # noqa: E402
from stateful_responses.state.storage import Storage  # noqa: E402
from stateful_responses.state.storage.memory import MemoryStorage  # noqa: E402
from stateful_responses.state.storage.redis import RedisStorage  # noqa: E402
from stateful_responses.state.storage.sqlite import SQLiteStorage  # noqa: E402
from stateful_responses.store_emulation import turns as turns_module  # noqa: E402
from stateful_responses.store_emulation.history import History  # noqa: E402
from stateful_responses.store_emulation.turns import Tenant  # noqa: E402
from stateful_responses.store_emulation.conversations import Conversations, listed  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
INSTRUCTIONS = "You are a careful assistant. " * 20
AUTH = {"authorization": "Bearer sk-bench"}


@dataclass
class Step:
    """One request of a conversation, as the client saw it."""

    size: int  # body bytes sent
    new: list  # the items new in this request
    seconds: float  # from sending to the whole answer read


def converse(http, urls: Sequence[str], turns: int, tag: str, pad: int = 0, stream: bool = False,
             extra: dict | None = None) -> Iterator[Step]:
    """One tool-using conversation, resending its whole history; yields after
    every request. Requests go to ``urls`` in turn (one proxy, or several
    that share a store); ``extra`` adds request fields (``store: false``)."""
    history: list = []
    requests = 0
    for n in range(turns):
        text = f"{tag} turn {n} " + ("x" * pad)
        if n % 3 == 1:
            text += f' call:get_weather({{"city": "C{n}"}})'
        new = [{"role": "user", "content": text}]
        while True:
            body = {"model": "gpt-bench", "input": history + new, "tools": TOOLS, "instructions": INSTRUCTIONS,
                    **(extra or {})}
            if stream:
                body["stream"] = True
            data = json.dumps(body).encode()
            url = urls[requests % len(urls)]
            requests += 1
            started = time.perf_counter()
            r = http.post(url + "/v1/responses", content=data, headers={**AUTH, "content-type": "application/json"})
            r.raise_for_status()
            seconds = time.perf_counter() - started
            if stream:
                events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
                output = events[-1]["response"]["output"]
            else:
                output = r.json()["output"]
            yield Step(len(data), new, seconds)
            history += new + output
            calls = [o for o in output if o["type"] == "function_call"]
            if not calls:
                break
            new = [{"type": "function_call_output", "call_id": c["call_id"], "output": '{"temp_c": 21}'} for c in calls]


def limit_bytes(new: list, first: bool) -> int:
    """What a client that used previous_response_id itself would send."""
    body = {"model": "gpt-bench", "input": new, "tools": TOOLS, "instructions": INSTRUCTIONS}
    if not first:
        body["previous_response_id"] = "resp_" + "0" * 32
    return len(json.dumps(body).encode())


CHART = ROOT / "docs" / "upstream-bytes.png"


def bench_bytes(quick: bool) -> list[str]:
    rows = ["| conversation | requests | full replay | through the addon | delta-only limit | addon / full | addon / limit |",
            "|---|---|---|---|---|---|---|"]
    cases = [(10, 1), (50, 1), (50 if quick else 200, 1), (10 if quick else 25, 8)]
    longest: tuple[int, list[int], list[int]] = (0, [], [])  # turns, client bytes, upstream bytes per request
    for turns, parallel in cases:
        name = f"{parallel} interleaved × {turns} turns" if parallel > 1 else f"{turns} turns"
        with Emulator() as emu:
            proxy = start_mitmdump(emu.url)
            sizes, limit = [], 0
            try:
                with httpx.Client(trust_env=False, timeout=60) as http:
                    # round-robin, one request of each conversation at a time
                    active = [(converse(http, [proxy.url], turns, f"user{u}"), [True]) for u in range(parallel)]
                    while active:
                        for conv, first in list(active):
                            try:
                                step = next(conv)
                            except StopIteration:
                                active.remove((conv, first))
                                continue
                            sizes.append(step.size)
                            limit += limit_bytes(step.new, first[0])
                            first[0] = False
            finally:
                proxy.stop()
            upstream = [r["body_bytes"] for r in emu.model.snapshot_log()]
        full = sum(sizes)
        if parallel == 1 and turns > longest[0]:
            longest = (turns, sizes, upstream)
        rows.append(f"| {name} | {len(sizes)} | {full:,} B | {sum(upstream):,} B | {limit:,} B | "
                    f"{sum(upstream) / full:.3f} | {sum(upstream) / limit:.2f} |")
    if not quick:
        draw_bytes_chart(*longest)
        rows.append(f"\nThe {longest[0]}-turn conversation, request by request: `docs/{CHART.name}`.")
    return rows


def draw_bytes_chart(turns: int, client: list[int], upstream: list[int]) -> None:
    """Upstream bytes per request, full replay vs through the addon (matplotlib
    comes with the test extra only)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=100)
    requests = range(1, len(client) + 1)
    axes.plot(requests, [b / 1000 for b in client], label=f"full replay: {sum(client) / 1e6:.1f} MB in all")
    axes.plot(requests, [b / 1000 for b in upstream], label=f"through the addon: {sum(upstream) / 1e6:.2f} MB in all")
    axes.set_xlabel(f"request of a {turns}-turn tool-using conversation")
    axes.set_ylabel("bytes sent upstream (kB)")
    axes.set_title("Upstream bytes per request: the whole history, or only what is new")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(CHART)
    pyplot.close(figure)


UPLINK_BYTES_PER_S = 10_000_000 // 8  # 10 Mbit/s


def bench_uplink(quick: bool) -> list[str]:
    """Turn time over a slow uplink (the upstream reads request bodies at 10
    Mbit/s) as the history grows to about 1 MB."""
    turns, pad, rounds = (10, 100_000, 1) if quick else (20, 50_000, 3)
    steps: dict[str, list[list[Step]]] = {"floor": [], "plain": [], "addon": []}
    with Emulator() as limited, Emulator() as unlimited:
        limited.model.control({"read_rate_bytes_per_s": UPLINK_BYTES_PER_S})
        plain, addon = start_mitmdump(limited.url, script=False), start_mitmdump(limited.url)
        urls = {"floor": unlimited.url, "plain": plain.url, "addon": addon.url}
        try:
            with httpx.Client(trust_env=False, timeout=120) as http:
                for n in range(rounds):
                    for name, url in urls.items():
                        steps[name].append(list(converse(http, [url], turns, f"uplink {name} {n}", pad=pad)))
        finally:
            plain.stop()
            addon.stop()
    largest = max(s.size for run in steps["plain"] for s in run)
    at_1mb = {k: statistics.median(s.seconds for run in v for s in run if s.size >= 0.9 * largest)
              for k, v in steps.items()}
    whole = {k: statistics.median(sum(s.seconds for s in run) for run in v) for k, v in steps.items()}
    requests = len(steps["plain"][0])
    return [f"| 10 Mbit/s uplink, history growing to {largest / 1e6:.1f} MB | client and upstream alone, no limit "
            "| plain mitmdump | with the addon | saved by the addon |", "|---|---|---|---|---|",
            f"| a turn at about {largest / 1e6:.0f} MB of history (median) | {at_1mb['floor'] * 1000:.0f} ms | "
            f"{at_1mb['plain'] * 1000:.0f} ms | {at_1mb['addon'] * 1000:.0f} ms | "
            f"{(at_1mb['plain'] - at_1mb['addon']) * 1000:.0f} ms per turn |",
            f"| the whole conversation, {turns} turns, {requests} requests (median of {rounds}) | "
            f"{whole['floor']:.1f} s | {whole['plain']:.1f} s | {whole['addon']:.1f} s | "
            f"{whole['plain'] - whole['addon']:.1f} s |"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """This process's garbage collected and the rest frozen while timing, as
    the addon freezes mitmdump's (heap.py): the collector's full passes then
    walk what the timed runs allocate, not everything imported before."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def timed_runs(fns: dict, rounds: int) -> dict[str, float]:
    """Median wall time of each function, interleaved round by round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_tax(quick: bool) -> list[str]:
    turns = 8 if quick else 20
    with Emulator() as emu:
        emu.model.control({"stateless": "reject"})
        with_addon, plain = start_mitmdump(emu.url), start_mitmdump(emu.url, script=False)
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                def run(url):
                    return lambda: sum(1 for _ in converse(http, [url], turns, "tax", pad=20_000))
                run(with_addon.url)()  # warm-up; also lets the addon find the upstream unsupported
                with frozen_heap():  # the emulator answers from this process
                    med = timed_runs({"addon": run(with_addon.url), "plain": run(plain.url)}, 7 if quick else 21)
        finally:
            with_addon.stop()
            plain.stop()
    return ["| stateless upstream, 20 KB turns | plain mitmdump | with the addon | ratio (target ≤ 1.10) |",
            "|---|---|---|---|",
            f"| {turns} turns per run, median of runs | {med['plain'] * 1000:.0f} ms | {med['addon'] * 1000:.0f} ms | "
            f"{med['addon'] / med['plain']:.3f} |"]


def synthetic_items(size: int, count: int) -> list:
    per = max(200, size // count)
    items: list = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            items.append({"role": "user", "content": f"question {i} " + "q" * (per - 60)})
        elif kind == 1:
            items.append({"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "get_weather",
                          "arguments": json.dumps({"city": f"C{i}", "notes": "n" * (per - 160)}), "status": "completed"})
        elif kind == 2:
            items.append({"type": "function_call_output", "call_id": f"call_{i - 1}", "output": f"{i}" + "o" * (per - 80)})
        else:
            items.append({"type": "message", "id": f"msg_{i}", "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": f"answer {i} " + "a" * (per - 150),
                                       "annotations": [], "logprobs": []}]})
    return items


def plan_case(size: int, count: int, rounds: int) -> str:
    """One body size: json.loads vs an agent-loop step vs a cold planner."""
    items = synthetic_items(size, count)
    prev = {"model": "gpt-bench", "input": items[:-2], "tools": TOOLS, "instructions": INSTRUCTIONS}
    body = json.dumps({**prev, "input": items}).encode()
    url = "https://api.example.test/v1/responses"
    # a planner that saw the previous step and its answer: the agent-loop case
    warm = Planner()
    plan = warm.plan(Request("POST", url, AUTH, json.dumps(prev).encode()))
    warm.settle(plan, 200, {"id": "resp_prev", "status": "completed", "store": True, "output": items[-2:-1]})
    warm.upstreams.mark("reads_back", plan.scope)  # what the glue's proof marks
    assert warm.plan(Request("POST", url, AUTH, body)).action == "continue"

    def fresh() -> Request:
        """Each request a body object of its own, as on the wire: the planner
        reads a body once per request (the record and forward mode share it),
        never once per bytes it has seen."""
        return Request("POST", url, AUTH, bytes(bytearray(body)))

    with frozen_heap():
        med = timed_runs({
            "loads": lambda: json.loads(bytes(bytearray(body))),
            "loop": lambda: warm.plan(fresh()),
            "cold": lambda: Planner().plan(fresh()),
        }, rounds)
    return (f"| {len(body) / 1e6:.1f} MB | {count} | {med['loads'] * 1000:.2f} ms | {med['loop'] * 1000:.2f} ms | "
            f"{med['loop'] / med['loads']:.2f} | {med['cold'] * 1000:.2f} ms | {med['cold'] / med['loads']:.2f} |")


def bench_plan(quick: bool) -> list[str]:
    rows = ["| body | items | json.loads | plan, agent loop (earlier items seen, new ones read strictly) "
            "| ratio (target ≤ 1.5) | plan, body never seen | ratio (target ≤ 2) |",
            "|---|---|---|---|---|---|---|"]
    for size, count in [(100_000, 50), (1_000_000, 400), (5_000_000, 2000)]:
        rows.append(plan_case(size, count, 5 if quick else 25))
    return rows


def bench_sse(quick: bool) -> list[str]:
    with Emulator() as emu:
        emu.model.control({"slow_ms": 15})
        with_addon, plain = start_mitmdump(emu.url), start_mitmdump(emu.url, script=False)
        try:
            results: dict[str, tuple[list, list]] = {"direct": ([], []), "plain": ([], []), "addon": ([], [])}
            urls = {"direct": emu.url, "plain": plain.url, "addon": with_addon.url}
            body = {"model": "gpt-bench", "stream": True, "input": [{"role": "user", "content": "tell me a long story " * 4}]}
            with httpx.Client(trust_env=False, timeout=60) as http:
                for _ in range(3 if quick else 10):
                    for name, url in urls.items():
                        start = time.perf_counter()
                        first = None
                        with http.stream("POST", url + "/v1/responses", json=body, headers=AUTH) as r:
                            for chunk in r.iter_raw():
                                if first is None and chunk:
                                    first = time.perf_counter() - start
                        results[name][0].append(first)
                        results[name][1].append(time.perf_counter() - start)
        finally:
            with_addon.stop()
            plain.stop()
    med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in results.items()}
    return ["| SSE, 15 ms between events | upstream direct | plain mitmdump | with the addon | addon / plain | addon / direct |",
            "|---|---|---|---|---|---|",
            f"| time to first event | {med['direct'][0] * 1000:.0f} ms | {med['plain'][0] * 1000:.0f} ms | "
            f"{med['addon'][0] * 1000:.0f} ms | {med['addon'][0] / med['plain'][0]:.3f} | {med['addon'][0] / med['direct'][0]:.2f} |",
            f"| whole stream | {med['direct'][1] * 1000:.0f} ms | {med['plain'][1] * 1000:.0f} ms | "
            f"{med['addon'][1] * 1000:.0f} ms | {med['addon'][1] / med['plain'][1]:.3f} (target ≤ 1.05) | "
            f"{med['addon'][1] / med['direct'][1]:.2f} |"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_memory(quick: bool) -> list[str]:
    conversations, requests = (200, 2000) if quick else (1000, 20_000)
    planner = Planner(Config(Settings(max_chains=256)))
    url = "https://api.example.test/v1/responses"
    pad = 1500  # items of about 1.6 KB: the item cache reaches its 32 MB cap within the run
    histories = [[{"role": "user", "content": f"conversation {c} opens " + "p" * pad}] for c in range(conversations)]
    samples = []
    gc.collect()
    tracemalloc.start()
    base = rss_mb()
    ours = [tracemalloc.Filter(True, str(ROOT / "addon" / "stateful_responses" / "*"))]
    for n in range(requests):
        c = n % conversations
        history = histories[c]
        plan = planner.plan(Request("POST", url, AUTH, json.dumps({"model": "m", "input": history}).encode()))
        output = [{"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": f"answer {n} " + "a" * pad}]}]
        planner.settle(plan, 200, {"id": f"resp_{n}", "status": "completed", "store": True, "output": output})
        planner.upstreams.mark("reads_back", plan.scope)  # what the glue's proof marks, once
        history += output + [{"role": "user", "content": f"turn {n} " + "u" * pad}]
        if (n + 1) % (requests // 10) == 0:
            gc.collect()
            live = sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(ours).statistics("filename"))
            samples.append((n + 1, live / 2**20, rss_mb() - base, planner.store.branch_count, len(planner.store),
                            len(planner.reader.digests)))
    tracemalloc.stop()
    rows = ["| requests | planner's live memory | process RSS growth (incl. the client's own histories) "
            "| branches (bound 256) | stored entries | cached items |", "|---|---|---|---|---|---|"]
    rows += [f"| {n:,} | {live:.1f} MB | {mb:.1f} MB | {b} | {e} | {i:,} |" for n, live, mb, b, e, i in samples]
    rows.append(f"\n{conversations} conversations round-robin, {requests // conversations} turns each, items of about 1.6 KB. The planner's "
                "live memory is what tracemalloc finds allocated by the addon's code and still held. Two bounds "
                "hold the planner's memory: branches (`stateful_max_chains`, each at most 128 small entries) and "
                "the byte-keyed item cache (32 MB of item bytes, two generations).")
    return rows


def percentile(values: Sequence[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def endless_conversations(http, urls: Sequence[str], tag: str, turns: int = 30) -> Iterator[Step]:
    """Conversations of ``turns`` turns, one after another, forever: bodies
    stay small, and every request but a conversation's first continues."""
    n = 0
    while True:
        yield from converse(http, urls, turns, f"{tag} conversation {n}")
        n += 1


def bench_stores(quick: bool) -> list[str]:
    """Latency per request through mitmdump with each state store, every
    configuration a request in turn, so that noise falls on all alike."""
    requests, warmup = (300, 20) if quick else (1500, 50)
    with tempfile.TemporaryDirectory() as work, Emulator() as emu:
        server = RedisServer(Path(work) / "redis") if shutil.which("redis-server") else None
        configs: dict[str, tuple[str, int]] = {"memory": ("memory", 1), "SQLite": (f"sqlite:{work}/one.sqlite3", 1)}
        if server is not None:
            server.start()
            configs["Redis"] = (server.url, 1)
        configs["SQLite, 2 proxies sharing it"] = (f"sqlite:{work}/shared.sqlite3", 2)
        if server is not None:
            configs["Redis, 2 proxies sharing it"] = (server.url.removesuffix("/0") + "/1", 2)
        proxies = []
        try:
            urls = {}
            for name, (store, count) in configs.items():
                started = [start_mitmdump(emu.url, "--set", f"stateful_store={store}") for _ in range(count)]
                proxies += started
                urls[name] = [p.url for p in started]
            seconds: dict[str, list[float]] = {name: [] for name in configs}
            with httpx.Client(trust_env=False, timeout=60) as http:
                loops = {name: endless_conversations(http, u, name) for name, u in urls.items()}
                for n in range(warmup + requests):
                    for name, loop in loops.items():
                        step = next(loop)
                        if n >= warmup:
                            seconds[name].append(step.seconds)
            log = emu.model.snapshot_log()
            continued = sum(1 for r in log if r.get("previous_response_id"))
            backends = asyncio.run(backend_latency(work, server, 200 if quick else 1000))
        finally:
            for proxy in proxies:
                proxy.stop()
            if server is not None:
                server.stop()
    base = seconds["memory"]
    rows = ["| store | p50 | p99 | added p50 vs memory (target ≤ 1 ms) | added p99 vs memory (target ≤ 3 ms) |",
            "|---|---|---|---|---|"]
    for name, values in seconds.items():
        added = "" if name == "memory" else (
            f" {(statistics.median(values) - statistics.median(base)) * 1000:+.2f} ms |"
            f" {(percentile(values, 99) - percentile(base, 99)) * 1000:+.2f} ms |")
        rows.append(f"| {name} | {statistics.median(values) * 1000:.2f} ms | {percentile(values, 99) * 1000:.2f} ms |"
                    + (added or " | |"))
    rows.append(f"\n{requests} requests per row after {warmup} of warm-up, agent-loop conversations of 30 turns "
                f"(bodies up to about 20 KB), through mitmdump in front of the emulator; {continued} of "
                f"{len(log)} requests reached the upstream as continuations. With two "
                "proxies, a conversation alternates between them: every request reads the store (the other "
                "proxy learned the last answer) and every answer is written to it before its end reaches "
                "the client." + ("" if server else " (redis-server not found: Redis not measured.)"))
    rows += ["", "The backends' own calls, as the event loop sees them (`scripts/bench_storage.py`):", "",
             "| backend | get 1 key p50 / p99 | get 200 keys p50 / p99 | put 1 p50 / p99 |", "|---|---|---|---|"]
    for name, result in backends.items():
        rows.append(f"| {name} | " + " | ".join(f"{r['p50_us']:.0f} / {r['p99_us']:.0f} µs" for r in result.values())
                    + " |")
    return rows


async def backend_latency(work: str, server: RedisServer | None, n: int) -> dict[str, dict]:
    stores: dict[str, Storage] = {"memory": MemoryStorage(), "SQLite": SQLiteStorage(f"{work}/calls.sqlite3")}
    if server is not None:
        stores["Redis"] = RedisStorage(server.url.removesuffix("/0") + "/2")
    results = {}
    for name, storage in stores.items():
        await storage.open()
        try:
            results[name] = await storage_latency(storage, n)
        finally:
            await storage.close()
    return results


def serve_emulator(ports: multiprocessing.Queue, stop: multiprocessing.synchronize.Event) -> None:
    # The child inherits this whole process's heap: unfrozen, each full
    # collection walked it for 60 ms, stalling every request in flight then,
    # with a period that fell on the same phase round after round.
    gc.collect()
    gc.freeze()
    with Emulator() as emu:
        ports.put(emu.port)
        stop.wait()


class EmulatorProcess:
    """The emulator in a process of its own: under 32 concurrent clients, the
    bench's own threads would otherwise compete with it for one GIL."""

    def __init__(self) -> None:
        fork = multiprocessing.get_context("fork")  # the child keeps this module's settings of the emulator
        ports = fork.Queue()
        self._stop = fork.Event()
        self.process = fork.Process(target=serve_emulator, args=(ports, self._stop), daemon=True)
        self.process.start()
        self.url = f"http://127.0.0.1:{ports.get(timeout=30)}"

    def stop(self) -> None:
        self._stop.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


async def agent_loops(url: str, loops: int, turns: int, tag: str, pause: float) -> tuple[list[float], float]:
    """``loops`` agents at once, each resending its growing history every
    turn, about ``pause`` seconds after each answer (its tool work, or the
    time a real model would have taken; drawn at random, so that the agents
    drift apart as real ones do); returns every request's latency and the
    wall time of it all."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=loops, max_keepalive_connections=loops)
    async with httpx.AsyncClient(trust_env=False, timeout=120, limits=limits) as http:
        async def agent(i: int) -> None:
            history: list = []
            jitter = random.Random(i)
            await asyncio.sleep(jitter.uniform(0, pause))
            for n in range(turns):
                new = [{"role": "user", "content": f"{tag} agent {i} turn {n} " + "x" * 1000}]
                body = {"model": "gpt-bench", "input": history + new, "tools": TOOLS, "instructions": INSTRUCTIONS}
                data = json.dumps(body).encode()
                started = time.perf_counter()
                r = await http.post(url + "/v1/responses", content=data,
                                    headers={**AUTH, "content-type": "application/json"})
                r.raise_for_status()
                latencies.append(time.perf_counter() - started)
                history += new + r.json()["output"]
                await asyncio.sleep(jitter.uniform(0.5, 1.5) * pause)

        started = time.perf_counter()
        await asyncio.gather(*(agent(i) for i in range(loops)))
    return latencies, time.perf_counter() - started


# label -> (seconds between an answer and the next request, the upstream's time to answer in ms)
AGENT_PACES = {"back to back (mitmdump saturated)": (0.0, 0),
               "200 ms between an answer and the next request": (0.2, 0),
               "the same, the upstream taking 300 ms to answer (a fast model; real ones take seconds)": (0.2, 300)}


def bench_agents(quick: bool) -> list[str]:
    """p50 and p99 of each phase (one proxy, one pace, all agents' requests),
    then the median over the rounds: a stall of the shared machine that hits
    one phase moves its p99, not the figure."""
    loops, turns, rounds = (32, 8, 3) if quick else (32, 12, 9)
    phases: dict[tuple[str, str], list[tuple[float, float, float]]] = {
        (pace, name): [] for pace in AGENT_PACES for name in ("plain", "addon")}  # (p50, p99, requests/s)
    upstream = EmulatorProcess()
    proxies = {"addon": start_mitmdump(upstream.url), "plain": start_mitmdump(upstream.url, script=False)}
    try:
        with httpx.Client(trust_env=False) as control:
            for n in range(rounds):  # alternating, so that drifts of the machine fall on both
                for pace, (seconds, think_ms) in AGENT_PACES.items():
                    for name, proxy in proxies.items():
                        # Every phase starts from the same heaps: the emulator forgets what it
                        # stored, and this process's garbage is collected and frozen, so that
                        # neither pauses for a collection of what earlier phases left.
                        control.post(upstream.url + "/_emulator/control",
                                     json={"reset": True, "think_ms": think_ms}).raise_for_status()
                        with frozen_heap():
                            values, elapsed = asyncio.run(agent_loops(proxy.url, loops, turns, f"{name} {pace} {n}",
                                                                      seconds))
                        phases[pace, name].append((statistics.median(values), percentile(values, 99),
                                                   len(values) / elapsed))
    finally:
        for proxy in proxies.values():
            proxy.stop()
        upstream.stop()
    median = {key: [statistics.median(phase[i] for phase in runs) for i in range(3)] for key, runs in phases.items()}
    rows = [f"| {loops} agent loops at once, {turns} turns each, median of {rounds} rounds | plain mitmdump p50 / p99 "
            "| with the addon (SQLite store) p50 / p99 | p99 addon / plain (target ≤ 1.10) | requests per second, "
            "plain / addon |", "|---|---|---|---|---|"]
    for pace in AGENT_PACES:
        plain, addon = median[pace, "plain"], median[pace, "addon"]
        rows.append(f"| {pace} | {plain[0] * 1000:.1f} / {plain[1] * 1000:.1f} ms | "
                    f"{addon[0] * 1000:.1f} / {addon[1] * 1000:.1f} ms | **{addon[1] / plain[1]:.2f}** | "
                    f"{plain[2]:.0f} / {addon[2]:.0f} |")
    rows += ["", "The emulator runs in a process of its own and answers at once, except in the last row; the "
             "clients, mitmdump and the emulator share the machine's two cores. Back to back, mitmdump is the "
             "bottleneck and the ratio is that of its work per request. The first two rows isolate the proxy's "
             "own time; the last is what a client of a real model feels. The addon's bodies upstream stay a few kB (continuations), plain "
             f"mitmdump's grow to about {turns} kB."]
    return rows


# -- store emulation's record ----------------------------------

TTL = 30 * 86400.0
CREDENTIAL = b"Bearer sk-bench"


def user_item(n: int, size: int) -> bytes:
    return json.dumps({"role": "user", "content": f"turn {n}: " + "u" * size}).encode()


def answer(n: int, size: int) -> dict:
    return {"id": f"resp_{n}", "object": "response", "status": "completed", "model": "gpt-bench",
            "output": [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": f"answer {n}: " + "a" * size,
                                     "annotations": []}]}]}


async def store_writes(storage: Storage, writes: list) -> None:
    """The recorder's outbox into the store, in one batch, as the glue writes it."""
    await apply_writes(storage, writes)


async def opened_sqlite(path: str, sealed: bool = True) -> tuple[SQLiteStorage, Tenant]:
    """A SQLite store and a tenant of it; with ``sealed`` false the tenant
    seals with ``IdentityAEAD`` (the seal_rows comparison)."""
    storage = SQLiteStorage(path)
    await storage.open()
    with sealing(sealed):
        tenant = Tenant.of((await storage.keyring())[0], CREDENTIAL)
    return storage, tenant


async def record_chain(storage: Storage, tenant: Tenant, turns: int) -> float:
    """A previous_response_id client's conversation, recorded and expanded
    turn by turn as emulation does; returns the mean seconds per turn."""
    recorder = History()
    started = time.perf_counter()
    for n in range(turns):
        previous = f"resp_{n - 1}" if n else None
        if previous is not None:
            await recorder.context(tenant, previous, storage.get)
        recorder.record(tenant, response=answer(n, 400), previous_response_id=previous,
                        raw_input=[user_item(n, 300)], stored_upstream=False)
        await store_writes(storage, recorder.take_writes())
    return (time.perf_counter() - started) / turns


async def expand_times(storage: Storage, tenant: Tenant, last: str, rounds: int) -> tuple[float, float]:
    """Median (cold, warm) seconds of expanding the chain ending at ``last``:
    cold, a fresh recorder over the store another one filled; warm, the same
    recorder again."""
    cold, warm = [], []
    for _ in range(rounds):
        recorder = History()
        for times in (cold, warm):
            started = time.perf_counter()
            await recorder.context(tenant, last, storage.get)
            times.append(time.perf_counter() - started)
    return statistics.median(cold), statistics.median(warm)


def bench_record(quick: bool) -> list[str]:
    return asyncio.run(record_rows(quick))


async def record_rows(quick: bool) -> list[str]:
    depth, rounds = 1000, 5 if quick else 15
    with tempfile.TemporaryDirectory() as work:
        storage, tenant = await opened_sqlite(f"{work}/chain.sqlite3")
        await record_chain(storage, tenant, depth)
        cold, warm = await expand_times(storage, tenant, f"resp_{depth - 1}", rounds)
        await storage.close()

        # A full-history client: every request resends the whole conversation.
        storage, tenant = await opened_sqlite(f"{work}/full.sqlite3")
        recorder = History()
        history: list[bytes] = []
        distinct: set[bytes] = set()
        record_only, with_write = [], []
        for n in range(200):
            history.append(user_item(n, 500))
            reply = answer(n, 500)
            started = time.perf_counter()
            recorder.record(tenant, response=reply, previous_response_id=None, raw_input=list(history),
                            stored_upstream=True)
            recorded = time.perf_counter()
            await store_writes(storage, recorder.take_writes())
            record_only.append(recorded - started)
            with_write.append(time.perf_counter() - started)
            output = [json.dumps(o, separators=(",", ":")).encode() for o in reply["output"]]
            distinct.update(history)
            distinct.update(output)
            history += output
        await storage.close()
        with sqlite3.connect(f"{work}/full.sqlite3") as db:
            stored = db.execute("SELECT sum(length(key) + length(value)) FROM records").fetchone()[0]
        file_bytes = os.path.getsize(f"{work}/full.sqlite3")
    distinct_bytes = sum(map(len, distinct))
    return ["| store emulation's record, on SQLite | measured | target |", "|---|---|---|",
            f"| expanding the next turn of a {depth:,}-response chain, warm (the same recorder again) | "
            f"{warm * 1000:.1f} ms | ≤ 5 ms |",
            f"| the same, cold (a fresh recorder over a store another one filled) | {cold * 1000:.1f} ms | ≤ 100 ms |",
            f"| recording one answer of a full-history client, p50 / p99 (pure, on the event loop) | "
            f"{statistics.median(record_only) * 1000:.2f} / {percentile(record_only, 99) * 1000:.2f} ms | |",
            f"| the same, with its writes to SQLite awaited, p50 / p99 | {statistics.median(with_write) * 1000:.2f} / "
            f"{percentile(with_write, 99) * 1000:.2f} ms | ≤ 1 ms p50 |",
            f"| a 200-turn conversation from a full-history client: records stored / its distinct item bytes | "
            f"{stored:,} B / {distinct_bytes:,} B = **{stored / distinct_bytes:.2f}** | ≤ 1.5 |",
            f"| the same, the SQLite file / distinct item bytes | {file_bytes:,} B / {distinct_bytes:,} B = "
            f"{file_bytes / distinct_bytes:.2f} | |",
            "", f"Chain turns: one user item of about 300 B and one answer of about 400 B; a chain of {depth:,} "
            f"holds {2 * depth:,} items. Medians of {rounds} expansions. The full-history conversation's turns add a "
            "user item and an answer of about 500 B each; its last request resends 399 items. \"Cold\" is a "
            "recorder that has seen nothing, over a SQLite file the operating system has cached."]


class IdentityAEAD:
    """ChaCha20Poly1305's interface sealing nothing: the plaintext and a blank
    16-byte tag, so that records keep their size. For the benchmark only."""

    def __init__(self, key: bytes) -> None:
        pass

    @staticmethod
    def encrypt(nonce: bytes, data: bytes, associated_data: bytes) -> bytes:
        return data + bytes(16)

    @staticmethod
    def decrypt(nonce: bytes, data: bytes, associated_data: bytes) -> bytes:
        return data[:-16]


@contextmanager
def sealing(enabled: bool) -> Iterator[None]:
    """With ``enabled`` false, tenants made inside seal with ``IdentityAEAD``."""
    original = turns_module.ChaCha20Poly1305
    if not enabled:
        turns_module.ChaCha20Poly1305 = IdentityAEAD
    turns_module._tenant.cache_clear()  # tenants are made once per credential: make them again
    try:
        yield
    finally:
        turns_module.ChaCha20Poly1305 = original
        turns_module._tenant.cache_clear()


@contextmanager
def timed_sealing(spent: list[float]) -> Iterator[None]:
    """Adds the seconds spent inside every ``Tenant.seal`` and ``Tenant.open``
    (nonce, AEAD and all) to ``spent[0]``."""
    originals = Tenant.seal, Tenant.open

    def timed(method):
        def run(self, *args):
            started = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                spent[0] += time.perf_counter() - started
        return run

    Tenant.seal, Tenant.open = timed(Tenant.seal), timed(Tenant.open)
    try:
        yield
    finally:
        Tenant.seal, Tenant.open = originals


def bench_seal(quick: bool) -> list[str]:
    return asyncio.run(seal_rows(quick))


async def seal_rows(quick: bool) -> list[str]:
    """Record + expand with ChaCha20-Poly1305 vs the same with the AEAD
    replaced by identity, alternately (the machine's noise falls on both)."""
    turns, depth, rounds = (100, 1000, 5) if quick else (200, 1000, 15)
    per_turn: dict[bool, list[float]] = {True: [], False: []}
    cold: dict[bool, list[float]] = {True: [], False: []}
    warm: dict[bool, list[float]] = {True: [], False: []}
    inside: list[float] = []  # per round: the share of a sealed turn spent sealing and opening
    with tempfile.TemporaryDirectory() as work:
        for n in range(rounds):
            for sealed in (True, False):
                storage, tenant = await opened_sqlite(f"{work}/turns-{n}-{sealed}.sqlite3", sealed)
                spent = [0.0]
                with timed_sealing(spent):
                    per_turn[sealed].append(await record_chain(storage, tenant, turns))
                if sealed:
                    inside.append(spent[0] / turns / per_turn[True][-1])
                await storage.close()
        chains = {sealed: await opened_sqlite(f"{work}/chain-{sealed}.sqlite3", sealed) for sealed in (True, False)}
        for storage, tenant in chains.values():
            await record_chain(storage, tenant, depth)
        for _ in range(rounds):
            for sealed, (storage, tenant) in chains.items():
                times = await expand_times(storage, tenant, f"resp_{depth - 1}", 1)
                cold[sealed].append(times[0])
                warm[sealed].append(times[1])
        for storage, _ in chains.values():
            await storage.close()
    medians = [{k: statistics.median(v) for k, v in d.items()} for d in (per_turn, warm, cold)]

    def row(what: str, median: dict[bool, float]) -> str:
        return (f"| {what} | {median[True] * 1000:.2f} ms | {median[False] * 1000:.2f} ms | "
                f"{(median[True] - median[False]) / median[True]:.0%} |")

    return ["| record + expand | sealed (ChaCha20-Poly1305) | identity AEAD | sealing's share (target ≤ 5%) |",
            "|---|---|---|---|",
            row(f"per turn of a {turns}-turn previous_response_id conversation (expand, record, write to SQLite)",
                medians[0]),
            f"| the same, timed inside every seal and open of the sealed runs (the figure for the target) | | | "
            f"**{statistics.median(inside):.1%}** |",
            row(f"expanding the next turn of a {depth:,}-response chain, warm", medians[1]),
            row("the same, cold", medians[2]),
            "", f"Medians of {rounds} runs, sealed and identity alternately. The identity AEAD is swapped in by the "
            "benchmark only (`IdentityAEAD`); the product always seals. A turn seals three records of a few hundred "
            "bytes (about 3 µs each), so the end-to-end difference of a turn is within the noise of its SQLite "
            "write; the share timed inside the seals is the steady figure."]


# -- conversations the proxy keeps ----------------------------------


async def conversation_turn(conversations: Conversations, storage: Storage, tenant: Tenant, conversation_id: str,
                            n: int) -> float:
    """One turn on a conversation, as emulation makes it: read it fresh from
    the store, expand it, join the answer and await the write; seconds."""
    started = time.perf_counter()
    conversation = await conversations.find(tenant, conversation_id, storage.get)
    body = b"[" + b",".join([item.raw for item in conversation.items] + [user_item(n, 300)]) + b"]"
    assert len(body) > 0
    conversations.join(tenant, conversation, listed([user_item(n, 300)]), answer(n, 400)["output"])
    await apply_writes(storage, conversations.take_writes())
    return time.perf_counter() - started


async def chain_turn(history: History, storage: Storage, tenant: Tenant, previous: str, n: int) -> float:
    """The same turn via previous_response_id: expand the chain, record the answer, await the write."""
    started = time.perf_counter()
    context = await history.context(tenant, previous, storage.get)
    body = b"[" + b",".join(context + [user_item(n, 300)]) + b"]"
    assert len(body) > 0
    history.record(tenant, response=answer(n, 400), previous_response_id=previous, raw_input=[user_item(n, 300)],
                   stored_upstream=False)
    await apply_writes(storage, history.take_writes())
    return time.perf_counter() - started


async def conversation_core_rows(quick: bool) -> list[str]:
    turns, rounds = 100, 5 if quick else 15
    times: dict[str, list[float]] = {"conversation warm": [], "conversation cold": [], "chain warm": [],
                                     "chain cold": []}
    with tempfile.TemporaryDirectory() as work:
        storage, tenant = await opened_sqlite(f"{work}/state.sqlite3")
        conversations = Conversations()
        conversation_id = conversations.create(tenant, [], b"{}").id
        await apply_writes(storage, conversations.take_writes())
        for n in range(turns):  # 200 items: a user item and an answer a turn
            await conversation_turn(conversations, storage, tenant, conversation_id, n)
        await record_chain(storage, tenant, turns)
        history, previous = History(), f"resp_{turns - 1}"
        await history.context(tenant, previous, storage.get)
        for r in range(rounds):  # each round adds a turn to both; the sizes stay about 200 items
            n = turns + r
            times["conversation cold"].append(await conversation_turn(Conversations(), storage, tenant,
                                                                      conversation_id, n))
            times["conversation warm"].append(await conversation_turn(conversations, storage, tenant,
                                                                      conversation_id, n))
            times["chain cold"].append(await chain_turn(History(), storage, tenant, previous, n))
            history.record(tenant, response=answer(10_000 + r, 400), previous_response_id=previous,
                           raw_input=[user_item(n, 300)], stored_upstream=False)
            times["chain warm"].append(await chain_turn(history, storage, tenant, previous, n))
        await storage.close()
    median = {name: statistics.median(values) * 1000 for name, values in times.items()}
    return ["| the proxy's own work for the next turn, on SQLite | warm | cold |", "|---|---|---|",
            f"| on a {2 * turns}-item conversation (`conversation`) | {median['conversation warm']:.1f} ms | "
            f"{median['conversation cold']:.1f} ms |",
            f"| the same turn via `previous_response_id` (a {turns}-response chain of the same items) | "
            f"{median['chain warm']:.1f} ms | {median['chain cold']:.1f} ms |",
            "", f"Medians of {rounds} turns: read from the store and expand, then record the answer (join the "
            "conversation, or record the turn) and await its write to SQLite. Warm: the proxy that answered the "
            "turns before; cold: one that has seen nothing (a restart, another replica) over the same file. Items "
            "of about 300 and 400 bytes."]


def timed_post(http, url: str, body: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    r = http.post(url + "/v1/responses", json=body, headers=AUTH)
    r.raise_for_status()
    return time.perf_counter() - started, r.json()


def conversation_proxy_rows(quick: bool) -> list[str]:
    """The client's time for the next turn through mitmdump (always, SQLite),
    the upstream without state: warm (the same proxy again), cold (the first
    request after a restart)."""
    turns, rounds = 100, 5 if quick else 11
    times: dict[str, list[float]] = {"conversation warm": [], "conversation cold": [], "chain warm": [],
                                     "chain cold": []}
    sizes: dict[str, int] = {}  # the last body each sent upstream
    with tempfile.TemporaryDirectory() as work, Emulator() as emu:
        emu.model.control({"conversations": "absent", "stateless": "reject"})
        options = ("--set", "stateful_emulate=always", "--set", f"stateful_store=sqlite:{work}/state.sqlite3")
        proxy = start_mitmdump(emu.url, *options, confdir=work)
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                conversation_id = http.post(proxy.url + "/v1/conversations", json={}, headers=AUTH).json()["id"]
                previous = None
                for n in range(turns):
                    text = json.loads(user_item(n, 300))["content"]
                    timed_post(http, proxy.url, {"model": "m", "input": text, "conversation": conversation_id})
                    previous = timed_post(http, proxy.url, {"model": "m", "input": text,
                                                            **({"previous_response_id": previous} if previous
                                                               else {})})[1]["id"]
                for r in range(rounds):
                    for kind in ("conversation", "chain"):  # each first after a restart of its own
                        proxy.stop()
                        proxy = start_mitmdump(emu.url, *options, confdir=work, port=proxy.port)
                        for n, temperature in enumerate(("cold", "warm", "warm", "warm")):
                            body = {"model": "m", "input": f"round {r} {kind} {n}",
                                    **({"conversation": conversation_id} if kind == "conversation"
                                       else {"previous_response_id": previous})}
                            seconds, answered = timed_post(http, proxy.url, body)
                            times[f"{kind} {temperature}"].append(seconds)
                            sizes[kind] = emu.model.snapshot_log()[-1]["body_bytes"]
                            previous = answered["id"] if kind == "chain" else previous
        finally:
            proxy.stop()
    median = {name: statistics.median(values) * 1000 for name, values in times.items()}
    return ["| the client's time for the next turn, through mitmdump (`always`, SQLite) | warm | cold |",
            "|---|---|---|",
            f"| on a {2 * turns}-item conversation | {median['conversation warm']:.1f} ms | "
            f"{median['conversation cold']:.1f} ms |",
            f"| the same turn via `previous_response_id` | {median['chain warm']:.1f} ms | "
            f"{median['chain cold']:.1f} ms |",
            "", f"Medians of {rounds} rounds, in front of the emulator without state (it answers at once). Cold: the "
            "first request after mitmdump restarted (each kind after a restart of its own); warm: the next three. "
            "Both hold the same items (the user's text, the emulator's answer); the conversation's go upstream as "
            f"the API lists them (typed, with ids): {sizes['conversation']:,} bytes for the last turn, against "
            f"{sizes['chain']:,} for the chain's."]


async def loop_held(work) -> tuple[float, float]:
    """The longest the event loop thread spent on its own CPU between two of
    its turns while ``work`` ran (time waiting for the store or for a core
    left out), and the whole of ``work``; seconds."""
    longest, done = 0.0, False

    async def ticker() -> None:
        nonlocal longest
        last = time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now = time.thread_time()
            longest, last = max(longest, now - last), now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started = time.perf_counter()
    await work
    elapsed, done = time.perf_counter() - started, True
    await ticking
    return longest, elapsed


async def conversation_loop_rows(quick: bool) -> list[str]:
    """A cold read of a conversation at the proxy's item bound: how long it
    holds the event loop, by the way its items came (a response joining adds
    its input and output in one entry; an items call of one item, one each)."""
    rounds = 3 if quick else 7
    rows = ["| a cold read of a 10,000-item conversation, on SQLite | log entries | event loop held at most | "
            "the whole read |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        storage, tenant = await opened_sqlite(f"{work}/state.sqlite3")
        for how, per_entry in (("5,000 responses joined", 2), ("10,000 items added one at a time", 1)):
            conversations = Conversations()
            conversation = conversations.create(tenant, [], b"{}")
            for n in range(10_000 // per_entry):
                if per_entry == 2:
                    conversations.join(tenant, conversation, listed([user_item(n, 300)]), answer(n, 400)["output"])
                else:
                    conversations.add(tenant, conversation, listed([user_item(n, 300)]))
                if n % 500 == 499:
                    await apply_writes(storage, conversations.take_writes())
            await apply_writes(storage, conversations.take_writes())
            held, whole = [], []
            for _ in range(rounds):
                longest, elapsed = await loop_held(Conversations().find(tenant, conversation.id, storage.get))
                held.append(longest)
                whole.append(elapsed)
            rows.append(f"| {how} | {10_000 // per_entry + 1:,} | {statistics.median(held) * 1000:.1f} ms "
                        f"(worst {max(held) * 1000:.1f}) | {statistics.median(whole) * 1000:.0f} ms |")
        await storage.close()
    return rows + ["", f"Medians of {rounds} reads by a proxy that has seen nothing. Held: the event loop "
                   "thread's own CPU time between two of its turns (a ticker task counts them), so neither the "
                   "store's thread nor another process counts (a garbage collection does)."]


def bench_conversation(quick: bool) -> list[str]:
    return asyncio.run(conversation_core_rows(quick)) + [""] + asyncio.run(conversation_loop_rows(quick)) + [""] \
        + conversation_proxy_rows(quick)

# -- the WebSocket bridge ----------------------------------

STORE_FALSE = {"store": False}


def socket_limit_bytes(new: list, first: bool) -> int:
    """What a WebSocket client that used previous_response_id itself would send: the HTTP limit's body as a
    ``response.create`` message."""
    body = {"type": "response.create", "model": "gpt-bench", "input": new, "tools": TOOLS,
            "instructions": INSTRUCTIONS, **STORE_FALSE}
    if not first:
        body["previous_response_id"] = "resp_" + "0" * 32
    return len(json.dumps(body).encode())


def bridged(upstream: str, **options) -> object:
    """mitmdump with the addon and its WebSocket bridge on."""
    return start_mitmdump(upstream, *[f"--set=stateful_{k}={v}" for k, v in options.items()],
                          upstream_websocket="auto")


def websocket_bytes(quick: bool) -> list[str]:
    rows = ["| conversation, `store: false` | requests | full replay | HTTP continuation (forward mode) "
            "| over the bridge's socket | delta-only limit, HTTP / socket | bridge / socket limit (target ≤ 1.02) "
            "| bridge / HTTP limit | bridge / full replay |", "|---|---|---|---|---|---|---|---|---|"]
    for turns in (10, 50) if quick else (10, 50, 200):
        upstream: dict[str, int] = {}
        sizes: list[int] = []
        limits = [0, 0]
        for name in ("http", "bridge"):
            with Emulator() as emu:
                proxy = bridged(emu.url) if name == "bridge" else start_mitmdump(emu.url)
                try:
                    with httpx.Client(trust_env=False, timeout=60) as http:
                        steps = list(converse(http, [proxy.url], turns, f"bytes {name}", extra=STORE_FALSE))
                finally:
                    proxy.stop()
                log = emu.model.snapshot_log()
            assert {r["transport"] for r in log} == {"websocket" if name == "bridge" else "http"}
            upstream[name] = sum(r["body_bytes"] for r in log)
            sizes = [s.size for s in steps]
            limits = [sum(limit_bytes(s.new, n == 0) for n, s in enumerate(steps)),
                      sum(socket_limit_bytes(s.new, n == 0) for n, s in enumerate(steps))]
        full = sum(sizes)
        rows.append(f"| {turns} turns | {len(sizes)} | {full:,} B | {upstream['http']:,} B | {upstream['bridge']:,} B | "
                    f"{limits[0]:,} / {limits[1]:,} B | **{upstream['bridge'] / limits[1]:.3f}** | "
                    f"{upstream['bridge'] / limits[0]:.3f} | {upstream['bridge'] / full:.3f} |")
    rows.append("\nThe socket's limit is the HTTP limit's body sent as a `response.create` (25 bytes more a "
                "message, `\"type\": \"response.create\"`); forward mode sends `store: true` besides (it forces "
                "storage where there is no socket).")
    return rows


def websocket_uplink(quick: bool) -> list[str]:
    turns, pad, rounds = (10, 100_000, 1) if quick else (20, 50_000, 3)
    names = ("floor", "plain", "http", "bridge")
    steps: dict[str, list[list[Step]]] = {name: [] for name in names}
    with Emulator() as limited, Emulator() as unlimited:
        limited.model.control({"read_rate_bytes_per_s": UPLINK_BYTES_PER_S})  # HTTP bodies and socket frames alike
        proxies = {"plain": start_mitmdump(limited.url, script=False), "http": start_mitmdump(limited.url),
                   "bridge": bridged(limited.url)}
        urls = {"floor": unlimited.url, **{name: proxy.url for name, proxy in proxies.items()}}
        try:
            with httpx.Client(trust_env=False, timeout=120) as http:
                for n in range(rounds):
                    for name in names:
                        steps[name].append(list(converse(http, [urls[name]], turns, f"uplink {name} {n}", pad=pad,
                                                         extra=STORE_FALSE)))
        finally:
            for proxy in proxies.values():
                proxy.stop()
        assert {r["transport"] for r in limited.model.snapshot_log()} == {"http", "websocket"}
    largest = max(s.size for run in steps["plain"] for s in run)
    at_1mb = {k: statistics.median(s.seconds for run in v for s in run if s.size >= 0.9 * largest)
              for k, v in steps.items()}
    whole = {k: statistics.median(sum(s.seconds for s in run) for run in v) for k, v in steps.items()}
    ms = {k: f"{v * 1000:.0f} ms" for k, v in at_1mb.items()}
    return [f"| 10 Mbit/s uplink, history growing to {largest / 1e6:.1f} MB, `store: false` | no limit, no proxy "
            "| plain mitmdump | HTTP continuation (forward mode) | the bridge's socket | bridge / HTTP continuation "
            "| bridge / plain |", "|---|---|---|---|---|---|---|",
            f"| a turn at about {largest / 1e6:.0f} MB of history (median) | {ms['floor']} | {ms['plain']} | "
            f"{ms['http']} | {ms['bridge']} | **{at_1mb['bridge'] / at_1mb['http']:.2f}** | "
            f"**{at_1mb['bridge'] / at_1mb['plain']:.3f}** |",
            f"| the whole conversation, {turns} turns (median of {rounds}) | {whole['floor']:.1f} s | "
            f"{whole['plain']:.1f} s | {whole['http']:.1f} s | {whole['bridge']:.1f} s | "
            f"{whole['bridge'] / whole['http']:.2f} | {whole['bridge'] / whole['plain']:.3f} |",
            "", "The emulator reads HTTP bodies and socket frames alike at 10 Mbit/s. Each transport's first "
            "request is sent whole; after it, forward mode and the bridge both send only the new items."]


def first_event_times(url: str, rounds: int) -> tuple[float, list[float]]:
    """A conversation through ``url`` over HTTP, streamed: the first turn's time to its first SSE bytes,
    then each later turn's (each continues the one before)."""
    history: list = []
    times = []
    with httpx.Client(trust_env=False, timeout=60) as http:
        for n in range(rounds + 1):
            history.append({"role": "user", "content": f"first event {url} {n}: tell me a long story"})
            body = {"model": "gpt-bench", "stream": True, "input": history, **STORE_FALSE}
            started, first, events = time.perf_counter(), None, b""
            with http.stream("POST", url + "/v1/responses", json=body, headers=AUTH) as r:
                for chunk in r.iter_raw():
                    if first is None and chunk:
                        first = time.perf_counter() - started
                    events += chunk
            times.append(first)
            done = [json.loads(x[6:]) for x in events.decode().splitlines() if x.startswith("data: ")][-1]
            history += done["response"]["output"]
    return times[0], times[1:]


def direct_socket_times(url: str, rounds: int) -> tuple[float, list[float]]:
    """The same conversation on a socket of the client's own: connect and first turn, then each
    ``response.create`` with ``previous_response_id`` to the first event."""
    import websockets.sync.client

    times, previous = [], None
    started = time.perf_counter()
    with websockets.sync.client.connect(url.replace("http", "ws", 1) + "/v1/responses", additional_headers=AUTH,
                                        proxy=None) as ws:
        for n in range(rounds + 1):
            message = {"type": "response.create", "model": "gpt-bench", "input": f"direct {n}: tell me a long story",
                       **STORE_FALSE, **({"previous_response_id": previous} if previous else {})}
            if n:
                started = time.perf_counter()
            ws.send(json.dumps(message))
            times.append(None)
            while True:
                event = json.loads(ws.recv(timeout=30))
                times[-1] = times[-1] or time.perf_counter() - started
                if event["type"] == "response.completed":
                    previous = event["response"]["id"]
                    break
    return times[0], times[1:]


def websocket_first_event(quick: bool) -> list[str]:
    rounds = 5 if quick else 20
    with Emulator() as emu:
        emu.model.control({"slow_ms": 15})
        plain, streaming = start_mitmdump(emu.url, script=False), \
            start_mitmdump(emu.url, "--set", "stream_large_bodies=1", script=False)
        forward, proxy = start_mitmdump(emu.url), bridged(emu.url)
        try:
            first = {"socket": direct_socket_times(emu.url, rounds), "direct": first_event_times(emu.url, rounds),
                     "plain": first_event_times(plain.url, rounds), "streaming": first_event_times(streaming.url, rounds),
                     "http": first_event_times(forward.url, rounds), "bridge": first_event_times(proxy.url, rounds)}
        finally:
            for process in (plain, streaming, forward, proxy):
                process.stop()
    warm = {k: statistics.median(v[1]) * 1000 for k, v in first.items()}
    cold = {k: v[0] * 1000 for k, v in first.items()}
    return ["| time to first event, 15 ms between events, `store: false` | a socket of the client's own "
            "| HTTP to the upstream | plain mitmdump | plain mitmdump, streaming (`stream_large_bodies=1`) "
            "| HTTP continuation (forward mode) | HTTP client through the bridge | bridge − own socket "
            "| bridge − streaming mitmdump (target ≤ +3 ms) | bridge − HTTP continuation |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(f"| {what} | {t['socket']:.1f} ms | {t['direct']:.1f} ms | {t['plain']:.0f} ms | {t['streaming']:.1f} ms | "
              f"{t['http']:.1f} ms | {t['bridge']:.1f} ms | {t['bridge'] - t['socket']:+.1f} ms | "
              f"**{t['bridge'] - t['streaming']:+.1f} ms** | {t['bridge'] - t['http']:+.1f} ms |"
              for what, t in ((f"a conversation's later turns (median of {rounds})", warm),
                              ("its first turn (the socket opens)", cold))),
            "", "Plain mitmdump buffers an SSE answer whole (mitmproxy holds an unstreamed response until its end): its first event comes with the last. "
            "Streaming, mitmproxy's own HTTP hop is the floor of any addon; the bridge relays each event as it "
            "arrives, through it. The own socket's first turn includes its connect and upgrade, as the bridge's "
            "does."]


def direct_turns(url: str, turns: int, tag: str) -> dict[str, list[float]]:
    """The upstream alone, no proxy: a conversation continued by ``previous_response_id`` over HTTP (stored)
    and on a socket of the client's own, each turn's time to its whole answer."""
    import websockets.sync.client

    times: dict[str, list[float]] = {"direct http": [], "direct socket": []}
    body = {"model": "gpt-bench", "tools": TOOLS, "instructions": INSTRUCTIONS}
    with httpx.Client(trust_env=False, timeout=60) as http:
        previous = None
        for n in range(turns):
            data = {**body, "input": [{"role": "user", "content": f"{tag} http turn {n}"}],
                    **({"previous_response_id": previous} if previous else {})}
            started = time.perf_counter()
            r = http.post(url + "/v1/responses", json=data, headers=AUTH)
            times["direct http"].append(time.perf_counter() - started)
            previous = r.json()["id"]
    with websockets.sync.client.connect(url.replace("http", "ws", 1) + "/v1/responses", additional_headers=AUTH,
                                        proxy=None) as ws:
        previous = None
        for n in range(turns):
            message = {"type": "response.create", **body, **STORE_FALSE,
                       "input": [{"role": "user", "content": f"{tag} socket turn {n}"}],
                       **({"previous_response_id": previous} if previous else {})}
            started = time.perf_counter()
            ws.send(json.dumps(message))
            while (event := json.loads(ws.recv(timeout=30)))["type"] != "response.completed":
                pass
            times["direct socket"].append(time.perf_counter() - started)
            previous = event["response"]["id"]
    return {k: v[2:] for k, v in times.items()}


def websocket_latency(quick: bool) -> list[str]:
    """The time a request takes through each path, no uplink limit: what the bridge adds per request, next
    to what the upstream's own two transports differ by."""
    turns, rounds = (10, 3) if quick else (20, 9)
    names = ("plain", "http", "bridge")
    seconds: dict[str, list[float]] = {name: [] for name in (*names, "direct http", "direct socket")}
    with Emulator() as emu:
        proxies = {"plain": start_mitmdump(emu.url, script=False), "http": start_mitmdump(emu.url),
                   "bridge": bridged(emu.url)}
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                for n in range(rounds):
                    for name in names:  # interleaved: the machine's load falls on each alike
                        steps = list(converse(http, [proxies[name].url], turns, f"latency {name} {n}",
                                              extra=STORE_FALSE))
                        seconds[name] += [step.seconds for step in steps[2:]]  # continued turns only
                    for name, times in direct_turns(emu.url, turns, f"latency {n}").items():
                        seconds[name] += times
        finally:
            for proxy in proxies.values():
                proxy.stop()
    ms = {k: statistics.median(v) * 1000 for k, v in seconds.items()}
    upstream = ms["direct socket"] - ms["direct http"]
    return ["| a continued request, JSON, `store: false`, no uplink limit (median of "
            f"{len(seconds['bridge'])}) | plain mitmdump (full history) | HTTP continuation (forward mode) "
            "| the bridge | bridge − HTTP continuation (target ≤ +1 ms) | the upstream alone: HTTP / its socket "
            "(`previous_response_id`) | the bridge's own share (less the upstream's socket − HTTP) |",
            "|---|---|---|---|---|---|---|",
            f"| time per request | {ms['plain']:.1f} ms | {ms['http']:.1f} ms | {ms['bridge']:.1f} ms | "
            f"**{ms['bridge'] - ms['http']:+.1f} ms** | {ms['direct http']:.1f} / {ms['direct socket']:.1f} ms | "
            f"{ms['bridge'] - ms['http'] - upstream:+.1f} ms |"]


def serve_recording(ports: multiprocessing.Queue, stop: multiprocessing.synchronize.Event) -> None:
    """A WebSocket server accepting permessage-deflate that records, per data frame it receives, whether it
    came compressed (RSV1) and its bytes on the wire; ``report`` answers the records so far, anything else
    ``ok``. In a process of its own: inflating 16 MB must not hold the measured process's GIL."""
    from websockets.asyncio.server import serve
    from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
    from websockets.frames import Opcode

    logging.getLogger("websockets").setLevel(logging.CRITICAL)
    frames: list = []

    class Recording(ServerPerMessageDeflateFactory):
        def process_request_params(self, params, accepted_extensions):
            response, extension = super().process_request_params(params, accepted_extensions)
            decode = extension.decode

            def recorded(frame, **kwargs):
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                    frames.append((frame.rsv1, len(frame.data)))
                return decode(frame, **kwargs)

            extension.decode = recorded
            return response, extension

    async def handler(ws) -> None:
        async for message in ws:
            if message == "report":
                await ws.send(json.dumps(frames))
                frames.clear()
            else:
                await ws.send("ok")

    async def main() -> None:
        async with serve(handler, "127.0.0.1", 0, extensions=[Recording()], compression=None,
                         max_size=None) as server:
            ports.put(server.sockets[0].getsockname()[1])
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    asyncio.run(main())


def large_history(size: int) -> bytes:
    """A ``response.create`` of about ``size`` bytes: text turns and base64 tool outputs, as a long agent
    history holds them."""
    rng = random.Random(7)
    words = "the quick brown fox jumps over a lazy dog weather in Paris tool call result".split()
    items, total = [], 0
    while total < size:
        if rng.random() < 0.7:
            item = {"role": "user", "content": " ".join(rng.choice(words) for _ in range(200))}
        else:
            item = {"type": "function_call_output", "call_id": f"call_{len(items)}",
                    "output": rng.randbytes(3000).hex()}
        items.append(item)
        total += len(json.dumps(item))
    return json.dumps({"type": "response.create", "model": "gpt-bench", "input": items, **STORE_FALSE}).encode()


async def deflate_case(url: str, extensions, deltas: list[bytes], large: bytes,
                       whole: bool) -> tuple[int, float, int, bool]:
    """Wire bytes of ``deltas``; then the longest the event loop was held while ``large`` was sent (a 1 ms
    ticker's longest gap, less its tick), its wire bytes, and whether it went compressed. ``whole``: in one
    frame, else as the bridge sends it (``UpstreamSocket.send``: frames of 1 MB)."""
    from stateful_responses.websocket.connect import UpstreamSocket
    from websockets.asyncio.client import connect

    async with connect(url, extensions=extensions, compression="deflate" if extensions else None,
                       max_size=None, proxy=None) as ws:
        for delta in deltas:
            await ws.send(delta, text=True)
            await ws.recv()
        await ws.send("report")
        small = sum(size for _, size in json.loads(await ws.recv())) or sum(map(len, deltas))  # none: no deflate
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        await (ws.send(large, text=True) if whole else UpstreamSocket(ws).send(large))
        await ws.recv()
        done.set()
        await task
        await ws.send("report")
        sent = json.loads(await ws.recv())
    compressed, wire = (sent[0][0], sum(size for _, size in sent)) if sent else (False, len(large))
    return small, (max(gaps) - 0.001) * 1000, wire, bool(compressed)


def websocket_deflate(quick: bool) -> list[str]:
    """The event loop held by sending a 16 MB turn, and the wire bytes of small deltas: deflating every
    message (websockets' default), deflating only messages up to ``COMPRESS_UP_TO`` (the bridge), none."""
    from stateful_responses.websocket.connect import COMPRESS_UP_TO, LargeUncompressedFactory
    from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory

    rounds = 1 if quick else 3
    deltas = [json.dumps({"type": "response.create", "model": "gpt-bench", "tools": TOOLS,
                          "instructions": INSTRUCTIONS, "input": [{"role": "user", "content": f"turn {n}: go on"}],
                          "previous_response_id": f"resp_{n:032x}", **STORE_FALSE}).encode() for n in range(20)]
    large = large_history(16_000_000)
    fork = multiprocessing.get_context("fork")
    ports, stop = fork.Queue(), fork.Event()
    server = fork.Process(target=serve_recording, args=(ports, stop), daemon=True)
    server.start()
    url = f"ws://127.0.0.1:{ports.get(timeout=30)}/v1/responses"
    cases = {"every message deflated, in one frame (websockets' default, before)":
             (lambda: [ClientPerMessageDeflateFactory(compress_settings={"memLevel": 5})], True),
             f"up to {COMPRESS_UP_TO // 1024} kB deflated, larger as they are, in one frame":
             (lambda: [LargeUncompressedFactory()], True),
             f"up to {COMPRESS_UP_TO // 1024} kB deflated, larger as they are, in 1 MB frames (the bridge)":
             (lambda: [LargeUncompressedFactory()], False),
             "no permessage-deflate (declined), in one frame": (lambda: None, True),
             "no permessage-deflate (declined), in 1 MB frames (the bridge)": (lambda: None, False)}
    rows = []
    try:
        for what, (extensions, whole) in cases.items():
            runs = [asyncio.run(deflate_case(url, extensions(), deltas, large, whole)) for _ in range(rounds)]
            small, _, wire, compressed = runs[0]
            stall = statistics.median(run[1] for run in runs)
            rows.append(f"| {what} | **{stall:.0f} ms** | {wire / 1e6:.1f} MB{' (deflated)' if compressed else ''} | "
                        f"{small:,} B | {small / sum(map(len, deltas)):.2f} |")
    finally:
        stop.set()
        server.join(10)
    return [f"| permessage-deflate, a {len(large) / 1e6:.0f} MB turn and {len(deltas)} continued turns of about "
            f"{sum(map(len, deltas)) // len(deltas)} B (median of {rounds}) | event loop held while the 16 MB turn "
            "is sent | its bytes on the wire | the small turns' bytes on the wire | of their size |",
            "|---|---|---|---|---|", *rows,
            "", "Held: the longest gap of a 1 ms ticker on the sending loop (mitmproxy's, in the bridge), less its "
            "tick: every flow of the proxy waits that long. A small turn repeats the client's `instructions` "
            "and `tools`: deflate's context, kept across messages, sends them as back-references."]


class DeflateUpstream:
    """A minimal Responses WebSocket upstream that accepts permessage-deflate (the emulator declines it, as a
    server may): each ``response.create`` is answered with created and completed, echoing the previous id."""

    def __init__(self) -> None:
        import threading

        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        from websockets.asyncio.server import serve
        from websockets.exceptions import ConnectionClosed

        logging.getLogger("websockets").setLevel(logging.CRITICAL)  # the bench drops its sockets without a close

        async def answer(ws) -> None:
            with contextlib.suppress(ConnectionClosed):
                await converse_on(ws)

        async def converse_on(ws) -> None:
            async for message in ws:
                body = json.loads(message)
                response = {"id": f"resp_{random.getrandbits(128):032x}", "status": "in_progress", "output": [],
                            "previous_response_id": body.get("previous_response_id"), "store": False}
                await ws.send(json.dumps({"type": "response.created", "response": response}))
                output = [{"type": "message", "id": f"msg_{random.getrandbits(64):016x}", "status": "completed",
                           "role": "assistant", "content": [{"type": "output_text", "text": "ok " * 50}]}]
                await ws.send(json.dumps({"type": "response.completed",
                                          "response": {**response, "status": "completed", "output": output}}))

        self._stop = asyncio.get_running_loop().create_future()
        async with serve(answer, "127.0.0.1", 0, max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop

    def stop(self) -> None:
        self._stop.get_loop().call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)


def process_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def held_sockets_rss(upstream: str, sockets: int) -> float:
    """mitmdump's RSS growth per socket it holds: ``sockets`` conversations of two turns each (the second
    continued, so that each socket remembers a response), after a warm-up of 20."""
    proxy = bridged(upstream, upstream_websocket_max_sockets=sockets + 50, upstream_websocket_idle_s=3600)
    try:
        with httpx.Client(trust_env=False, timeout=60) as http:
            def conversations(tag: str, count: int) -> None:
                for n in range(count):
                    history: list = []
                    for turn in range(2):
                        history.append({"role": "user", "content": f"{tag} conversation {n} turn {turn}"})
                        r = http.post(proxy.url + "/v1/responses", headers=AUTH,
                                      json={"model": "gpt-bench", "input": history, **STORE_FALSE})
                        r.raise_for_status()
                        history += r.json()["output"]

            conversations("warm-up", 20)
            time.sleep(1)
            before = process_rss_mb(proxy.process.pid)
            conversations("held", sockets)
            time.sleep(1)
            after = process_rss_mb(proxy.process.pid)
    finally:
        output = proxy.stop()
    assert f"websocket_turns={2 * (sockets + 20)}" in output, output[-500:]
    return (after - before) * 1024 / sockets


def per_turn_rss(emu, proxy, transport: str, turns: int) -> float:
    """mitmdump's RSS growth per turn over ``turns`` turns, after a warm-up of as many: 10-turn tool-using
    conversations, ``store: false``, one after another (about 2 KB of text a turn), each turn reaching the
    emulator over ``transport``."""
    logged = len(emu.model.snapshot_log())
    try:
        with httpx.Client(trust_env=False, timeout=60) as http:
            def conversations(tag: str) -> int:
                done = 0
                while done < turns:
                    done += sum(1 for _ in converse(http, [proxy.url], 10, f"{tag} {done}", pad=2000,
                                                    extra=STORE_FALSE))
                return done

            conversations("warm-up")
            time.sleep(1)
            before = process_rss_mb(proxy.process.pid)
            measured = conversations("measured")
            time.sleep(1)
            after = process_rss_mb(proxy.process.pid)
    finally:
        proxy.stop()
    assert {r["transport"] for r in emu.model.snapshot_log()[logged:]} == {transport}
    return (after - before) * 1024 * 1024 / measured


def websocket_memory(quick: bool) -> list[str]:
    sockets = 100 if quick else 400
    turns = 500 if quick else 3000
    with Emulator() as emu:
        plain = held_sockets_rss(emu.url, sockets)
        per_turn = {"bridge": per_turn_rss(emu, bridged(emu.url), "websocket", turns),
                    "http": per_turn_rss(emu, start_mitmdump(emu.url), "http", turns)}
    upstream = DeflateUpstream()
    try:
        deflated = held_sockets_rss(upstream.url, sockets)
        library = library_memory(upstream.url, sockets)
    finally:
        upstream.stop()
    return ["| memory per held socket (mitmdump's RSS growth over "
            f"{sockets} idle sockets, each remembering a response) | per socket |", "|---|---|",
            f"| upstream declines permessage-deflate (the emulator) | {plain:.0f} kB |",
            f"| upstream accepts permessage-deflate (zlib contexts on both directions) | {deflated:.0f} kB |",
            "", f"| memory per turn (mitmdump's RSS growth over {turns:,} turns of 10-turn conversations, "
            "`store: false`, after as many to warm up) | per turn |", "|---|---|",
            f"| over the bridge's sockets (up to 32, reused) | **{per_turn['bridge']:,.0f} B** |",
            f"| HTTP continuation (forward mode) | {per_turn['http']:,.0f} B |",
            "", "Both keep what every turn leaves in the addon's bounded tables (the continuation record's chain "
            "index above all) until those fill; the bridge keeps nothing of a turn once its answer is done.",
            "", f"Libraries, {sockets} idle connections opened in one process to the deflate upstream (tracemalloc: "
            "Python allocations only): websockets' asyncio client, as the bridge uses it, "
            f"{library['websockets']:.1f} kB a connection; wsproto driven by asyncio streams, "
            f"{library['wsproto']:.1f} kB (no keepalive, close handshake or flow control of its own)."]


def library_memory(url: str, count: int) -> dict[str, float]:
    """Python allocations per idle connection: websockets' asyncio client vs wsproto over asyncio streams."""
    from stateful_responses.websocket.connect import Target, TLSOptions, open_socket
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection
    from wsproto.events import Request as Upgrade
    from wsproto.extensions import PerMessageDeflate

    host, port = url.split("//")[1].split(":")

    async def with_websockets() -> list:
        target = Target(url.replace("http", "ws", 1) + "/v1/responses", host, host, int(port), tuple(AUTH.items()))
        return [await open_socket(target, TLSOptions()) for _ in range(count)]

    async def with_wsproto() -> list:
        held = []
        for _ in range(count):
            reader, writer = await asyncio.open_connection(host, int(port))
            ws = WSConnection(ConnectionType.CLIENT)
            writer.write(ws.send(Upgrade(host=f"{host}:{port}", target="/v1/responses",
                                         extra_headers=list(AUTH.items()), extensions=[PerMessageDeflate()])))
            while not any(isinstance(e, AcceptConnection) for e in ws.events()):
                ws.receive_data(await reader.read(65536))
            held.append((reader, writer, ws))
        return held

    async def measure(opener) -> float:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        held = await opener()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        for connection in held:
            connection.abort() if hasattr(connection, "abort") else connection[1].transport.abort()
        return used / count / 1024

    return {"websockets": asyncio.run(measure(with_websockets)), "wsproto": asyncio.run(measure(with_wsproto))}


def bench_websocket(quick: bool) -> list[str]:
    """The WebSocket bridge: upstream bytes, turn time over a slow uplink, first-event time and memory,
    each side by side with HTTP continuation, plain mitmdump or a socket of the client's own."""
    rows = []
    for part in (websocket_bytes, websocket_uplink, websocket_latency, websocket_first_event, websocket_deflate,
                 websocket_memory):
        rows += part(quick) + [""]
    return rows[:-1]


def telemetry_hooks_cost(rounds: int) -> float:
    """Microseconds per request of the telemetry hooks with metrics on, in
    this process (the median over ``rounds`` batches): a continued request's
    flow through ``began``, ``request`` and ``response``."""
    from mitmproxy.test import tflow
    from stateful_responses.counters import Counters
    from stateful_responses.flows import DECISION
    from stateful_responses.telemetry.addon import Telemetry
    from stateful_responses.telemetry.metrics import Metrics

    telemetry = Telemetry(Config(), Counters(), lambda: (0, {}))
    telemetry.metrics = Metrics(telemetry.sockets)
    answer, batches, per_batch = tflow.tresp(), [], 1000
    for _ in range(rounds):
        flows = []
        for _ in range(per_batch):  # made before the clock starts: only the hooks are timed
            flow = tflow.tflow()
            flow.request.url = "https://api.openai.com/v1/responses"
            flow.request.method = "POST"
            flow.request.raw_content = b'{"model": "m", "input": "x"}'
            flows.append(flow)
        start = time.perf_counter()
        for flow in flows:
            telemetry.began(flow)
            flow.metadata[DECISION] = {"action": "continue", "items_total": 9, "items_sent": 1}
            telemetry.request(flow)
            flow.response = answer
            telemetry.response(flow)
        batches.append(time.perf_counter() - start)
    return statistics.median(batches) / per_batch * 1e6


def bench_metrics(quick: bool) -> list[str]:
    """stateful_metrics on vs off: two proxies before one emulator, the same
    conversations through each, request by request in turn."""
    from harness import free_port

    turns, rounds = (10, 4) if quick else (20, 15)
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    address = f"127.0.0.1:{free_port()}"
    with Emulator() as emu:
        proxies = {"off": start_mitmdump(emu.url), "on": start_mitmdump(emu.url, "--set", f"stateful_metrics={address}")}
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                for n in range(rounds):
                    conversations = {name: converse(http, [proxy.url], turns, f"metrics {name} {n}")
                                     for name, proxy in proxies.items()}
                    for steps in zip(*conversations.values()):  # interleaved: the machine's load falls on each alike
                        for name, step in zip(conversations, steps):
                            seconds[name].append(step.seconds)
                scraped = http.get(f"http://{address}/metrics").text
        finally:
            for proxy in proxies.values():
                proxy.stop()
    from prometheus_client.parser import text_string_to_metric_families

    added = next(f for f in text_string_to_metric_families(scraped) if f.name == "stateful_request_added_seconds")
    count = next(s.value for s in added.samples if s.name.endswith("_count"))
    total = next(s.value for s in added.samples if s.name.endswith("_sum"))
    p50 = next(float(s.labels["le"]) for s in added.samples if s.name.endswith("_bucket") and s.value >= count / 2)
    hooks = telemetry_hooks_cost(5 if quick else 21)
    ms = {k: statistics.median(v) * 1000 for k, v in seconds.items()}
    p99 = {k: percentile(v, 99) * 1000 for k, v in seconds.items()}
    return ["| requests through mitmdump with the addon (median of "
            f"{len(seconds['on'])} each, interleaved) | metrics off | metrics on | on − off (target ≤ +0.05 ms) |",
            "|---|---|---|---|",
            f"| time per request, p50 | {ms['off']:.2f} ms | {ms['on']:.2f} ms | **{ms['on'] - ms['off']:+.3f} ms** |",
            f"| time per request, p99 | {p99['off']:.2f} ms | {p99['on']:.2f} ms | {p99['on'] - p99['off']:+.3f} ms |",
            "",
            "| the telemetry hooks alone, in process | per request |",
            "|---|---|",
            f"| counting a continued request (`began`, `request`, `response`: its decision, bytes, added time) | "
            f"**{hooks:.1f} µs** |",
            "",
            f"The proxy's own time on those requests' path (`stateful_request_added_seconds` of the proxy with "
            f"metrics on, everything the addon does before a request leaves): p50 ≤ {p50 * 1000:g} ms (its "
            f"bucket), mean {total / count * 1000:.2f} ms."]
def served_socket_times(url: str, rounds: int) -> tuple[list[float], list[int]]:
    """A conversation on a socket the proxy serves: each later turn's ``response.create`` (previous_response_id +
    the new message, ``store: false``: from the socket's memory) to its first event, and each message's bytes."""
    import websockets.sync.client

    times, sizes, previous = [], [], None
    with websockets.sync.client.connect(url.replace("http", "ws", 1) + "/v1/responses", additional_headers=AUTH,
                                        proxy=None, open_timeout=60) as ws:
        for n in range(rounds + 1):
            message = json.dumps({"type": "response.create", "model": "gpt-bench", "tools": TOOLS,
                                  "input": [{"role": "user", "content": f"served {n}: tell me a long story"}],
                                  **STORE_FALSE, **({"previous_response_id": previous} if previous else {})})
            started = time.perf_counter()
            ws.send(message)
            first = None
            while True:
                event = json.loads(ws.recv(timeout=60))
                first = first or time.perf_counter() - started
                if event["type"] in ("response.completed", "error"):
                    assert event["type"] == "response.completed", event
                    previous = event["response"]["id"]
                    break
            times.append(first)
            sizes.append(len(message))
    return times[1:], sizes[1:]


def http_sse_turns(url: str, rounds: int) -> tuple[list[float], list[int]]:
    """The same conversation over HTTP, streamed, its whole history each turn (``store: false``): each later
    turn's time to its first SSE bytes, and each body's bytes."""
    history: list = []
    times, sizes = [], []
    with httpx.Client(trust_env=False, timeout=60) as http:
        for n in range(rounds + 1):
            history.append({"role": "user", "content": f"served {n}: tell me a long story"})
            body = json.dumps({"model": "gpt-bench", "stream": True, "tools": TOOLS, "input": history, **STORE_FALSE})
            started, first, events = time.perf_counter(), None, b""
            with http.stream("POST", url + "/v1/responses", content=body,
                             headers={**AUTH, "content-type": "application/json"}) as r:
                for chunk in r.iter_raw():
                    if first is None and chunk:
                        first = time.perf_counter() - started
                    events += chunk
            times.append(first)
            sizes.append(len(body))
            done = [json.loads(x[6:]) for x in events.decode().splitlines() if x.startswith("data: ")][-1]
            history += done["response"]["output"]
    return times[1:], sizes[1:]


def bench_client_websocket(quick: bool) -> list[str]:
    """The served WebSocket mode side by side with SSE through the same proxy over HTTP, interleaved round by
    round: time to first event of a conversation's later turns, and the client's uplink bytes per turn."""
    rounds, runs = (5, 3) if quick else (20, 5)
    with Emulator() as emu:
        emu.model.control({"slow_ms": 15, "websocket": "refuse"})
        proxy = start_mitmdump(emu.url, "--set", "stateful_store=memory")
        try:
            served_socket_times(proxy.url, 1)  # the verdict learned, the loopback server started
            got: dict[str, tuple[list, list]] = {"socket": ([], []), "http": ([], [])}
            for _ in range(runs):
                for name, fn in (("socket", served_socket_times), ("http", http_sse_turns)):
                    times, sizes = fn(proxy.url, rounds)
                    got[name][0].extend(times)
                    got[name][1].extend(sizes)
        finally:
            proxy.stop()
    first = {k: statistics.median(v[0]) * 1000 for k, v in got.items()}
    p90 = {k: percentile(v[0], 90) * 1000 for k, v in got.items()}
    sent = {k: statistics.mean(v[1]) for k, v in got.items()}
    return ["| later turns of a conversation, `store: false`, 15 ms between events (median of "
            f"{rounds * runs}) | SSE through the proxy over HTTP | the proxy's socket | socket − HTTP (target ≤ +2 ms) |",
            "|---|---|---|---|",
            f"| time to first event, median | {first['http']:.1f} ms | {first['socket']:.1f} ms | "
            f"**{first['socket'] - first['http']:+.1f} ms** |",
            f"| time to first event, p90 | {p90['http']:.1f} ms | {p90['socket']:.1f} ms | "
            f"{p90['socket'] - p90['http']:+.1f} ms |",
            f"| client uplink bytes per turn ({rounds}-turn conversations, mean) | {sent['http']:,.0f} B "
            f"(its whole history) | {sent['socket']:,.0f} B (`previous_response_id` + the new message) | "
            f"{sent['socket'] / sent['http']:.2f}× |",
            "", "Both go upstream as the same HTTP request (the socket's turn is expanded from its memory and sent "
            "through mitmproxy's pipeline as a client replay); the socket's extra hop is the loopback server."]


def bench_storage(quick: bool) -> list[str]:
    return asyncio.run(storage_scale(20_000 if quick else 1_000_000, quick))


BENCHES = {"bytes": bench_bytes, "uplink": bench_uplink, "tax": bench_tax, "plan": bench_plan, "sse": bench_sse,
           "memory": bench_memory, "stores": bench_stores, "agents": bench_agents, "record": bench_record,
           "seal": bench_seal, "conversation": bench_conversation, "websocket": bench_websocket,
           "storage": bench_storage, "metrics": bench_metrics,
           "storage": bench_storage, "client_websocket": bench_client_websocket,
           **{part.__name__: part for part in (websocket_bytes, websocket_uplink, websocket_latency,
                                               websocket_first_event, websocket_deflate, websocket_memory)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer turns and rounds (a smoke run)")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=list(BENCHES))
    args = parser.parse_args()
    import mitmproxy.version

    print(f"# stateful-responses benchmarks, {time.strftime('%Y-%m-%d')}\n")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}; "
          f"Python {platform.python_version()}, mitmproxy {mitmproxy.version.VERSION}"
          f"{' (quick run)' if args.quick else ''}.\n")
    started = time.monotonic()
    for name in args.only:
        print(f"## {name}\n")
        print("\n".join(BENCHES[name](args.quick)))
        print(flush=True)
    # Other work on a shared machine moves the timings: say how busy it was.
    print(f"Run time {(time.monotonic() - started) / 60:.1f} min; load average at the end (1, 5, 15 min): "
          + ", ".join(f"{load:.2f}" for load in os.getloadavg()) + ".")


if __name__ == "__main__":
    main()
