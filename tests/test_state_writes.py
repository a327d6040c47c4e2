"""The state store's writer on a real Redis and a real Redis Cluster: a write
the store failed waits, in order, and lands once the store is back; on a
cluster a master down mid-flush leaves no recorded turn visible without its
items, and what it could not take follows."""

from __future__ import annotations

import asyncio
import json
import time

from mitmproxy.test import taddons
from redis_cluster import start_redis_cluster
from stateful_responses.state.storage import StorageError
from stateful_responses.state.storage.redis import RedisStorage
from stateful_responses.store_emulation.history import History
from stateful_responses.store_emulation.turns import Tenant
from stateful_responses.store_emulation.walk import ChainError

TENANTS = 24  # credentials: their records spread over every master


class Replica:
    """The state store and store emulation's history as one proxy runs them,
    in mitmproxy's test context."""

    def __init__(self, store: str, **options) -> None:
        # Imported here, as the backend the store connects to is: an earlier test may have reloaded the package.
        from stateful_responses.options import Options
        from stateful_responses.settings import Config
        from stateful_responses.state.addon import StateStore
        from stateful_responses.store_emulation.history import History
        from stateful_responses.tenancy import Tenancy
        from stateful_responses.upstreams import Upstreams

        self.config, self.tenancy = Config(), Tenancy()
        self.history = History(self.config)
        self.state = StateStore(self.config, self.tenancy, Upstreams(self.config, self.tenancy), self.history)
        self.options = Options(self.config)
        self.store, self.extra = store, options

    async def __aenter__(self) -> Replica:
        self._context = taddons.context(self.options, self.state)
        self._context.__enter__().configure(self.options, stateful_store=self.store, **self.extra)
        self.state.running()
        for _ in range(500):
            if self.state.up:
                return self
            await asyncio.sleep(0.01)
        raise AssertionError("the store did not connect")

    async def __aexit__(self, *exc) -> None:
        storage = self.state.storage
        self.state.done()
        if storage is not None:
            await storage.close()  # before the task done() leaves it to, which the test's loop may never run
        self._context.__exit__(*exc)

    def tenant(self, n: int) -> Tenant:
        return Tenant.of(self.tenancy.secret, b"Bearer sk-tenant-%d" % n)

    def answer(self, tenant: Tenant, n: int, previous: str | None) -> list[bytes]:
        """Record turn ``n`` (continuing ``previous``); the items it adds to the context."""
        item = {"role": "user", "content": f"turn {n}"}
        output = [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": f"answer {n}", "annotations": []}]}]
        raw_input = [json.dumps(item).encode()]
        self.history.record(tenant, response={"id": f"resp_{n}", "object": "response", "status": "completed",
                                              "output": output},
                            previous_response_id=previous, raw_input=raw_input, stored_upstream=False)
        return raw_input + [json.dumps(o, separators=(",", ":")).encode() for o in output]


async def context_read_cold(storage: RedisStorage, tenant: Tenant, response_id: str) -> list[bytes] | None:
    """The context another replica expands ``response_id`` to (None: not
    found); a ChainError other than "not found" would be a turn without its
    items."""
    try:
        return await History().context(tenant, response_id, storage.get)
    except ChainError as e:
        assert e.code == "previous_response_not_found", e.code
        return None


async def until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.1)


async def test_a_write_the_server_failed_lands_once_it_is_back(redis_server):
    async with Replica(redis_server.url) as proxy:
        tenant = proxy.tenant(0)
        redis_server.stop()
        context = proxy.answer(tenant, 1, None)
        assert not await proxy.state.written(proxy.state.flush(), 5)  # the answer goes on; the write waits
        redis_server.start()  # empty (no persistence): the proxy gives it its secret back, then the write
        reader = RedisStorage(redis_server.url, timeout=5)
        try:
            async def landed() -> bool:
                return await context_read_cold(reader, tenant, "resp_1") == context
            await until(landed)
        finally:
            await reader.close()


