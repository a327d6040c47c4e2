"""The continuation record (issue 12, seed 003) through real mitmdump: every
LLM API flow gets the seed's record and a mapping audit, in flow.metadata, in
flows saved with -w, in the record file, and as a chain tag in its comment."""

from __future__ import annotations

import json
import time

from driver import ChainedConversation, Conversation, httpx, user_turns
from mitmproxy import flowfilter, io

SEED_KEYS = {"chainId", "previousTurnId", "resumeFrom", "stickyScope", "stateOrigin", "restored",
             "toolContinuation", "protocolHints", "turnId"}


def wait_for_lines(path, count: int, timeout: float = 10) -> None:
    """Until the record file holds ``count`` lines: every flow's answer is in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the record file has not reached {count} lines")


def saved_flows(path) -> list:
    with open(path, "rb") as f:
        return [flow for flow in io.FlowReader(f).stream() if "continuation" in flow.metadata]


def test_a_full_history_conversation_is_one_chain_turn_by_turn(emulator, start_proxy, tmp_path):
    flows_file, record_file = tmp_path / "flows", tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "-w", str(flows_file), "--set", f"stateful_record_file={record_file}")
    conv = Conversation(proxy.url)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    wait_for_lines(record_file, len(conv.sent))
    proxy.stop()
    flows = saved_flows(flows_file)
    records = [f.metadata["continuation"] for f in flows]
    assert len(records) == len(conv.sent) and all(set(r) == SEED_KEYS for r in records)
    assert len({r["chainId"] for r in records}) == 1
    assert records[0]["previousTurnId"] is None and records[0]["stickyScope"] == "request"
    for before, after in zip(records, records[1:], strict=False):
        assert after["previousTurnId"] == before["turnId"]
        assert after["stickyScope"] == "request_chain" and after["restored"] is True  # continued upstream
        assert after["resumeFrom"]["turnId"] == before["turnId"]
    tool_turn = next(r for r in records if r["toolContinuation"]["pendingToolCallIds"])
    answer_turn = records[records.index(tool_turn) + 1]
    assert answer_turn["toolContinuation"]["submittedToolCallIds"] == tool_turn["toolContinuation"]["pendingToolCallIds"]
    assert answer_turn["stateOrigin"] == "tool-loop" and answer_turn["toolContinuation"]["mode"] == "tool_outputs"
    assert all(o.keys() == {"callId", "name", "bytes", "digest"}
               for o in answer_turn["toolContinuation"]["resumeOutputs"])
    audits = [f.metadata["audit"]["protocolMapping"] for f in flows]
    assert any(e["field"] == "store" for e in audits[0]["lossy"])  # the forced store
    assert all(any(e["field"] == "input" and e["source"] == "proxy" for e in a["preserved"]) for a in audits[1:])
    tag = "chain:" + records[0]["chainId"].rsplit("_", 1)[-1][:8]
    only_this = flowfilter.parse(f"~comment {tag}")
    assert all(only_this(f) for f in flows) and all(f.comment.startswith(tag) for f in flows)
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert [line["continuation"]["turnId"] for line in lines] == [r["turnId"] for r in records]
    assert {line["protocol"] for line in lines} == {"openai-responses"}
    assert all(line.keys() == {"flow", "time", "protocol", "model", "continuation", "audit"} for line in lines)
    text = record_file.read_text()
    assert "turn 0" not in text and "temp_c" not in text  # no prompt text, no tool result


def test_conversations_forks_and_previous_response_id_chains(emulator, start_proxy, tmp_path):
    flows_file, record_file = tmp_path / "flows", tmp_path / "records.jsonl"
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "-w", str(flows_file), "--set", "stateful_emulate=always",
                        "--set", f"stateful_record_file={record_file}")
    one, two = ChainedConversation(proxy.url), ChainedConversation(proxy.url)
    for n in range(3):
        one.turn(f"first conversation {n}")
        two.turn(f"second conversation {n}")
    fork_from = one.previous
    one.turn("first conversation, one more")
    with httpx.Client(trust_env=False, timeout=30) as c:  # regenerate from the same answer: a fork
        forked = c.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-test-key"},
                        json={"model": "gpt-test", "input": "another direction", "previous_response_id": fork_from})
        assert forked.status_code == 200
    one.close()
    two.close()
    wait_for_lines(record_file, 8)
    proxy.stop()
    records = [f.metadata["continuation"] for f in saved_flows(flows_file)]
    first = [r for r in records[:-1] if r["chainId"] == records[0]["chainId"]]
    second = [r for r in records if r["chainId"] == records[1]["chainId"]]
    assert len(first) == 4 and len(second) == 3  # two conversations, never one chain
    assert all(r["resumeFrom"]["previousResponseId"] for r in first[1:])
    fork = records[-1]
    assert fork["chainId"] not in (records[0]["chainId"], records[1]["chainId"])
    assert fork["resumeFrom"]["responseId"] == fork_from and fork["resumeFrom"]["turnId"] == first[2]["turnId"]
    audits = [f.metadata["audit"]["protocolMapping"] for f in saved_flows(flows_file)]
    assert all(any(e["field"] == "previous_response_id" for e in a["dropped"]) for a in audits[2:])


def test_records_survive_a_restart_and_the_file_keeps_appending(emulator, start_proxy, tmp_path):
    record_file = tmp_path / "records.jsonl"
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}", confdir=confdir)
    conv = Conversation(proxy.url)
    for text in user_turns(2):
        conv.turn(text)
    wait_for_lines(record_file, len(conv.sent))
    proxy.stop()
    start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}", confdir=confdir, port=proxy.port)
    conv.turn("after the restart")
    conv.close()
    wait_for_lines(record_file, len(conv.sent))
    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert len({line["continuation"]["chainId"] for line in lines}) == 1  # the chain outlived the process
    assert lines[-1]["continuation"]["previousTurnId"] == lines[-2]["continuation"]["turnId"]
