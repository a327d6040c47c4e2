"""Benchmarks, measured side by side in one run and reported as ratios.

  bytes    upstream bytes over N-turn tool-using conversations, against full
           replay and against the delta-only limit
  tax      wall time through mitmdump with the addon vs without, where it
           cannot help (a stateless upstream, 20 KB turns)
  plan     planning cost vs a bare json.loads of the same bytes
  sse      time to first event and whole-stream time: addon vs plain mitmdump
           (and the upstream reached directly)
  memory   RSS of the planner over 10,000 requests across 1,000 conversations

``scripts/bench [--quick] [--only NAME ...]``; results go to stdout as Markdown.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from driver import httpx  # noqa: E402
from harness import start_mitmdump  # noqa: E402
from stateful_responses.emulator import Emulator  # noqa: E402
from stateful_responses.planner import Planner, Request  # noqa: E402
from stateful_responses.settings import Settings  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
INSTRUCTIONS = "You are a careful assistant. " * 20
AUTH = {"authorization": "Bearer sk-bench"}


def converse(http, url: str, turns: int, tag: str, pad: int = 0, stream: bool = False):
    """One tool-using conversation; yields after every request (body bytes, new items)."""
    history: list = []
    for n in range(turns):
        text = f"{tag} turn {n} " + ("x" * pad)
        if n % 3 == 1:
            text += f' call:get_weather({{"city": "C{n}"}})'
        new = [{"role": "user", "content": text}]
        while True:
            body = {"model": "gpt-bench", "input": history + new, "tools": TOOLS, "instructions": INSTRUCTIONS}
            if stream:
                body["stream"] = True
            data = json.dumps(body).encode()
            r = http.post(url + "/v1/responses", content=data, headers={**AUTH, "content-type": "application/json"})
            r.raise_for_status()
            if stream:
                events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
                output = events[-1]["response"]["output"]
            else:
                output = r.json()["output"]
            yield len(data), new
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


def bench_bytes(quick: bool) -> list[str]:
    rows = ["| conversation | requests | full replay | through the addon | delta-only limit | addon / full | addon / limit |",
            "|---|---|---|---|---|---|---|"]
    cases = [(10, 1), (50, 1), (50 if quick else 200, 1), (10 if quick else 25, 8)]
    for turns, parallel in cases:
        name = f"{parallel} interleaved × {turns} turns" if parallel > 1 else f"{turns} turns"
        with Emulator() as emu:
            proxy = start_mitmdump(emu.url)
            full = limit = requests = 0
            try:
                with httpx.Client(trust_env=False, timeout=60) as http:
                    # round-robin, one request of each conversation at a time
                    active = [(converse(http, proxy.url, turns, f"user{u}"), [True]) for u in range(parallel)]
                    while active:
                        for conv, first in list(active):
                            try:
                                size, new = next(conv)
                            except StopIteration:
                                active.remove((conv, first))
                                continue
                            full += size
                            limit += limit_bytes(new, first[0])
                            first[0] = False
                            requests += 1
            finally:
                proxy.stop()
            upstream = sum(r["body_bytes"] for r in emu.model.snapshot_log())
        rows.append(f"| {name} | {requests} | {full:,} B | {upstream:,} B | {limit:,} B | "
                    f"{upstream / full:.3f} | {upstream / limit:.2f} |")
    return rows


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
                    return lambda: sum(1 for _ in converse(http, url, turns, "tax", pad=20_000))
                run(with_addon.url)()  # warm-up; also lets the addon find the upstream unsupported
                med = timed_runs({"addon": run(with_addon.url), "plain": run(plain.url)}, 3 if quick else 7)
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
    request = Request("POST", url, AUTH, body)
    assert warm.plan(request).action == "continue"
    med = timed_runs({
        "loads": lambda: json.loads(body),
        "loop": lambda: warm.plan(request),
        "cold": lambda: Planner().plan(request),
    }, rounds)
    return (f"| {len(body) / 1e6:.1f} MB | {count} | {med['loads'] * 1000:.2f} ms | {med['loop'] * 1000:.2f} ms | "
            f"{med['loop'] / med['loads']:.2f} | {med['cold'] * 1000:.2f} ms | {med['cold'] / med['loads']:.2f} |")


def bench_plan(quick: bool) -> list[str]:
    rows = ["| body | items | json.loads | plan, agent loop (earlier items seen) | ratio (target ≤ 1.5) | plan, cold | ratio |",
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
    planner = Planner(Settings(max_chains=256))
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
        history += output + [{"role": "user", "content": f"turn {n} " + "u" * pad}]
        if (n + 1) % (requests // 10) == 0:
            gc.collect()
            live = sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(ours).statistics("filename"))
            samples.append((n + 1, live / 2**20, rss_mb() - base, planner.store.branch_count, len(planner.store),
                            len(planner.digests)))
    tracemalloc.stop()
    rows = ["| requests | planner's live memory | process RSS growth (incl. the client's own histories) "
            "| branches (bound 256) | stored entries | cached items |", "|---|---|---|---|---|---|"]
    rows += [f"| {n:,} | {live:.1f} MB | {mb:.1f} MB | {b} | {e} | {i:,} |" for n, live, mb, b, e, i in samples]
    rows.append(f"\n{conversations} conversations round-robin, {requests // conversations} turns each, items of about 1.6 KB. The planner's "
                "live memory is what tracemalloc finds allocated by the addon's code and still held. Two bounds "
                "hold the planner's memory: branches (`stateful_max_chains`, each at most 128 small entries) and "
                "the byte-keyed item cache (32 MB of item bytes, two generations).")
    return rows


BENCHES = {"bytes": bench_bytes, "tax": bench_tax, "plan": bench_plan, "sse": bench_sse, "memory": bench_memory}


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
    for name in args.only:
        print(f"## {name}\n")
        print("\n".join(BENCHES[name](args.quick)))
        print(flush=True)


if __name__ == "__main__":
    main()
