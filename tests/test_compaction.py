"""Compaction's pure parts: items as the addon tells them apart, a compacted
chain's window, the proxy's sealed items, and the verdicts (never from a
transient failure)."""

from __future__ import annotations

import json

import pytest

from stateful_responses.compaction import core
from stateful_responses.items import (
    is_compaction,
    is_compaction_trigger,
    item_digest,
    window_start,
    without_triggers,
)
from stateful_responses.record.protocols import responses
from stateful_responses.store_emulation.turns import Tenant

TRIGGER = b'{"type":"compaction_trigger"}'


def raw(item: dict) -> bytes:
    return json.dumps(item).encode()


def user(text: str) -> bytes:
    return raw({"role": "user", "content": text})


def compaction(content: str = "gAAAAAopaque") -> bytes:
    return raw({"type": "compaction", "id": "cmp_1", "encrypted_content": content})


def test_items_know_compaction_its_legacy_name_and_the_trigger():
    assert is_compaction(compaction()) and is_compaction(raw({"type": "compaction_summary", "encrypted_content": "x"}))
    assert is_compaction_trigger(TRIGGER) and not is_compaction(TRIGGER)
    assert not is_compaction_trigger(raw({"type": "function_call_output", "output": "compaction_trigger"}))
    assert without_triggers([user("a"), TRIGGER]) == [user("a")]
    # the id is the upstream's, created_by output only: an echo without them is the same item
    assert item_digest({"type": "compaction", "encrypted_content": "e"}) == \
        item_digest({"type": "compaction", "id": "cmp_1", "created_by": "x", "encrypted_content": "e"})


def test_a_compacted_chain_starts_at_its_newest_compaction():
    one, answer = user("one"), raw({"role": "assistant", "content": "a"})
    assert window_start([one, answer, user("two"), answer], [(1, 1), (1, 1)]) is None
    # made by a response (a trigger, context_management): from the item itself
    assert window_start([one, answer, user("two"), compaction(), answer], [(1, 1), (1, 2)]) == 3
    # sent by the client (a compacted window): from its turn's input, the retained messages included
    assert window_start([one, answer, user("kept"), compaction(), user("new"), answer], [(1, 1), (3, 1)]) == 2
    # the newest wins
    assert window_start([compaction(), answer, user("x"), compaction(), answer], [(0, 2), (1, 2)]) == 3


def test_the_record_never_takes_a_trigger_as_content():
    items = [user("a"), TRIGGER]
    lifted = responses.lift_read({"model": "m"}, items, [item_digest(json.loads(i)) for i in items])
    assert lifted.digests == [item_digest(json.loads(items[0]))]
    assert any(e.field == "compaction_trigger" and e.disposition == "dropped" for e in lifted.audit)
    parsed = responses.lift_request("http://x/v1/responses", {"model": "m", "input": [json.loads(i) for i in items]})
    assert len(parsed.messages) == 1


def tenant(credential: bytes, secret: bytes = b"s" * 32, seal_key: bytes = b"") -> Tenant:
    return Tenant.of(secret, credential, seal_key=seal_key)


def test_a_sealed_item_opens_for_its_tenant_only():
    content = core.seal(tenant(b"a"), "the summary")
    assert content.startswith(core.SEALED_PREFIX) and "the summary" not in content
    assert core.open_sealed(tenant(b"a"), content) == "the summary"
    assert core.open_sealed(tenant(b"b"), content) is None  # another tenant
    assert core.open_sealed(tenant(b"a", secret=b"t" * 32), content) is None  # another proxy's store
    assert core.open_sealed(tenant(b"a", seal_key=b"k" * 16), content) is None  # another seal key
    assert core.open_sealed(tenant(b"a"), content[:-4] + "AAAA") is None  # tampered


def test_substitution_sends_the_summary_and_refuses_what_it_cannot_open():
    mine = compaction(core.seal(tenant(b"a"), "S"))
    window = core.substitute([user("kept"), mine, user("new")], tenant(b"a"))
    assert window.replaced == 1 and window.foreign == []
    message = json.loads(window.items[1])
    assert message["role"] == "user" and message["content"][0]["text"] == core.SUMMARY_PREFACE + "S"
    with pytest.raises(core.ApiError) as refused:
        core.substitute([user("kept"), mine], tenant(b"b"))
    assert refused.value.status == 400 and refused.value.body["error"]["param"] == "input[1]"
    assert core.substitute([compaction()], tenant(b"a")).foreign == [0]  # the real API's: left to the verdict


def test_the_summary_request_leaves_the_trigger_out_and_stores_nothing():
    body = json.loads(core.summary_request("m", [user("a"), TRIGGER], "resp_1"))
    assert body["store"] is False and body["previous_response_id"] == "resp_1"
    assert [i.get("type") for i in body["input"]] == [None, "message"]
    assert body["input"][-1]["content"][0]["text"] == core.SUMMARY_INSTRUCTION


def test_codex_reads_exactly_one_compaction_item_and_a_completed_response():
    item = core.compaction_item("srcmp1.x")
    events = [json.loads(line[6:]) for line in
              core.trigger_events(core.trigger_response("m", item, None, {})).decode().splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(5))
    assert events[-1]["response"]["output"] == [item]


def test_verdicts_come_from_what_says_so_never_from_a_transient_failure():
    assert core.endpoint_verdict(404, b"{}") is False and core.endpoint_verdict(405, b"") is False
    assert core.endpoint_verdict(200, b'{"object": "response.compaction", "output": []}') is True
    for status in (408, 429, 500, 502, 503):
        assert core.endpoint_verdict(status, b"") is None
    assert core.refuses_compaction(400, b"Invalid input type 'compaction_trigger' at index 3")
    assert core.refuses_compaction(400, b"item type compaction is not supported")
    assert not core.refuses_compaction(400, b"The 'compaction_trigger' item must be the final input item.")
    assert not core.refuses_compaction(429, b"compaction is not supported right now")
    assert not core.refuses_compaction(400, b"Invalid value for 'temperature'")
    assert core.has_compaction_item({"status": "completed", "output": [{"type": "message"}]}) is False
    assert core.has_compaction_item({"status": "failed", "output": []}) is None


def test_context_management_threshold():
    assert core.compact_threshold([{"type": "compaction", "compact_threshold": 1000}]) == 1000
    assert core.compact_threshold([{"type": "compaction", "compact_threshold": None}]) is None
    assert core.estimated_tokens([b"x" * 400]) == 100
