"""The demo: emulator + mitmdump with the addon + the real openai SDK.

Drives a multi-turn, tool-using conversation (half the turns streamed), then
prints, per request, what the client sent against what reached the upstream,
and whether the addon continued it or sent it full, and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "addon"), str(ROOT / "tests")]

from driver import Conversation, user_turns  # noqa: E402
from harness import Proxy, free_port, mitmdump_args, wait_listening  # noqa: E402
from mitmproxy import io as flow_io  # noqa: E402


def main() -> None:
    turns = int(os.environ.get("DEMO_TURNS", "8"))
    work = Path(tempfile.mkdtemp(prefix="stateful-demo-"))
    emu_port, proxy_port = free_port(), free_port()
    emulator = subprocess.Popen(
        [sys.executable, "-m", "stateful_responses.emulator", "--port", str(emu_port)],
        cwd=ROOT / "addon", stdout=subprocess.DEVNULL,
    )
    proxy = Proxy(mitmdump_args(f"reverse:http://127.0.0.1:{emu_port}", proxy_port, str(work),
                                "-w", str(work / "flows")), proxy_port, str(work))
    try:
        wait_listening(emu_port, emulator, "emulator")
        proxy.wait_ready()
        print(f"emulator on 127.0.0.1:{emu_port}, mitmdump with the addon on 127.0.0.1:{proxy_port}")
        print(f"conversation: {turns} user turns through the openai SDK, tool calls every third turn, "
              "odd turns streamed\n")
        conv = Conversation(f"http://127.0.0.1:{proxy_port}")
        turn_of_request = []
        for n, text in enumerate(user_turns(turns)):
            conv.stream = n % 2 == 1
            made = conv.turn(text)
            turn_of_request += [(n + 1, conv.stream)] * made
        conv.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{emu_port}/_emulator/log") as r:
            upstream = json.load(r)
    finally:
        proxy.stop()
        emulator.terminate()
        emulator.wait(10)
    with open(work / "flows", "rb") as f:
        decisions = [fl.metadata.get("stateful", {}) for fl in flow_io.FlowReader(f).stream()
                     if fl.request.path.endswith("/responses")]

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
    ok = all(r.get("status_code") == 200 for r in upstream)
    print("every answer reached the client:", "yes" if ok else "NO")


if __name__ == "__main__":
    main()
