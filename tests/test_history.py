"""Store emulation's record, without mitmproxy: turns in, exact chains out,
tenants apart, sealed at rest, growing with distinct items."""

from __future__ import annotations

import json
import os

import pytest
from stateful_responses.store_emulation.walk import ChainError
from stateful_responses.store_emulation.history import History, listed_items, response_json
from stateful_responses.store_emulation.turns import ITEMS, TURNS, Tenant, conflict

SECRET = os.urandom(32)
ALICE = Tenant.of(SECRET, b"Bearer sk-alice")
BOB = Tenant.of(SECRET, b"Bearer sk-bob")


class Records:
    """What reached the backing store: the recorder's writes, applied."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[bytes, bytes]] = {TURNS: {}, ITEMS: {}}

    def apply(self, recorder: History) -> None:
        for w in recorder.take_writes():
            table = self.tables[w.table]
            if w.value is None:
                table.pop(w.key, None)
            elif w.merge is not None and w.key in table:
                table[w.key] = w.merge(table[w.key], w.value) or w.value
            else:
                table[w.key] = w.value

    async def get(self, table: str, keys) -> dict[bytes, bytes]:
        return {k: self.tables[table][k] for k in keys if k in self.tables[table]}

    def size(self) -> int:
        return sum(len(k) + len(v) for t in self.tables.values() for k, v in t.items())


def raw(item: dict) -> bytes:
    return json.dumps(item).encode()


def answer(n: int, text: str | None = None) -> dict:
    return {"id": f"resp_{n}", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text or f"answer {n}", "annotations": []}]}]}


def user(text: str) -> bytes:
    return raw({"role": "user", "content": text})


async def chain_of(recorder: History, records: Records, tenant: Tenant, n_turns: int) -> list[bytes]:
    """A previous_response_id client's conversation; returns the context it means at the end."""
    context: list[bytes] = []
    previous = None
    for n in range(n_turns):
        items = [user(f"turn {n}")]
        recorder.record(tenant, response=answer(n), previous_response_id=previous, raw_input=items,
                        stored_upstream=False)
        context += items + [raw(o) for o in answer(n)["output"]]
        previous = f"resp_{n}"
    records.apply(recorder)
    return context


async def test_a_chain_expands_to_every_input_then_output_oldest_first():
    recorder, records = History(), Records()
    expected = await chain_of(recorder, records, ALICE, 5)
    assert [json.loads(i) for i in await recorder.context(ALICE, "resp_4", records.get)] == \
        [json.loads(i) for i in expected]
    cold = History()  # another process, or after a restart: everything from the store
    assert [json.loads(i) for i in await cold.context(ALICE, "resp_4", records.get)] == \
        [json.loads(i) for i in expected]


async def test_input_items_come_back_byte_for_byte():
    recorder, records = History(), Records()
    odd = b'{ "role" :"user", "content": "caf\\u00e9 \xc3\xa9 1.50" }'
    recorder.record(ALICE, response=answer(1), previous_response_id=None, raw_input=[odd], stored_upstream=True)
    records.apply(recorder)
    assert (await History().context(ALICE, "resp_1", records.get))[0] == odd


async def test_another_tenant_reads_nothing():
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 3)
    for reader in (recorder, History()):
        with pytest.raises(ChainError) as caught:
            await reader.context(BOB, "resp_2", records.get)
        assert caught.value.code == "previous_response_not_found"


async def test_a_sealed_turn_moved_under_another_id_fails_closed():
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 2)
    turns = records.tables[TURNS]
    turns[ALICE.turn_key("resp_1")] = turns[ALICE.turn_key("resp_0")]
    with pytest.raises(ChainError) as caught:
        await History().context(ALICE, "resp_1", records.get)
    assert caught.value.code == "previous_response_not_found"


async def test_nothing_of_the_content_is_in_the_store_in_clear():
    recorder, records = History(), Records()
    recorder.record(ALICE, response=answer(1, "SECRET-ANSWER"), previous_response_id=None,
                    raw_input=[user("SECRET-PROMPT")], stored_upstream=True)
    records.apply(recorder)
    dump = b"".join(k + v for t in records.tables.values() for k, v in t.items())
    for marker in (b"SECRET-ANSWER", b"SECRET-PROMPT", b"resp_1", b"msg_1"):
        assert marker not in dump


