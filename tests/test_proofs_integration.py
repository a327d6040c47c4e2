"""What the addon asks an upstream before relying on it, through real mitmdump
in front of the emulator and its faults, driven by the real openai SDK: a
GET of a stored response that fails or is slow, an upstream that stores but
ignores ``previous_response_id`` and cannot list input items, and store
emulation's always mode, where no continuation the upstream has not shown it
honours decides a client's answer. Every test checks what the upstream saw,
request by request, and which requests were continued."""

from __future__ import annotations

import json
import time

import pytest
from driver import ChainedConversation, Conversation, assert_context_preserved, drop_nulls, expand_input

TEXTS = [f"turn {n}: tell me something about the number {n}." for n in range(5)]
# An upstream that stores and reads responses back, but answers a previous_response_id from the input
# alone, echoes it in another spelling and has no listing of input items: nothing can show it ignored it.
IGNORES_UNSEEN = {"ignore_previous": True, "echo_previous": "respelled", "input_items": "absent"}


def creates(emulator) -> list[dict]:
    return [r for r in emulator.model.snapshot_log() if r["protocol"] == "openai-responses"]


def sent_previous(log: list[dict]) -> list[bool]:
    """Which requests went upstream as continuations."""
    return [r["previous_response_id"] is not None for r in log]


def full_history_turns(proxy, emulator, stream: bool) -> tuple[Conversation, list[dict]]:
    """A full-history client's turns through ``proxy``; what the upstream was asked to create."""
    conv = Conversation(proxy.url, stream=stream)
    for text in TEXTS:
        conv.turn(text)
    conv.close()
    return conv, creates(emulator)


def retrieve_fault(kind: str, **fault) -> dict:
    return {"kind": kind, "endpoint": "retrieve", **fault}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_proof_answered_5xx_leaves_the_upstream_unproven_and_full_history_goes(emulator, start_proxy, stream):
    emulator.model.control({"fail_next": [retrieve_fault("status", status=503), retrieve_fault("status", status=503)]})
    proxy = start_proxy(emulator.url)
    conv, log = full_history_turns(proxy, emulator, stream)
    assert_context_preserved(conv.sent, log)
    assert sent_previous(log) == [False] * 5  # unproven: nothing continued
    assert emulator.model.faults.next == [retrieve_fault("status", status=503)]  # one GET: the next waits 30 s
    assert "internal error" not in proxy.output()


def test_a_slow_proof_delays_one_answer_by_two_seconds_at_most_and_its_verdict_counts_once_it_comes(
        emulator, start_proxy):
    emulator.model.control({"fail_next": [retrieve_fault("stall", ms=6000)]})
    proxy = start_proxy(emulator.url)
    conv = Conversation(proxy.url)
    started = time.monotonic()
    conv.turn(TEXTS[0])  # its answer's end waits for the proof: two seconds at most
    first = time.monotonic() - started
    conv.turn(TEXTS[1])  # planned at once, full: the proof has had its two seconds
    second = time.monotonic() - started - first
    time.sleep(max(0.0, started + 6.5 - time.monotonic()))  # the GET's answer came meanwhile
    for text in TEXTS[2:]:
        conv.turn(text)
    conv.close()
    log = creates(emulator)
    assert_context_preserved(conv.sent, log)
    assert sent_previous(log) == [False, False, True, True, True]
    # waiting for the GET's answer would take 6 s: bounds far from it, which no load on the machine blurs
    assert 2 <= first < 5 and second < 3, (first, second)


def test_a_proof_unanswered_for_10_s_is_given_up(emulator, start_proxy):
    emulator.model.control({"fail_next": [retrieve_fault("stall", ms=12_000)]})
    proxy = start_proxy(emulator.url)
    conv = Conversation(proxy.url)
    started = time.monotonic()
    conv.turn(TEXTS[0])
    conv.turn(TEXTS[1])
    time.sleep(max(0.0, started + 13 - time.monotonic()))  # the upstream answered at 12 s: to nobody
    for text in TEXTS[2:]:
        conv.turn(text)
    conv.close()
    log = creates(emulator)
    assert_context_preserved(conv.sent, log)
    assert sent_previous(log) == [False] * 5  # unproven until a later answer tries again, 30 s on
    assert "internal error" not in proxy.output()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("faults", "said"), [
    (IGNORES_UNSEEN, "input items cannot be listed"),
    ({**IGNORES_UNSEEN, "echo_previous": False}, "input items cannot be listed"),
    ({"ignore_previous": True, "echo_previous": False}, "answered a previous_response_id from the items sent alone"),
], ids=["respelled-no-listing", "no-echo-no-listing", "no-echo-listed"])
def test_an_upstream_that_ignores_the_field_unseen_by_its_echo_costs_one_turn_then_gets_full_history(
        emulator, start_proxy, stream, faults, said):
    emulator.model.control(faults)
    proxy = start_proxy(emulator.url)
    conv, log = full_history_turns(proxy, emulator, stream)
    assert sent_previous(log) == [False, True, False, False, False]
    # the one continued turn is answered from the items sent alone (docs/reliability.md, known limits) ...
    assert drop_nulls(log[1]["context"]) == drop_nulls(expand_input(conv.sent[1].body["input"][-1:]))
    # ... and its echo, which no listing can settle, stops every later continuation: full history, exact
    assert_context_preserved(conv.sent[2:], log[2:])
    assert_context_preserved(conv.sent[:1], log[:1])
    assert said in proxy.output()


