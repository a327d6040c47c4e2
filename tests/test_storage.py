"""The storage backends: one contract every backend keeps, then what each one
does when its file or server misbehaves."""

from __future__ import annotations

import asyncio
import os

import pytest
from stateful_responses.storage import (
    StoreSpec,
    parse_store_spec,
)
from stateful_responses.storage.memory import MemoryStorage

LIMITS = {"small": 3}
BINARY = {b"": b"", b"\x00": b"\x00\xff", bytes(range(32)): bytes(range(256)), b"\xff" * 32: b"v" * 100_000}

# The option value


@pytest.mark.parametrize(("value", "spec"), [
    ("", StoreSpec("sqlite")),
    (" sqlite ", StoreSpec("sqlite")),
    ("memory", StoreSpec("memory")),
    ("sqlite:/var/lib/state.db", StoreSpec("sqlite", path="/var/lib/state.db")),
    ("redis://127.0.0.1:6379/0", StoreSpec("redis", url="redis://127.0.0.1:6379/0")),
    ("rediss://:pw@cache.example:6380/2", StoreSpec("redis", url="rediss://:pw@cache.example:6380/2")),
    ("redis://cache.example", StoreSpec("redis", url="redis://cache.example")),
])
def test_store_values_that_parse(value, spec):
    assert parse_store_spec(value) == spec


def test_a_relative_or_home_sqlite_path_becomes_absolute():
    assert parse_store_spec("sqlite:~/state.db").path == os.path.expanduser("~/state.db")
    assert parse_store_spec("sqlite:state.db").path == os.path.abspath("state.db")


@pytest.mark.parametrize(("value", "complaint"), [
    ("postgres", "unknown store 'postgres'"),
    ("sqlite:", "needs a file path"),
    ("redis:/:hunter2@cache:6379/0", "redis://[:password@]host:port/db"),
    ("redis://:hunter2@/0", "has no host"),
    ("redis://:hunter2@cache:port/0", "port must be a number"),
    ("redis://:hunter2@cache:0/0", "port must be a number"),
    ("redis://:hunter2@cache:99999/0", "port must be a number"),
    ("rediss://:hunter2@cache:6379/zero", "database must be a number"),
    ("redis://:hunter2@cache:6379/0?ssl=1", "no query"),
    (":hunter2@cache:6379", "not a store"),
])
def test_bad_store_values_say_what_is_wrong_without_the_password(value, complaint):
    with pytest.raises(ValueError) as error:
        parse_store_spec(value)
    assert complaint in str(error.value)
    assert "hunter2" not in str(error.value)


# The contract every backend keeps

BACKENDS = ["memory"]


@pytest.fixture(params=BACKENDS)
async def make_storage(request, tmp_path):
    """Builds stores of one kind, all on the same file or server; closes them all."""
    made = []

    def make(limits=LIMITS, **options):
        if request.param == "memory":
            storage = MemoryStorage(limits, **options)
        made.append(storage)
        return storage

    yield make
    for storage in made:
        await storage.close()


@pytest.fixture
async def storage(make_storage):
    storage = make_storage()
    await storage.open()
    return storage


async def test_binary_keys_and_values_come_back_as_written(storage):
    await storage.put("entries", BINARY, ttl=60)
    assert await storage.get("entries", [*BINARY, b"absent"]) == BINARY
    assert await storage.get("entries", []) == {}
    assert await storage.get("never_written", [b"\x00"]) == {}


async def test_put_overwrites_and_tables_are_apart(storage):
    await storage.put("entries", {b"k": b"old"}, ttl=60)
    await storage.put("entries", {b"k": b"new"}, ttl=60)
    await storage.put("marks", {b"k": b"mark"}, ttl=60)
    assert await storage.get("entries", [b"k"]) == {b"k": b"new"}
    assert await storage.scan("marks") == {b"k": b"mark"}


async def test_delete_removes_only_the_named_keys(storage):
    await storage.put("entries", {b"a": b"1", b"b": b"2"}, ttl=60)
    await storage.delete("entries", [b"a", b"never written"])
    await storage.delete("entries", [])
    assert await storage.scan("entries") == {b"b": b"2"}


async def test_records_expire_ttl_seconds_after_their_put(storage):
    await storage.put("entries", {b"short": b"1"}, ttl=0.2)
    await storage.put("entries", {b"long": b"2"}, ttl=60)
    assert await storage.get("entries", [b"short", b"long"]) == {b"short": b"1", b"long": b"2"}
    await asyncio.sleep(0.35)
    assert await storage.get("entries", [b"short", b"long"]) == {b"long": b"2"}
    assert await storage.scan("entries") == {b"long": b"2"}


async def test_a_table_over_its_limit_keeps_its_newest_records(storage):
    for n in range(5):
        await storage.put("small", {bytes([n]): b"v"}, ttl=60)
    assert await storage.scan("small") == {b"\x02": b"v", b"\x03": b"v", b"\x04": b"v"}
    await storage.put("small", {bytes([n]): b"w" for n in range(10, 20)}, ttl=60)
    survivors = await storage.scan("small")
    assert len(survivors) == 3 and set(survivors) <= {bytes([n]) for n in range(10, 20)}


async def test_a_table_without_a_limit_gets_the_default_one(make_storage):
    storage = make_storage(default_limit=4)
    await storage.put("unnamed", {bytes([n]): b"v" for n in range(10)}, ttl=60)
    assert len(await storage.scan("unnamed")) == 4


async def test_the_secret_is_created_once_and_survives_clear(storage):
    secret = await storage.secret()
    assert len(secret) == 32 and secret != bytes(32)
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    await storage.clear()
    assert await storage.secret() == secret


async def test_clear_forgets_every_table_and_the_store_stays_usable(storage):
    await storage.put("entries", {b"a": b"1"}, ttl=60)
    await storage.put("marks", {b"b": b"2"}, ttl=60)
    await storage.clear()
    assert await storage.scan("entries") == {} and await storage.scan("marks") == {}
    await storage.open()  # idempotent
    await storage.ping()
    await storage.put("entries", {b"c": b"3"}, ttl=60)
    assert await storage.get("entries", [b"a", b"c"]) == {b"c": b"3"}


@pytest.mark.parametrize("table", ["", "a:b", "t" * 65, "tab le"])
async def test_table_names_are_plain(storage, table):
    with pytest.raises(ValueError, match="table names"):
        await storage.get(table, [b"k"])
