"""Store emulation's record, without mitmproxy: turns in, exact chains out,
tenants apart, sealed at rest, growing with distinct items."""

from __future__ import annotations

import collections
import json
import os

import pytest
from stateful_responses.store_emulation.walk import ChainError
from stateful_responses.settings import Config, Settings
from stateful_responses.store_emulation.history import History, exact_digest, listed_items, response_json
from stateful_responses.state.storage import SHARD_TAG_SIZE
from stateful_responses.store_emulation.turns import DEPENDENTS, ITEM_IDS, ITEMS, TURNS, Tenant, header_of

SECRET = os.urandom(32)
ALICE = Tenant.of(SECRET, b"Bearer sk-alice")
BOB = Tenant.of(SECRET, b"Bearer sk-bob")


class Records:
    """What reached the backing store: the recorder's writes, applied."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[bytes, bytes]] = collections.defaultdict(dict)

    def apply(self, recorder: History) -> None:
        for w in recorder.take_writes():
            self.put(w)

    def put(self, w) -> None:
        table = self.tables[w.table]
        if w.touch:
            return  # nothing here expires
        if w.value is None:
            table.pop(w.key, None)
        elif w.merge is not None and w.key in table:
            table[w.key] = w.merge(table[w.key], w.value) or w.value
        else:
            table[w.key] = w.value

    async def get(self, table: str, keys) -> dict[bytes, bytes]:
        return {k: self.tables[table][k] for k in keys if k in self.tables[table]}

    def clear_table(self, table: str) -> None:
        self.tables[table].clear()

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


async def test_every_record_of_a_tenant_is_in_its_shard_and_other_tenants_are_elsewhere():
    """What one turn writes (its record, items, item ids, the mark on the turn
    it continues) shares the tenant's shard tag: a Redis Cluster writes it in
    one script."""
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 3)
    await chain_of(recorder, records, BOB, 3)
    tags = {table: {key[:SHARD_TAG_SIZE] for key in keys} for table, keys in records.tables.items()}
    assert set(tags) == {TURNS, ITEMS, ITEM_IDS, DEPENDENTS}
    assert all(found == {ALICE.shard, BOB.shard} for found in tags.values()) and ALICE.shard != BOB.shard


async def test_a_store_written_before_shard_tags_keeps_every_id_it_handed_out(monkeypatch):
    """Keys an earlier version made (the whole digest, no tag) are read after
    the tagged ones: its turns expand, their items are referenced, and a new
    turn continues them in the tenant's shard."""
    recorder, records = History(), Records()
    with monkeypatch.context() as earlier_version:
        earlier_version.setattr(Tenant, "turn_key", lambda self, rid: self._key(b"turn", rid.encode()))
        earlier_version.setattr(Tenant, "item_key", lambda self, digest, owner=None: self._key(b"item", digest))
        earlier_version.setattr(Tenant, "item_id_key", lambda self, item_id: self._key(b"item-id", item_id.encode()))
        expected = await chain_of(recorder, records, ALICE, 3)
    untagged = {key for keys in records.tables.values() for key in keys}
    assert untagged and not untagged & {ALICE.turn_key(f"resp_{n}") for n in range(3)}
    cold = History()
    assert [json.loads(i) for i in await cold.context(ALICE, "resp_2", records.get)] == \
        [json.loads(i) for i in expected]
    assert json.loads((await cold.referenced(ALICE, ["msg_1"], records.get))["msg_1"]) == answer(1)["output"][0]
    cold.record(ALICE, response=answer(3), previous_response_id="resp_2", raw_input=[user("turn 3")],
                stored_upstream=False)
    new = writes_of(cold)
    assert all(w.key[:SHARD_TAG_SIZE] == ALICE.shard for w in new if w.value and w.table in (TURNS, ITEMS, ITEM_IDS))
    marked = [w.key for w in new if w.table == DEPENDENTS]  # and renewed: where the turn relied on is
    assert marked == [key for key in ALICE.turn_keys("resp_2") if key in untagged]
    assert {w.key for w in new if w.touch} <= untagged
    for w in new:
        records.put(w)
    assert [json.loads(i) for i in await History().context(ALICE, "resp_3", records.get)] == \
        [json.loads(i) for i in expected + [user("turn 3"), raw(answer(3)["output"][0])]]


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


async def test_a_deleted_response_is_not_found_and_the_responses_that_rely_on_it_stay_whole():
    recorder, records = History(), Records()
    expected = await chain_of(recorder, records, ALICE, 3)
    assert await recorder.delete(ALICE, "resp_1", records.get)
    records.apply(recorder)
    for reader in (recorder, History()):
        with pytest.raises(ChainError) as caught:
            await reader.context(ALICE, "resp_1", records.get)
        assert caught.value.code == "previous_response_not_found"
        assert await reader.turn(ALICE, "resp_1", records.get, as_target=True) is None
        kept = await reader.context(ALICE, "resp_2", records.get)  # resp_2 still holds resp_1's turn
        assert [json.loads(i) for i in kept] == [json.loads(i) for i in expected]
    assert not await recorder.delete(ALICE, "resp_1", records.get)