def always(emulator, start_proxy, tmp_path, stream: bool,
           faults: dict | None = None) -> tuple[ChainedConversation, list, str, list]:
    """A previous_response_id client through store emulation's always mode;
    what it meant, what the upstream saw, mitmdump's output, and the
    continuation record's audit of each turn."""
    if faults:
        emulator.model.control(faults)
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true",
                        "--set", f"stateful_record_file={record_file}")
    conv = ChainedConversation(proxy.url, stream=stream)
    for text in TEXTS:
        conv.turn(text)
    conv.close()
    output = proxy.stop()
    audits = [json.loads(line)["audit"]["protocolMapping"] for line in record_file.read_text().splitlines()]
    return conv, creates(emulator), output, audits


def assert_saw(meant: list[list], seen: list[dict]) -> None:
    assert len(seen) == len(meant), (len(seen), len(meant))
    for n, (items, record) in enumerate(zip(meant, seen, strict=True)):
        assert drop_nulls(record["context"]) == drop_nulls(expand_input(items)), f"request {n}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_always_mode_checks_its_first_continuation_and_keeps_it_where_the_upstream_honours_the_field(
        emulator, start_proxy, tmp_path, stream):
    conv, log, output, _ = always(emulator, start_proxy, tmp_path, stream)
    assert_saw(conv.meant, log)
    assert sent_previous(log) == [False, True, True, True, True]
    assert "retrying with the original body" not in output and "internal error" not in output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_always_mode_keeps_a_checked_continuation_whose_input_items_show_the_chain(emulator, start_proxy, tmp_path,
                                                                                   stream):
    respelled = {"echo_previous": "respelled"}  # a gateway's ids: its listing must show the chain
    conv, log, output, _ = always(emulator, start_proxy, tmp_path, stream, respelled)
    assert_saw(conv.meant, log)
    assert sent_previous(log) == [False, True, True, True, True]
    assert "retrying with the original body" not in output


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("faults", "said"), [
    (IGNORES_UNSEEN, "input items cannot be listed"),
    ({"ignore_previous": True, "echo_previous": False}, "answered a previous_response_id from the items sent alone"),
    ({"ignore_previous": True, "echo_previous": "respelled",
      "fail_next": [{"kind": "stall", "ms": 3000, "endpoint": "input_items"}]},  # listed past the two seconds
     "did not show it answered a previous_response_id from its chain"),
], ids=["respelled-no-listing", "no-echo-listed", "listed-too-late"])
def test_always_mode_sends_full_history_again_where_the_checked_continuation_did_not_read_its_chain(
        emulator, start_proxy, tmp_path, stream, faults, said):
    conv, log, output, audits = always(emulator, start_proxy, tmp_path, stream, faults)
    assert sent_previous(log) == [False, True, False, False, False, False]
    checked = log.pop(1)  # held back: the client never saw what the upstream made of the items sent alone
    assert checked["context"] != drop_nulls(expand_input(conv.meant[1]))
    assert_saw(conv.meant, log)  # every answer the client got was made from its whole chain
    assert said in output and "sending full history to it from now on" in output
    assert output.count("retrying with the original body") == 1
    assert len(audits) == len(conv.meant)  # one line a turn: the client's
    assert any(e["source"] == "proxy" and "did not show it read the chain; the client's own body was sent again"
               in e["reason"] for e in audits[1]["preserved"]), audits[1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_always_mode_checks_a_conversation_the_proxy_keeps_only_where_its_answer_can_be_held(emulator, start_proxy,
                                                                                           stream):
    """A stream's answers name the conversation as they stream by: none can be
    held, and full history goes until the upstream has shown elsewhere that it
    honours the field. A JSON answer is named once held: its continuation is
    checked as any other, and where the check fails (an upstream that ignores
    the field unseen) the conversation goes whole again, its answer the one
    the client gets, named and joined."""
    from test_conversations_integration import converse, sdk

    emulator.model.control({"conversations": "absent", **IGNORES_UNSEEN})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"}])
    # each request checked there: the model saw the conversation then the input, the conversation joined
    # the answer, named in it
    assert converse(client, emulator, conversation.id, TEXTS[:4], stream) == 4
    client.close()
    if stream:
        assert sent_previous(creates(emulator)) == [False] * 4
        assert "a continuation to check, of an answer that cannot be held" in proxy.output()
    else:  # the second one checked, refused, resent whole; full history from then on
        assert sent_previous(creates(emulator)) == [False, True, False, False, False]
        assert "sending full history to it from now on" in proxy.output()
