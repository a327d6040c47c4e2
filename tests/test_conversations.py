"""Conversations kept by the proxy (store_emulation/conversations.py), the
pure core alone over a real storage backend: the API's answers, appends that
are never lost, tenants, seals, deletion, renewal and bounds."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from stateful_responses.settings import Config, Settings
from stateful_responses.state.outbox import apply_writes
from stateful_responses.state.storage import log_entry, log_length
from stateful_responses.state.storage.memory import MemoryStorage
from stateful_responses.store_emulation import conversations as module
from stateful_responses.store_emulation.conversations import (
    CONVERSATIONS,
    ApiError,
    Call,
    Conversations,
    listed,
    refuse_duplicates,
)
from stateful_responses.store_emulation.turns import Tenant

SECRET = bytes(32)
ALICE = Tenant.of(SECRET, b"Bearer sk-alice")
MALLORY = Tenant.of(SECRET, b"Bearer sk-mallory")


async def nothing_referenced(ids: list[str]) -> dict[str, bytes]:
    return {}


class Replica:
    """One proxy's conversations over a shared store, its writes applied as the state store's writer applies them."""

    def __init__(self, storage: MemoryStorage, config: Config | None = None) -> None:
        self.storage = storage
        self.conversations = Conversations(config or Config())

    async def call(self, endpoint: str, tenant: Tenant = ALICE, conversation_id: str = "", item_id: str = "",
                   body: dict | None = None, query: tuple = (), resolve=nothing_referenced) -> tuple[int, dict]:
        conversation = await self.find(conversation_id, tenant) if conversation_id else None
        status, answer = await self.conversations.answer(
            tenant, Call(endpoint, conversation_id, item_id, json.dumps(body).encode() if body is not None else b"",
                         query), conversation, resolve, self.storage.get)
        await self.flush()
        return status, json.loads(answer)

    async def find(self, conversation_id: str, tenant: Tenant = ALICE):
        return await self.conversations.find(tenant, conversation_id, self.storage.get)

    async def flush(self) -> None:
        await apply_writes(self.storage, self.conversations.take_writes())


@pytest.fixture
def storage() -> MemoryStorage:
    return MemoryStorage()


async def created(replica: Replica, texts: list[str], metadata: dict | None = None) -> str:
    status, answer = await replica.call("create", body={"items": [{"role": "user", "content": t} for t in texts],
                                                        **({"metadata": metadata} if metadata else {})})
    assert status == 200, answer
    return answer["id"]


def texts_of(items: list[dict]) -> list[str]:
    return [item["content"][0]["text"] for item in items]


async def test_a_conversation_is_created_read_back_cold_and_its_items_listed_as_the_api_lists_them(storage):
    writer, reader = Replica(storage), Replica(storage)
    status, answer = await writer.call("create", body={"metadata": {"topic": "demo"},
                                                       "items": [{"role": "user", "content": "one"},
                                                                 {"type": "message", "role": "assistant",
                                                                  "content": "two"}]})
    assert status == 200 and answer["object"] == "conversation" and answer["metadata"] == {"topic": "demo"}
    assert answer["id"].startswith("conv_") and len(answer["id"]) == len("conv_") + 2 * module.ID_BYTES
    assert await reader.call("retrieve", conversation_id=answer["id"]) == (200, answer)
    status, listed = await reader.call("list_items", conversation_id=answer["id"], query=(("order", "asc"),))
    user, assistant = listed["data"]
    assert user == {"id": user["id"], "type": "message", "role": "user", "status": "completed",
                    "content": [{"type": "input_text", "text": "one"}]}
    assert assistant["content"] == [{"type": "output_text", "text": "two", "annotations": []}]
    assert user["id"].startswith("msg_") and (listed["first_id"], listed["last_id"]) == (user["id"], assistant["id"])


async def test_a_conversation_an_earlier_version_made_is_found_and_goes_on_where_it_is(storage, monkeypatch):
    """Its log key has no shard tag (an earlier version's): it is read after
    the tagged one, and appends go to the log it is, never to a new one."""
    with monkeypatch.context() as earlier_version:
        earlier_version.setattr(Tenant, "conversation_key",
                                lambda self, conversation_id: self._key(b"conversation", conversation_id.encode()))
        conversation_id = await created(Replica(storage), ["before"])
    replica = Replica(storage)
    status, _ = await replica.call("add_items", conversation_id=conversation_id,
                                   body={"items": [{"role": "user", "content": "after"}]})
    assert status == 200
    listed = (await Replica(storage).call("list_items", conversation_id=conversation_id, query=(("order", "asc"),)))[1]
    assert texts_of(listed["data"]) == ["before", "after"]
    assert (await Replica(storage).find(conversation_id)).key == ALICE.conversation_keys(conversation_id)[-1]
    assert ALICE.conversation_key(conversation_id) not in await storage.scan(CONVERSATIONS)


async def test_responses_joining_at_once_on_two_replicas_are_all_kept_in_the_stores_order(storage):
    """The appends race: each replica read the conversation before either
    wrote. Both turns are kept, whole, once each; every replica then reads the
    same conversation."""
    left, right = Replica(storage), Replica(storage)
    conversation_id = await created(left, ["hello"])
    seen_left, seen_right = await left.find(conversation_id), await right.find(conversation_id)
    for n in range(5):
        question = listed([json.dumps({"role": "user", "content": f"L{n}"}).encode()])
        left.conversations.join(ALICE, seen_left, question,
                                [{"type": "message", "id": f"msg_l{n}", "role": "assistant", "status": "completed",
                                  "content": [{"type": "output_text", "text": f"l{n}", "annotations": []}]}])
        question = listed([json.dumps({"role": "user", "content": f"R{n}"}).encode()])
        right.conversations.join(ALICE, seen_right, question,
                                 [{"type": "message", "id": f"msg_r{n}", "role": "assistant", "status": "completed",
                                   "content": [{"type": "output_text", "text": f"r{n}", "annotations": []}]}])
        await asyncio.gather(left.flush(), right.flush())
    both = [await replica.find(conversation_id) for replica in (left, right, Replica(storage))]
    assert both[0].items == both[1].items == both[2].items
    texts = [json.loads(item.raw)["content"][0]["text"] for item in both[0].items]
    assert texts[0] == "hello" and len(texts) == 21 and len({item.id for item in both[0].items}) == 21
    for side in ("L", "l", "R", "r"):
        assert [t for t in texts if t[0] == side] == [f"{side}{n}" for n in range(5)]
    turns = [texts[i:i + 2] for i in range(1, 21, 2)]
    assert all(answer == question.lower() for question, answer in turns)  # a turn's input and output stay together


async def test_a_conversation_belongs_to_its_tenant_and_its_entries_open_nowhere_else(storage):
    alice = Replica(storage)
    conversation_id = await created(alice, ["alice's secret"])
    assert await alice.call("retrieve", MALLORY, conversation_id) == (404, {"error": {
        "message": f"Conversation with id '{conversation_id}' not found.", "type": "invalid_request_error",
        "param": None, "code": None}})
    other_id = await created(alice, ["another"])
    stolen, victim = ALICE.conversation_key(conversation_id), ALICE.conversation_key(other_id)
    entry = (await storage.get(CONVERSATIONS, [log_entry(stolen, 0)]))[log_entry(stolen, 0)]
    await storage.put(CONVERSATIONS, {log_entry(victim, 0): entry}, 60)  # moved into another conversation's log
    assert await Replica(storage).find(other_id) is None
    assert b"alice's secret" not in b"".join((await storage.scan(CONVERSATIONS)).values())


async def test_a_deleted_conversation_is_gone_for_a_replica_that_still_remembers_it(storage):
    left, right = Replica(storage), Replica(storage)
    conversation_id = await created(left, ["hello"])
    assert await right.find(conversation_id) is not None
    assert (await left.call("delete", conversation_id=conversation_id))[1] == {
        "id": conversation_id, "object": "conversation.deleted", "deleted": True}
    assert await right.find(conversation_id) is None
    ledger = ALICE.ledger_key()  # the tenant's list of what it made (its log's key, sealed) is all that stays
    assert set(await storage.scan(CONVERSATIONS)) == {ledger, log_entry(ledger, 0)}
    assert (await right.call("list_items", conversation_id=conversation_id))[0] == 404


async def test_a_conversation_missing_an_entry_is_gone_never_served_with_a_hole(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, ["one"])
    await replica.call("add_items", conversation_id=conversation_id, body={"items": [{"role": "user",
                                                                                       "content": "two"}]})
    await storage.delete(CONVERSATIONS, [log_entry(ALICE.conversation_key(conversation_id), 0)])  # evicted
    assert await Replica(storage).find(conversation_id) is None


async def test_items_are_added_removed_and_metadata_replaced_through_the_log(storage):
    writer = Replica(storage)
    conversation_id = await created(writer, ["keep", "drop"], metadata={"a": "1"})
    status, added = await writer.call("add_items", conversation_id=conversation_id, body={"items": [
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]})
    assert status == 200 and [i["id"][:3] for i in added["data"]] == ["fc_", "fco"] and added["has_more"] is False
    listed = (await writer.call("list_items", conversation_id=conversation_id, query=(("order", "asc"),)))[1]
    drop = listed["data"][1]["id"]
    assert (await writer.call("delete_item", conversation_id=conversation_id, item_id=drop))[1]["id"] == \
        conversation_id
    updated = (await writer.call("update", conversation_id=conversation_id, body={"metadata": {"b": "2"}}))[1]
    assert updated["metadata"] == {"b": "2"}
    reader = Replica(storage)
    conversation = await reader.find(conversation_id)
    assert json.loads(conversation.metadata) == {"b": "2"}
    assert [item.type for item in conversation.items] == ["message", "function_call", "function_call_output"]
    assert (await reader.call("retrieve_item", conversation_id=conversation_id, item_id=drop))[0] == 404


async def test_list_pages_and_refusals_are_the_apis(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, [f"m{n}" for n in range(20)])
    await replica.call("add_items", conversation_id=conversation_id,
                       body={"items": [{"role": "user", "content": f"m{n}"} for n in range(20, 25)]})
    first = (await replica.call("list_items", conversation_id=conversation_id))[1]
    assert texts_of(first["data"]) == [f"m{n}" for n in range(24, 4, -1)] and first["has_more"] is True
    page = (await replica.call("list_items", conversation_id=conversation_id,
                               query=(("limit", "7"), ("after", first["data"][6]["id"]))))[1]
    assert page["data"] == first["data"][7:14]
    for query, code in (((("limit", "0"),), "integer_below_min_value"),
                        ((("limit", "101"),), "integer_above_max_value"), ((("order", "newest"),), "invalid_value")):
        status, error = await replica.call("list_items", conversation_id=conversation_id, query=query)
        assert status == 400 and error["error"]["code"] == code
    status, error = await replica.call("list_items", conversation_id=conversation_id, query=(("after", "msg_x"),))
    assert (status, error["error"]["message"], error["error"]["param"]) == (404, "No item found with id 'msg_x'",
                                                                           "after")
    status, error = await replica.call("create", body={"items": [{"role": "user", "content": "x"}] * 21})
    assert (status, error["error"]["code"]) == (400, "array_above_max_length")
    status, error = await replica.call("create", body={"metadata": {f"k{n}": "v" for n in range(17)}})
    assert (status, error["error"]["code"]) == (400, "object_above_max_properties")
    status, error = await replica.call("update", conversation_id=conversation_id, body={})
    assert (status, error["error"]["code"]) == (400, "missing_required_parameter")
    status, error = await replica.call("add_items", conversation_id=conversation_id,
                                       body={"items": [{"type": "reasoning", "summary": []}]})
    assert (status, error["error"]["code"]) == (400, "invalid_item")
    status, error = await replica.call("add_items", conversation_id=conversation_id,
                                       body={"items": [{"id": first["data"][0]["id"]}]})
    assert (status, error["error"]["code"]) == (400, "item_already_in_conversation")


async def test_a_reference_adds_the_item_it_names_and_an_unknown_one_is_refused(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, [])
    stored = {"type": "message", "id": "msg_stored", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "from a response", "annotations": []}]}

    async def resolve(ids: list[str]) -> dict[str, bytes]:
        return {i: json.dumps(stored).encode() for i in ids if i == "msg_stored"}

    status, added = await replica.call("add_items", conversation_id=conversation_id, resolve=resolve,
                                       body={"items": [{"type": "item_reference", "id": "msg_stored"}]})
    assert (status, added["data"]) == (200, [stored])
    status, error = await replica.call("add_items", conversation_id=conversation_id, resolve=resolve,
                                       body={"items": [{"type": "item_reference", "id": "msg_never"}]})
    assert (status, error["error"]["message"]) == (404, "Item with id 'msg_never' not found.")


async def test_encrypted_reasoning_is_shown_only_when_included(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, [])
    await replica.call("add_items", conversation_id=conversation_id,
                       body={"items": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]})
    plain = (await replica.call("list_items", conversation_id=conversation_id))[1]["data"][0]
    included = (await replica.call("list_items", conversation_id=conversation_id,
                                   query=(("include[]", "reasoning.encrypted_content"),)))[1]["data"][0]
    assert "encrypted_content" not in plain and included["encrypted_content"] == "opaque"


async def test_every_use_keeps_the_whole_conversation_the_ttl_from_then(storage):
    now = [1_000_000.0]
    config = Config(clock=lambda: now[0])
    replica = Replica(storage, config)
    conversation_id = await created(replica, ["hello"])
    await replica.call("add_items", conversation_id=conversation_id, body={"items": [{"role": "user",
                                                                                       "content": "more"}]})
    assert not [w for w in replica.conversations.take_writes() if w.touch]  # just written: nothing due yet
    now[0] += config.ttl / 10 + 1  # past the slack: the next use renews everything
    conversation = await replica.find(conversation_id)
    await replica.conversations.answer(ALICE, Call("retrieve", conversation_id), conversation, nothing_referenced,
                                       storage.get)
    touched = {w.key for w in replica.conversations.take_writes() if w.touch}
    key = ALICE.conversation_key(conversation_id)
    assert touched == {key, log_entry(key, 0), log_entry(key, 1)}


async def test_a_full_conversation_refuses_more(storage, monkeypatch):
    monkeypatch.setattr(module, "MAX_ITEMS", 3)
    replica = Replica(storage)
    conversation_id = await created(replica, ["one", "two"])
    status, error = await replica.call("add_items", conversation_id=conversation_id,
                                       body={"items": [{"role": "user", "content": n} for n in ("3", "4")]})
    assert (status, error["error"]["code"]) == (400, "conversation_too_large")
    assert len((await replica.find(conversation_id)).items) == 2


async def test_a_long_log_is_read_a_part_at_a_time(storage, monkeypatch):
    """Each read stays small (the store's read timeout applies to each),
    whatever the conversation's length."""
    monkeypatch.setattr(module, "PREFETCH", 2)
    monkeypatch.setattr(module, "READ_AT_ONCE", 4)
    writer = Replica(storage)
    conversation_id = await created(writer, ["0"])
    for n in range(1, 12):
        await writer.call("add_items", conversation_id=conversation_id,
                          body={"items": [{"role": "user", "content": str(n)}]})
    asked: list[int] = []

    async def get(table, keys):
        asked.append(len(keys))
        return await storage.get(table, keys)

    conversation = await Conversations().find(ALICE, conversation_id, get)
    assert [json.loads(item.raw)["content"][0]["text"] for item in conversation.items] == [str(n) for n in range(12)]
    assert asked[0] == len(ALICE.conversation_keys(conversation_id)) + 2  # where the log may be, and 2 entries
    assert max(asked[1:]) == 4 and sum(asked[1:]) == 12 - 2


async def with_turns_given(work):
    """``work``'s result, and how many turns another task got while it ran
    (the memory store answers without yielding: each turn is one it gave)."""
    turns, done = 0, False

    async def other_flow() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    running = asyncio.create_task(other_flow())
    result = await work
    done = True
    await running
    return result, turns


async def test_a_long_log_is_replayed_a_part_at_a_time_letting_other_flows_run_between(storage, monkeypatch):
    """The memory store answers without yielding: every turn another task
    gets during the read is one the replay gave it."""
    monkeypatch.setattr(module, "OPEN_AT_ONCE", 4)
    writer = Replica(storage)
    conversation_id = await created(writer, ["0"])
    for n in range(1, 12):
        await writer.call("add_items", conversation_id=conversation_id,
                          body={"items": [{"role": "user", "content": str(n)}]})
    conversation, turns = await with_turns_given(Replica(storage).find(conversation_id))
    assert [json.loads(item.raw)["content"][0]["text"] for item in conversation.items] == [str(n) for n in range(12)]
    assert turns >= 12 // 4  # one turn at least before each part


async def test_a_removed_item_id_added_again_stays_and_removals_replay_in_the_stores_order(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, ["a", "b", "c"])
    conversation = await replica.find(conversation_id)
    first, second, third = conversation.items
    replica.conversations.remove(ALICE, conversation, second.id)
    replica.conversations.add(ALICE, conversation, [second.raw])  # the same item, id and all, again
    replica.conversations.remove(ALICE, conversation, first.id)
    await replica.flush()
    for reader in (replica, Replica(storage)):  # read on from memory, and cold
        assert [item.id for item in (await reader.find(conversation_id)).items] == [third.id, second.id]


async def walked(replica: Replica, conversation_id: str, order: str, limit: int) -> list[list[str]]:
    """The pages a client following ``after`` and ``has_more`` lists, as ids;
    cut at 20 pages, so that paging that never ends fails instead of hanging."""
    pages, after = [], ()
    for _ in range(20):
        status, page = await replica.call("list_items", conversation_id=conversation_id,
                                          query=(("order", order), ("limit", str(limit)), *after))
        assert status == 200, page
        pages.append([item["id"] for item in page["data"]])
        if not page["has_more"]:
            return pages
        after = (("after", page["last_id"]),)
    return pages


async def test_paging_over_an_id_listed_twice_always_advances_and_ends(storage):
    """A conversation holding one id twice (an item given twice in one request,
    as the API takes it, or a log written before duplicates were refused):
    ``after`` names the id's last place, so no page starts over."""
    replica = Replica(storage)
    conversation_id = await created(replica, ["a", "b", "c"])
    conversation = await replica.find(conversation_id)
    a, b, c = (item.id for item in conversation.items)
    replica.conversations.add(ALICE, conversation, [conversation.items[1].raw])  # b again, id and all
    await replica.flush()
    assert [item.id for item in (await replica.find(conversation_id)).items] == [a, b, c, b]
    assert await walked(replica, conversation_id, "asc", 1) == [[a], [c], [b]]  # never a page ending on b's first copy
    assert await walked(replica, conversation_id, "asc", 2) == [[a], [b, c], [b]]
    assert await walked(replica, conversation_id, "asc", 3) == [[a, b, c], [b]]
    assert await walked(replica, conversation_id, "asc", 20) == [[a, b, c, b]]
    assert await walked(replica, conversation_id, "desc", 1) == [[c], [b], [a]]  # listed b, c, b, a
    assert await walked(replica, conversation_id, "desc", 2) == [[b, c], [b, a]]
    status, page = await replica.call("list_items", conversation_id=conversation_id,
                                      query=(("order", "asc"), ("after", b)))
    assert (status, page["data"], page["has_more"]) == (200, [], False)  # past b's last place: the end


async def test_an_input_item_already_in_the_conversation_or_twice_in_the_input_is_refused(storage):
    replica = Replica(storage)
    conversation_id = await created(replica, ["a"])
    conversation = await replica.find(conversation_id)
    present = conversation.items[0].id
    own = json.dumps({"type": "message", "role": "user", "id": "msg_own", "content": "x"}).encode()
    fresh = json.dumps({"role": "user", "content": "y"}).encode()
    for raw_input, named in (([fresh, conversation.items[0].raw], present), ([own, fresh, own], "msg_own")):
        with pytest.raises(ApiError) as refused:
            refuse_duplicates(conversation, listed(raw_input))
        assert (refused.value.status, refused.value.body) == (400, {"error": {
            "message": f"Duplicate item found with id {named}. Remove duplicate items from your input and try again.",
            "type": "invalid_request_error", "param": "input", "code": None}})
    refuse_duplicates(conversation, listed([own, fresh, fresh]))  # items without ids each get their own


def limited(conversations: int = 10_000) -> Config:
    return Config(Settings(conversations_per_credential=conversations))


async def test_a_credential_at_its_limit_is_refused_as_the_api_refuses_and_others_go_on(storage):
    replica = Replica(storage, limited(conversations=3))
    kept = [await created(replica, [f"mine {n}"]) for n in range(3)]
    status, error = await replica.call("create", body={"items": [{"role": "user", "content": "one more"}]})
    assert (status, error) == (400, {"error": {
        "message": "This credential's conversations are at this proxy's limit (3 conversations, 400000 records). "
                   "Delete conversations you no longer need.", "type": "invalid_request_error", "param": None,
        "code": "conversation_limit_exceeded"}})
    assert (await replica.call("create", MALLORY, body={}))[0] == 200  # another credential's share is its own
    fresh = Replica(storage, limited(conversations=3))  # another replica counts from the store
    assert (await fresh.call("create", body={}))[0] == 400
    await replica.call("delete", conversation_id=kept[0])
    assert (await replica.call("create", body={}))[0] == 200  # a deleted conversation frees its place at once
    for conversation_id in kept[1:]:
        assert len((await Replica(storage).find(conversation_id)).items) == 1


async def test_a_credential_flooding_the_store_never_evicts_another_credentials_conversation(monkeypatch):
    """The store keeps 400 records of conversations: Mallory's creates and
    items would push out the soonest to expire, Alice's first; a tenth of
    them is all Mallory gets."""
    monkeypatch.setattr(Conversations, "tables", {CONVERSATIONS: 400})
    storage = MemoryStorage({CONVERSATIONS: 400})
    alice, mallory = Replica(storage), Replica(storage)
    conversation_id = await created(alice, ["alice's"])
    for n in range(30):  # 35 records: within her share
        status, _ = await alice.call("add_items", conversation_id=conversation_id,
                                     body={"items": [{"role": "user", "content": f"alice {n}"}]})
        assert status == 200
    made, refused = [], 0
    for n in range(200):
        status, answer = await mallory.call("create", MALLORY, body={"items": [{"role": "user", "content": "x"}]})
        if status == 200:
            made.append(answer["id"])
        else:
            refused += 1
            assert answer["error"]["code"] == "conversation_limit_exceeded"
    for n in range(200):
        status, answer = await mallory.call("add_items", MALLORY, made[0],
                                            body={"items": [{"role": "user", "content": "y"}]})
        refused += status == 400
    assert 0 < len(made) <= 40 and refused >= 200
    assert len((await Replica(storage).find(conversation_id)).items) == 31  # whole
    assert len(await storage.scan(CONVERSATIONS)) <= 400


async def test_the_share_is_counted_from_the_store_and_a_ledger_of_the_gone_is_rewritten(storage, monkeypatch):
    monkeypatch.setattr(module, "PREFETCH", 2)
    replica = Replica(storage)
    made = [await created(replica, [str(n)]) for n in range(8)]
    for conversation_id in made[:6]:
        await replica.call("delete", conversation_id=conversation_id)
    await replica.call("add_items", conversation_id=made[7], body={"items": [{"role": "user", "content": "more"}]})
    counter = Conversations()
    await counter.admit(ALICE, storage.get)
    tally = counter._tallies[ALICE.ledger_key()]
    # two living conversations: 1 and 2 entries, a length record each; the ledger rewritten: 2 entries and a length
    assert (tally.conversations, tally.records) == (2, (1 + 1) + (2 + 1) + 2 + 1 + 1)  # this write reserved too
    await apply_writes(storage, counter.take_writes())
    ledger = ALICE.ledger_key()
    stored = await storage.get(CONVERSATIONS, [ledger, *(log_entry(ledger, n) for n in range(8))])
    assert set(stored) == {ledger, log_entry(ledger, 0), log_entry(ledger, 1)}
    assert {ALICE.open(stored[log_entry(ledger, n)], ledger) for n in range(2)} == \
        {ALICE.conversation_key(made[6]), ALICE.conversation_key(made[7])}


async def test_renewing_a_long_log_lets_other_flows_run_between_its_parts(storage, monkeypatch):
    monkeypatch.setattr(module, "TOUCH_AT_ONCE", 2)
    now = [1_000_000.0]
    replica = Replica(storage, Config(clock=lambda: now[0]))
    conversation_id = await created(replica, ["0"])
    for n in range(1, 6):
        await replica.call("add_items", conversation_id=conversation_id,
                           body={"items": [{"role": "user", "content": str(n)}]})
    now[0] += replica.conversations.config.ttl / 10 + 1  # the renewal is due
    conversation = await replica.find(conversation_id)
    _, turns = await with_turns_given(replica.conversations.renew(conversation))
    key = ALICE.conversation_key(conversation_id)
    assert {w.key for w in replica.conversations.take_writes() if w.touch} == {key, *(log_entry(key, n)
                                                                                     for n in range(6))}
    assert turns >= 6 // 2 - 1  # a turn between each two parts


async def test_a_ledger_padded_with_conversations_made_and_deleted_is_read_whole(storage, monkeypatch):
    """Conversations made and deleted by the thousand within a recount leave a
    long ledger: read whole, its rewrite keeps every living conversation
    counted, so the share is never exceeded."""
    monkeypatch.setattr(module, "PREFETCH", 2)
    config = Config()
    config.update(dataclasses.replace(config.settings, conversations_per_credential=2))
    replica = Replica(storage, config)
    for _ in range(40):  # 40 entries of the gone, more than a few per conversation of a share of 2
        await replica.call("delete", conversation_id=await created(replica, ["x"]))
    kept = await created(replica, ["kept"])  # the ledger's last entry
    replica.conversations._tallies.clear()  # the next write recounts from the store
    assert (await replica.call("create", body={"items": [{"role": "user", "content": "two"}]}))[0] == 200
    status, answer = await replica.call("create", body={"items": [{"role": "user", "content": "three"}]})
    assert status == 400 and answer["error"]["code"] == "conversation_limit_exceeded"
    assert (await replica.find(kept)) is not None
    ledger = ALICE.ledger_key()
    assert log_length((await storage.get(CONVERSATIONS, [ledger]))[ledger]) == 2  # rewritten: the living two