async def test_a_deleted_response_nothing_relies_on_is_gone_from_the_store():
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 3)
    key = ALICE.turn_key("resp_2")
    assert await recorder.delete(ALICE, "resp_2", records.get)
    records.apply(recorder)
    assert key not in records.tables[TURNS]
    deleted_with_dependents = header_of(records.tables[TURNS][ALICE.turn_key("resp_1")])
    assert deleted_with_dependents.status == "completed"  # resp_2 was deleted, not resp_1


async def test_a_deleted_turn_nothing_relies_on_takes_its_own_items_and_their_ids_with_it():
    recorder, records = History(), Records()
    shared, mine = user("the same developer prompt"), raw({"type": "message", "id": "msg_c", "role": "user",
                                                            "content": "mine"})
    recorder.record(ALICE, response=answer(0), previous_response_id=None, raw_input=[shared, user("a")],
                    stored_upstream=False)
    recorder.record(ALICE, response=answer(1), previous_response_id="resp_0", raw_input=[mine], stored_upstream=False)
    recorder.record(ALICE, response=answer(2, "other"), previous_response_id=None, raw_input=[shared, user("b")],
                    stored_upstream=False)  # another conversation, opening alike
    records.apply(recorder)
    one = await recorder.turn(ALICE, "resp_1", records.get)
    before = set(records.tables[ITEMS])
    deleting = History()  # another process: what it removes, it reads from the store
    assert await deleting.delete(ALICE, "resp_1", records.get)
    records.apply(deleting)
    assert before - set(records.tables[ITEMS]) == {*one.body.input, *one.body.output}
    assert not {ALICE.item_id_key("msg_c"), ALICE.item_id_key("msg_1")} & set(records.tables[ITEM_IDS])
    assert await deleting.delete(ALICE, "resp_2", records.get)  # full history: its input is shared by content
    records.apply(deleting)
    assert ALICE.item_key(exact_digest(shared)) in records.tables[ITEMS]
    assert ALICE.item_key(exact_digest(user("b"))) in records.tables[ITEMS]  # expires: no turn says it is its own
    assert [json.loads(i) for i in await History().context(ALICE, "resp_0", records.get)] == \
        [json.loads(shared), {"role": "user", "content": "a"}, answer(0)["output"][0]]
    assert await History().referenced(ALICE, ["msg_0"], records.get)  # a living turn's ids stay


async def test_references_resolve_to_input_items_that_carried_an_id():
    recorder, records = History(), Records()
    mine = raw({"type": "function_call_output", "id": "fco_c", "call_id": "call_1", "output": "21C"})
    recorder.record(ALICE, response=answer(0), previous_response_id=None,
                    raw_input=[user("a"), mine, raw({"type": "item_reference", "id": "msg_elsewhere"})],
                    stored_upstream=False)
    records.apply(recorder)
    found = await History().referenced(ALICE, ["fco_c", "msg_elsewhere", "msg_0"], records.get)
    assert found.keys() == {"fco_c", "msg_0"} and found["fco_c"] == mine  # a reference is never an item
    assert await History().referenced(BOB, ["fco_c"], records.get) == {}


async def test_a_delete_through_another_process_holds_here_at_once():
    here, records = History(), Records()
    await chain_of(here, records, ALICE, 2)
    assert await here.context(ALICE, "resp_1", records.get)  # in this process's memory
    elsewhere = History()
    assert await elsewhere.delete(ALICE, "resp_1", records.get)
    records.apply(elsewhere)
    with pytest.raises(ChainError):
        await here.context(ALICE, "resp_1", records.get)  # the store decides, not memory


async def test_retrieve_shapes():
    recorder, records = History(), Records()
    recorder.record(ALICE, response=answer(1), previous_response_id=None,
                    raw_input=[user("hello"), raw({"type": "message", "id": "msg_c", "role": "user",
                                                   "content": [{"type": "input_text", "text": "x"}]})],
                    stored_upstream=True)
    turn = await recorder.turn(ALICE, "resp_1", records.get)
    output = await recorder.output_items(ALICE, turn, records.get)
    whole = json.loads(response_json(turn, output))
    assert whole == {**answer(1), "previous_response_id": None}
    recorder.record(ALICE, response=answer(2), previous_response_id="resp_1", raw_input=[user("more")],
                    stored_upstream=True)
    child = await recorder.turn(ALICE, "resp_2", records.get)
    assert json.loads(response_json(child, []))["previous_response_id"] == "resp_1"
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


def writes_of(recorder: History) -> list:
    return recorder.take_writes()


