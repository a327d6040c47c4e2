"""The demo: emulator + mitmdump with the addon + the real openai SDK.

1. Forward mode: a multi-turn, tool-using conversation (half the turns
   streamed), then, per request, what the client sent against what reached
   the upstream, whether the addon continued it or sent it full, and why.
2. State that outlives the process: mitmdump restarts, and the conversation's
   next request still continues (from the SQLite store in the confdir).
3. Store emulation: the upstream now stores nothing, and a client that keeps
   state with previous_response_id still gets its whole context.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from driver import ChainedConversation, Conversation, user_turns, without_comparisons  # noqa: E402
from harness import Proxy, free_port, mitmdump_args, wait_listening  # noqa: E402
from mitmproxy import io as flow_io  # noqa: E402


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="stateful-demo-"))
    try:
        forward_mode_and_restart(work, int(os.environ.get("DEMO_TURNS", "8")))
        emulation(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def forward_mode_and_restart(work: Path, turns: int) -> None:
    emulator, emu_port = emulator_process()
    proxy = started(emu_port, work, "-w", str(work / "flows"))
    try:
        print(f"emulator on 127.0.0.1:{emu_port}, mitmdump with the addon on 127.0.0.1:{proxy.port}")
        print(f"1. {turns} user turns through the openai SDK, tool calls every third turn, odd turns streamed\n")
        conv = Conversation(proxy.url)
        turn_of_request = []
        for n, text in enumerate(user_turns(turns)):
            conv.stream = n % 2 == 1
            made = conv.turn(text)
            turn_of_request += [(n + 1, conv.stream)] * made
        conv.close()
        everything = log(emu_port)
        upstream = without_comparisons(everything)  # the client's requests, not the proxy's own comparisons
        compared = sum(r["body_bytes"] for r in everything if "context" in r and r not in upstream)
        proxy.stop()  # the flows file is complete
        print_table(work, conv, upstream, turn_of_request, compared)
        after_restart(emu_port, work, conv)
    finally:
        proxy.stop()
        emulator.terminate()
        emulator.wait(10)


def print_table(work: Path, conv: Conversation, upstream: list[dict], turn_of_request: list, compared: int) -> None:
    with open(work / "flows", "rb") as f:
        decisions = [fl.metadata.get("stateful", {}) for fl in flow_io.FlowReader(f).stream()
                     if fl.request.path.endswith("/responses") and not fl.is_replay]  # the client's flows

    header = f"{'turn':>4} {'req':>3} {'mode':<4} {'client items':>12} {'client bytes':>12} " \
             f"{'sent items':>10} {'sent bytes':>10}  decision"
    print(header)
    print("-" * len(header))
    totals = [0, 0]
    for i, (sent, seen, decision) in enumerate(zip(conv.sent, upstream, decisions, strict=True)):
        turn, streamed = turn_of_request[i]
        action = decision.get("action", "?")
        why = decision.get("reason", "")
        if action == "continue":
            why = f"continued from {decision.get('previous_response_id', '')[:14]}…"
        totals[0] += sent.size
        totals[1] += seen["body_bytes"]
        print(f"{turn:>4} {i + 1:>3} {'sse' if streamed else 'json':<4} {len(sent.body['input']):>12} "
              f"{sent.size:>12} {seen['input_items']:>10} {seen['body_bytes']:>10}  {action}: {why}")
    continued = sum(1 for d in decisions if d.get("action") == "continue")
    print("-" * len(header))
    print(f"{len(conv.sent)} requests, {continued} continued; client sent {totals[0]:,} bytes, "
          f"upstream received {totals[1]:,} bytes ({totals[1] / totals[0]:.1%} of full replay)")
    if compared:  # the usage proof: the first continuation holding a new item kind, also sent whole once
        print(f"plus {compared:,} bytes the proxy sent once to compare a continuation with the same turn sent whole "
              f"({(totals[1] + compared) / totals[0]:.1%} in all)")
    ok = all(r.get("status_code") == 200 for r in upstream)
    print("every answer reached the client:", "yes" if ok else "NO")


def started(emu_port: int, work: Path, *extra: str) -> Proxy:
    port = free_port()
    args = mitmdump_args(f"reverse:http://127.0.0.1:{emu_port}", port, str(work), *extra)
    return Proxy(args, port, str(work)).ready()


def emulator_process() -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "stateful_responses.emulator", "--port", str(port)],
                               cwd=ROOT / "addon", stdout=subprocess.DEVNULL)
    wait_listening(port, process, "emulator")
    return process, port


def log(emu_port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{emu_port}/_emulator/log") as r:
        return json.load(r)


def after_restart(emu_port: int, work: Path, conv: Conversation) -> None:
    """A new mitmdump on the same confdir: the next turn continues anyway."""
    print("\n2. mitmdump restarts (same confdir, so the same SQLite store); the conversation goes on")
    proxy = started(emu_port, work)
    try:
        conv = Conversation(f"http://127.0.0.1:{proxy.port}", history=list(conv.history))
        conv.turn("one more question after the restart")
        conv.close()
        seen = log(emu_port)[-1]
        print(f"   the first request after the restart: {len(conv.sent[-1].body['input'])} items from the client, "
              f"{seen['input_items']} sent upstream ({'continued' if seen['continued'] else 'sent full'})")
    finally:
        proxy.stop()


def emulation(work: Path) -> None:
    print("\n3. the upstream stores nothing (as Ollama or llama.cpp); a client chains with previous_response_id")
    emulator, emu_port = emulator_process()
    control = urllib.request.Request(f"http://127.0.0.1:{emu_port}/_emulator/control",
                                     data=json.dumps({"stateless": "reject"}).encode(), method="POST")
    urllib.request.urlopen(control).close()
    (work / "emulation").mkdir()
    proxy = started(emu_port, work / "emulation", "--set", "stateful_emulate=always")
    try:
        conv = ChainedConversation(f"http://127.0.0.1:{proxy.port}")
        for text in ("my name is Ada", "what did I just tell you?", "and before that?"):
            conv.turn(text)
        conv.close()
        for n, (sent, seen) in enumerate(zip(conv.sent, log(emu_port), strict=True)):
            print(f"   request {n + 1}: the client sent {len(sent.body['input'])} item(s)"
                  f"{' + previous_response_id' if sent.body.get('previous_response_id') else ''}; "
                  f"the upstream saw {len(seen['context'])} items, its whole chain")
    finally:
        proxy.stop()
        emulator.terminate()
        emulator.wait(10)


if __name__ == "__main__":
    main()