async def test_a_full_history_conversation_stores_its_distinct_items_once():
    """Distinct items: every byte-distinct item the conversation holds (a
    client's echo of an answer is written differently from the answer)."""
    recorder, records = History(), Records()
    history: list[bytes] = []
    distinct: set[bytes] = set()
    for n in range(200):
        history.append(user(f"turn {n}: " + "x" * 200))
        reply = answer(n, "y" * 200)
        recorder.record(ALICE, response=reply, previous_response_id=None, raw_input=list(history),
                        stored_upstream=True)
        distinct.update(history)
        distinct.update(json.dumps(o, separators=(",", ":")).encode() for o in reply["output"])
        history += [raw(o) for o in reply["output"]]
        records.apply(recorder)
    distinct_bytes = sum(map(len, distinct))
    assert records.size() <= 1.5 * distinct_bytes, (records.size(), distinct_bytes)
    # and the last turn's input still comes back whole, from a cold process
    cold = History()
    turn = await cold.turn(ALICE, "resp_199", records.get)
    assert await cold.input_items(ALICE, turn, records.get) == history[:-1]


async def test_one_id_with_two_contents_is_never_expanded():
    recorder, records = History(), Records()
    recorder.record(ALICE, response=answer(1, "first"), previous_response_id=None, raw_input=[user("a")],
                    stored_upstream=True)
    records.apply(recorder)
    restarted = History()  # an upstream that counts ids from 1 again after a restart
    restarted.record(ALICE, response=answer(1, "second"), previous_response_id=None, raw_input=[user("b")],
                     stored_upstream=True)
    records.apply(restarted)
    with pytest.raises(ChainError):
        await History().context(ALICE, "resp_1", records.get)
    # the same content recorded twice is the same turn
    again = History()
    again.record(ALICE, response=answer(2), previous_response_id=None, raw_input=[user("c")], stored_upstream=True)
    again.record(ALICE, response=answer(2), previous_response_id=None, raw_input=[user("c")], stored_upstream=True)
    records.apply(again)
    assert len(await History().context(ALICE, "resp_2", records.get)) == 2


async def test_a_forgotten_response_is_not_found():
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 3)
    recorder.forget(ALICE, "resp_1")
    records.apply(recorder)
    with pytest.raises(ChainError) as caught:
        await History().context(ALICE, "resp_2", records.get)
    assert caught.value.code == "previous_response_not_found" and "resp_1" in str(caught.value)


async def test_retrieve_shapes():
    recorder, records = History(), Records()
    recorder.record(ALICE, response=answer(1), previous_response_id=None,
                    raw_input=[user("hello"), raw({"type": "message", "id": "msg_c", "role": "user",
                                                   "content": [{"type": "input_text", "text": "x"}]})],
                    stored_upstream=True)
    turn = await recorder.turn(ALICE, "resp_1", records.get)
    output = await recorder.output_items(ALICE, turn, records.get)
    whole = json.loads(response_json(turn, output))
    assert whole == answer(1)
    listed = listed_items(await recorder.input_items(ALICE, turn, records.get), "resp_1")
    assert listed[0]["id"].startswith("msg_") and listed[0]["type"] == "message" and listed[1]["id"] == "msg_c"
    assert listed[0]["content"] == [{"type": "input_text", "text": "hello"}] and listed[0]["status"] == "completed"


async def test_a_cold_walk_fetches_ancestors_in_batches_not_one_by_one():
    recorder, records = History(), Records()
    expected = await chain_of(recorder, records, ALICE, 100)
    calls: list[int] = []

    async def counting_get(table, keys):
        calls.append(len(keys))
        return await records.get(table, keys)

    cold = History()
    assert [json.loads(i) for i in await cold.context(ALICE, "resp_99", counting_get)] == \
        [json.loads(i) for i in expected]
    assert len(calls) <= 12, calls  # 100 turns: a few ancestor batches and the items, not 100 round trips


async def test_one_id_with_two_contents_in_one_process_is_never_expanded():
    recorder, records = History(), Records()
    recorder.record(ALICE, response=answer(1, "first"), previous_response_id=None, raw_input=[user("a")],
                    stored_upstream=True)
    recorder.record(ALICE, response=answer(1, "second"), previous_response_id=None, raw_input=[user("b")],
                    stored_upstream=True)
    records.apply(recorder)
    for reader in (recorder, History()):
        with pytest.raises(ChainError):
            await reader.context(ALICE, "resp_1", records.get)