async def test_a_turn_keeps_what_it_relies_on_alive_as_long_as_itself():
    now = [1000.0]
    recorder = History(Config(Settings(ttl_days=10), clock=lambda: now[0]))
    first = recorder.record(ALICE, response=answer(0), previous_response_id=None, raw_input=[user("a")],
                            stored_upstream=False)
    assert first == []
    writes_of(recorder)
    due = recorder.record(ALICE, response=answer(1), previous_response_id="resp_0", raw_input=[user("b")],
                          stored_upstream=False)
    touched = {(w.table, w.key) for w in writes_of(recorder) if w.touch}
    parent = await recorder.turn(ALICE, "resp_0", Records().get)
    assert (TURNS, parent.key) in touched and all((ITEMS, k) in touched for k in parent.body.output)
    assert due == []  # resp_0 relies on nothing
    now[0] += 3600  # the next turn, an hour later: within the slack, nothing below is due
    assert recorder.record(ALICE, response=answer(2), previous_response_id="resp_1", raw_input=[user("c")],
                           stored_upstream=False) == []
    now[0] += 2 * 86400  # two days on: what resp_2 relies on is renewed, whole
    assert recorder.record(ALICE, response=answer(3), previous_response_id="resp_2", raw_input=[user("d")],
                           stored_upstream=False) == ["resp_2"]
    writes_of(recorder)
    await recorder.renew(ALICE, "resp_2", Records().get)
    renewal = writes_of(recorder)
    chain = [(await recorder.turn(ALICE, f"resp_{n}", Records().get)).key for n in range(3)]
    assert {w.key for w in renewal if w.table == TURNS} == set(chain)
    assert all(w.touch and w.ttl > 10 * 86400 for w in renewal)
    assert History(recorder.config).record(ALICE, response=answer(4), previous_response_id="resp_3",
                                           raw_input=[user("e")], stored_upstream=False) == ["resp_3"]  # a restart


async def test_an_item_shared_by_two_conversations_is_written_again_by_the_second():
    recorder = History()
    shared = user("the same developer prompt")
    recorder.record(ALICE, response=answer(1), previous_response_id=None, raw_input=[shared, user("a")],
                    stored_upstream=False)
    writes_of(recorder)
    recorder.record(ALICE, response=answer(2, "other"), previous_response_id=None, raw_input=[shared, user("b")],
                    stored_upstream=False)
    assert any(w.table == ITEMS and w.key == ALICE.item_key(exact_digest(shared)) and w.value
               for w in writes_of(recorder))


async def test_references_resolve_to_recorded_items_of_living_responses_of_the_same_tenant():
    recorder, records = History(), Records()
    await chain_of(recorder, records, ALICE, 2)
    found = await recorder.referenced(ALICE, ["msg_1", "msg_unknown"], records.get)
    assert list(found) == ["msg_1"] and json.loads(found["msg_1"]) == answer(1)["output"][0]
    assert await History().referenced(BOB, ["msg_1"], records.get) == {}
    await recorder.delete(ALICE, "resp_1", records.get)
    records.apply(recorder)
    assert await History().referenced(ALICE, ["msg_1"], records.get) == {}


async def test_records_made_under_a_secret_the_store_used_before_stay_readable():
    recorder, records = History(), Records()
    expected = await chain_of(recorder, records, ALICE, 3)
    credential = b"Bearer sk-alice"
    after = Tenant.of(b"n" * 32, credential, older_secrets=(SECRET,))
    assert [json.loads(i) for i in await History().context(after, "resp_2", records.get)] == \
        [json.loads(i) for i in expected]
    assert await History().turn(Tenant.of(b"n" * 32, credential), "resp_2", records.get) is None


async def test_a_seal_key_outside_the_store_is_needed_to_open_anything():
    recorder, records = History(), Records()
    keyed = Tenant.of(SECRET, b"", seal_key=b"k" * 32)
    await chain_of(recorder, records, keyed, 2)
    assert await History().turn(Tenant.of(SECRET, b""), "resp_1", records.get) is None
    assert await History().turn(Tenant.of(SECRET, b"", seal_key=b"k" * 32), "resp_1", records.get) is not None


def test_memory_keeps_recorded_turns_and_items_within_their_bytes():
    """Clients inline files: a cache counted in entries alone could hold gigabytes."""
    from stateful_responses.bounded import Weighed

    cache = Weighed(100, max_bytes=10)
    cache.put("a", b"12345")
    cache.put("b", b"1234")
    cache.put("a", b"123")  # replaced, not counted twice
    assert cache.bytes == 7 and list(cache) == ["b", "a"]
    cache.put("c", b"1234")  # over 10 bytes: the least recently used goes
    assert list(cache) == ["a", "c"] and cache.bytes == 7
    cache.put("huge", b"x" * 11)  # heavier than the whole bound: not kept, and the others stay
    assert list(cache) == ["a", "c"] and cache.bytes == 7
    assert cache.pop("a") == b"123" and cache.pop("missing") is None and cache.bytes == 4
    cache.clear()
    assert cache.bytes == 0

    history = History()
    big = "x" * (1024 * 1024)
    for n in range(100):  # 100 turns of a 1 MiB item each: memory keeps at most 64 MiB of them
        history.record(ALICE, response=answer(n), previous_response_id=None, raw_input=[user(f"{n} {big}")],
                       stored_upstream=True)
    assert history.items.bytes <= 64 * 1024 * 1024
    assert sum(len(v) for v in history.items.values()) == history.items.bytes
    assert history.turns.bytes <= 64 * 1024 * 1024