async def test_an_answer_that_waits_through_an_outage_is_given_once_the_write_lands(redis_server):
    async with Replica(redis_server.url) as proxy:
        tenant = proxy.tenant(0)
        redis_server.stop()
        context = proxy.answer(tenant, 1, None)
        waiting = asyncio.ensure_future(proxy.state.written(proxy.state.flush(), 10, through_outage=True))
        await asyncio.sleep(1)
        assert not waiting.done()  # the write failed: the answer still waits
        redis_server.start()
        assert await waiting
        reader = RedisStorage(redis_server.url, timeout=5)
        try:
            assert await context_read_cold(reader, tenant, "resp_1") == context  # it was written when answered
        finally:
            await reader.close()
        redis_server.stop()  # down for longer than the wait: not durable
        proxy.answer(tenant, 2, "resp_1")
        assert not await proxy.state.written(proxy.state.flush(), 1, through_outage=True)


async def test_a_master_down_mid_flush_leaves_no_turn_without_its_items_and_the_rest_follows_in_order(tmp_path):
    # The production default node timeout (15 s): until it passes, the other
    # masters serve their slots, so a flush is half taken.
    cluster = start_redis_cluster(tmp_path / "cluster", node_timeout_ms=15000)
    reader = RedisStorage(cluster.url, timeout=5)
    try:
        async with Replica(cluster.url) as proxy:
            tenants = [proxy.tenant(n) for n in range(TENANTS)]
            contexts = [proxy.answer(tenant, 1, None) for tenant in tenants]
            assert await proxy.state.written(proxy.state.flush(), 10)

            cluster.stop_master(1)
            contexts = [context + proxy.answer(tenant, 2, "resp_1") for tenant, context in zip(tenants, contexts)]
            assert not await proxy.state.written(proxy.state.flush(), 10)
            visible = waiting = unreachable = 0
            for tenant, context in zip(tenants, contexts):
                try:
                    seen = await context_read_cold(reader, tenant, "resp_2")
                except StorageError:
                    unreachable += 1  # its shard is on the stopped master
                    continue
                if seen is None:
                    waiting += 1  # not written yet (its check could not be read): nothing of it is seen
                else:
                    assert seen == context  # written whole: the turn with its items
                    visible += 1
            print(f"{TENANTS} tenants, a master down mid-flush: {visible} turns written whole, {waiting} waiting, "
                  f"{unreachable} on the stopped master")
            assert visible and unreachable

            # Written while the rest of the flush waits: it lands after it, never before.
            contexts = [context + proxy.answer(tenant, 3, "resp_2") for tenant, context in zip(tenants, contexts)]
            proxy.state.flush()
            cluster.start_master(1)

            async def all_landed() -> bool:
                try:
                    return all([await context_read_cold(reader, tenant, "resp_3") == context
                                for tenant, context in zip(tenants, contexts)])
                except StorageError:
                    return False
            await until(all_landed)
    finally:
        await reader.close()
        cluster.stop()


