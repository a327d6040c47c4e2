"""The TypeScript SDKs, run on the machine's Node.js through a real mitmdump in
front of the emulator: Vercel's AI SDK (its Responses provider echoes earlier
assistant messages and reasoning items as ``item_reference``) and OpenAI's
Agents SDK. The drivers in ``tests/node`` record every request body before it
leaves the client. For every conversation: the context the upstream saw is
what the client meant, every request after the first is continued, and the
upstream bytes stay within 1.05x of the delta-only limit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import npm_installed
from driver import drop_nulls, expand_input, meaning, without_comparisons

NODE_DIR = Path(__file__).with_name("node")
TURNS = 12  # 12 user turns, 4 of them with a tool call: 16 requests
MAX_BYTES_RATIO = 1.05


@pytest.fixture(scope="session")
def node_clients() -> Path:
    """``tests/node`` with its locked packages installed by ``npm ci``, once a
    session. Skips when Node.js is missing or the npm registry is unreachable;
    any other install failure is an error."""
    return npm_installed(NODE_DIR)


def run_driver(node_dir: Path, script: str, proxy, *options: str) -> dict:
    """One conversation with a Node driver against the proxy; its report
    (``requests`` as the client sent them, ``answers`` as it received them)."""
    result = subprocess.run(["node", script, proxy.url + "/v1", "--turns", str(TURNS), *options],
                            cwd=node_dir, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}\nmitmdump:\n{proxy.output()[-2000:]}"
    return json.loads(result.stdout)


def client_contexts(requests: list[dict], log: list[dict]) -> list[list]:
    """What each request meant: its input with every ``item_reference``
    replaced by the output item of that id the upstream returned earlier in
    the conversation. Resolved here from the upstream's answers, independently
    of the addon and of the emulator's own resolution."""
    returned: dict[str, dict] = {}
    contexts = []
    for request, record in zip(requests, log, strict=True):
        context = []
        for item in expand_input(request["body"]["input"]):
            if item.get("type") == "item_reference":
                assert item["id"] in returned, f"a reference to an item never returned: {item['id']}"
                item = returned[item["id"]]
            context.append(item)
        contexts.append(context)
        returned.update((item["id"], item) for item in record["output"])
    return contexts


def compact_size(body: dict) -> int:
    """Bytes of ``body`` written as JSON.stringify writes it."""
    return len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode())


def delta_only_bytes(requests: list[dict], contexts: list[list], log: list[dict]) -> int:
    """The delta-only limit, as scripts/bench.py defines it: what the client
    would send had it chained with ``previous_response_id`` itself, each body
    as sent but with only the items after the stored prefix (the previous
    request's context and its output) plus that response's id."""
    total = requests[0]["bytes"]
    for n in range(1, len(requests)):
        stored = contexts[n - 1] + log[n - 1]["output"]
        assert meaning(contexts[n][:len(stored)]) == meaning(stored), \
            f"request {n} does not extend the previous request and its answer"
        body = requests[n]["body"]
        total += compact_size({**body, "input": body["input"][len(stored):],
                               "previous_response_id": log[n - 1]["response_id"]})
    return total


def final_answers(log: list[dict]) -> list[str]:
    """The text of each turn's last answer: the output messages, in order."""
    return [part["text"] for record in log for item in record["output"] if item["type"] == "message"
            for part in item["content"]]


def check_conversation(request, report: dict, log: list[dict], reshaped: bool) -> None:
    """The context on every request: exactly the client's, nulls aside (or in
    meaning, for a client that re-shapes the items it echoes); then the
    continuation rate and the bytes ratio, both printed in the failure message."""
    same = meaning if reshaped else drop_nulls
    requests = report["requests"]
    assert len(requests) == len(log) >= TURNS + TURNS // 3, (len(requests), len(log))
    contexts = client_contexts(requests, log)
    for n, (client, context, record) in enumerate(zip(requests, contexts, log, strict=True)):
        assert same(record["context"]) == same(context), f"request {n}: upstream context differs from the client's"
        assert record["instructions"] == client["body"].get("instructions"), f"request {n}: instructions differ"
    assert report["answers"] == final_answers(log), "the client did not receive the upstream's answers"

    rate = sum(1 for record in log[1:] if record["continued"]) / (len(log) - 1)
    ratio = sum(record["body_bytes"] for record in log) / delta_only_bytes(requests, contexts, log)
    request.node.user_properties += [("continuation_rate", rate), ("bytes_vs_delta_only", ratio)]
    measured = (f"{request.node.name}: {len(log)} requests, {rate:.0%} of those after the first continued, "
                f"upstream bytes {ratio:.2f}x the delta-only limit")
    print("\n" + measured)
    assert rate == 1 and ratio <= MAX_BYTES_RATIO, measured


@pytest.mark.parametrize("reasoning", [False, True], ids=["gpt-test", "gpt-5-mini-reasoning"])
@pytest.mark.parametrize("stream", [False, True], ids=["generateText", "streamText"])
def test_vercel_ai_sdk(node_clients, proxy, emulator, stream, reasoning, request):
    options = ["--stream"] if stream else []
    if reasoning:  # a reasoning model: reasoning items come back, and are echoed by reference too
        options += ["--model", "gpt-5-mini", "--reasoning-effort", "low"]
    report = run_driver(node_clients, "ai_sdk_conversation.mjs", proxy, *options)
    log = without_comparisons(emulator.model.snapshot_log())  # the client's requests, not the proxy's comparisons
    references = [sum(1 for item in r["body"]["input"] if item.get("type") == "item_reference")
                  for r in report["requests"]]
    assert all(references[1:]), f"the AI SDK echoed output by content, not by reference: {references}"
    # it echoes a function call without its id and status, the arguments re-serialized
    check_conversation(request, report, log, reshaped=True)


@pytest.mark.parametrize("stream", [False, True], ids=["run", "stream"])
def test_openai_agents_js(node_clients, proxy, emulator, stream, request):
    report = run_driver(node_clients, "openai_agents_conversation.mjs", proxy, *(["--stream"] if stream else []))
    log = without_comparisons(emulator.model.snapshot_log())  # the client's requests, not the proxy's comparisons
    assert not any("previous_response_id" in r["body"] for r in report["requests"]), \
        "@openai/agents chained with previous_response_id itself: the addon passes such requests untouched"
    check_conversation(request, report, log, reshaped=False)