async def test_a_proxy_reads_back_what_it_wrote_before_the_store_took_it(tmp_path):
    """A client may name a turn it was just answered before the store took
    the turn's write (the writes wait, the store locked): this proxy's own
    reads see it, never "not found", and its DELETE is queued after it."""
    import sqlite3

    path = tmp_path / "state.db"
    async with Replica(f"sqlite:{path}") as proxy:
        tenant = proxy.tenant(0)
        first = proxy.answer(tenant, 1, None)
        assert await proxy.state.written(proxy.state.flush(), 10)
        lock = sqlite3.connect(path, timeout=10, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # reads go on, writes wait and fail
        try:
            context = first + proxy.answer(tenant, 2, "resp_1")
            assert not await proxy.state.written(proxy.state.flush(), 10)
            cold = History(proxy.config)  # nothing in memory: every record through the state store
            assert await cold.context(tenant, "resp_2", proxy.state.get_strict) == context
            assert await context_read_cold(proxy.state.storage, tenant, "resp_2") is None  # the store alone lacks it
        finally:
            lock.execute("ROLLBACK")
            lock.close()

        async def landed() -> bool:
            return await context_read_cold(proxy.state.storage, tenant, "resp_2") == context
        await until(landed)


async def test_the_store_scale_multiplies_every_tables_cap_on_every_backend(tmp_path):
    """``stateful_store_scale`` raises the records each table keeps, in the
    backend the store opens and in a credential's share of conversations."""
    from stateful_responses.store_emulation.conversations import Conversations
    from stateful_responses.store_emulation.turns import ITEMS, TURNS

    caps = {}
    for store, scale in (("sqlite:" + str(tmp_path / "one.sqlite3"), 1), ("sqlite:" + str(tmp_path / "four.sqlite3"), 4),
                         ("memory", 4)):
        async with Replica(store, stateful_store_scale=scale) as replica:
            conversations = Conversations(config=replica.config)
            caps[store.split(":")[0], scale] = (replica.state.storage._limits[TURNS],
                                                replica.state.storage._limits[ITEMS],
                                                conversations.records_per_tenant)
    assert caps[("sqlite", 1)] == (1_000_000, 4_000_000, 400_000)
    assert caps[("sqlite", 4)] == (4_000_000, 16_000_000, 1_600_000)
    assert caps[("memory", 4)] == (400_000, 1_600_000, 160_000)  # a tenth of the scaled caps


async def test_a_strict_read_counts_this_proxys_log_appends_the_store_has_not_taken_once_each(tmp_path):
    """A log (a conversation's) read strictly while this proxy's appends to
    it wait for the store shows them where the store will number them: one
    the writer is on, one queued behind it, and none twice once the store
    took it (before the writer learns so); a pending drop leaves nothing."""
    from stateful_responses.state.outbox import Write
    from stateful_responses.state.storage import log_entry, log_length

    table, log = "conversations", b"\x00\x01" + b"c" * 14
    async with Replica("sqlite:" + str(tmp_path / "state.sqlite3")) as replica:
        state, outbox = replica.state, replica.history._outbox
        storage = state.storage
        assert storage is not None

        def append(value: bytes, how: str = "append") -> asyncio.Future | None:
            outbox.append(Write(table, log, value, 3600.0, log=how))
            return state.flush()

        async def read() -> tuple[int, list[bytes]]:
            length = log_length((await state.get_strict(table, [log])).get(log))
            entries = await state.get_strict(table, [log_entry(log, n) for n in range(length + 2)])
            return length, [entries[log_entry(log, n)] for n in range(length) if log_entry(log, n) in entries]

        assert await state.written(append(b"v0", "start"), 5)
        gate, write, taken = asyncio.Event(), storage.write, []

        async def held(batch):
            await gate.wait()
            if batch not in taken:
                await write(batch)
        storage.write = held  # the store takes nothing until the gate opens: the writer waits on it
        append(b"v1")
        await asyncio.sleep(0.1)
        assert await read() == (2, [b"v0", b"v1"])  # the one the writer is on
        behind = append(b"v2")
        assert await read() == (3, [b"v0", b"v1", b"v2"])  # and the one queued behind it
        taken.append(state._unwritten[0].batch)
        await write(taken[0])  # the store took v1; the writer has not heard back yet
        assert await read() == (3, [b"v0", b"v1", b"v2"])  # v1 once
        gate.set()
        assert await state.written(behind, 5)
        assert await read() == (3, [b"v0", b"v1", b"v2"])
        gate.clear()
        outbox.append(Write(table, log, None, log="drop"))
        dropped = state.flush()
        assert (await state.get_strict(table, [log, log_entry(log, 0)])) == {}
        storage.write = write
        gate.set()
        assert await state.written(dropped, 5)
        assert (await state.get_strict(table, [log, log_entry(log, 0)])) == {}
