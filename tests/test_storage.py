"""The storage backends: one contract every backend keeps, then what each one
does when its file or server misbehaves."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import zlib

import pytest
import redis.asyncio
from harness import ROOT
from redis.crc import key_slot
from redis_cluster import start_redis_cluster
from redis_server import start_redis_server
from stateful_responses.state.storage import (
    DEFAULT_SQLITE_FILE,
    SHARD_TAG_SIZE,
    Batch,
    StorageError,
    StoreSpec,
    log_entry,
    log_length,
    open_storage,
    parse_store_spec,
    shard_key,
    shard_tag,
)
from stateful_responses.state.storage.memory import MemoryStorage
from stateful_responses.state.storage.redis import SHARDS, RedisStorage, cluster_shards
from stateful_responses.state.storage.sqlite import GET, SQLiteStorage

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


def test_open_storage_builds_the_named_backend(tmp_path):
    # Names, not classes: test_addon reloads the package, and open_storage imports the backend anew.
    assert open_storage("memory", str(tmp_path), LIMITS).name == "memory"
    assert open_storage("", str(tmp_path), LIMITS).name == f"sqlite:{tmp_path / DEFAULT_SQLITE_FILE}"
    assert open_storage(f"sqlite:{tmp_path}/other.db", "~", LIMITS).name == f"sqlite:{tmp_path}/other.db"
    assert open_storage("rediss://:hunter2@cache.example:6380/2", "~", LIMITS).name == "rediss://cache.example:6380/2"
    assert open_storage("redis://[::1]", "~", LIMITS).name == "redis://[::1]:6379/0"


# The contract every backend keeps

BACKENDS = ["memory", "sqlite", "redis", "redis-cluster"]

# The contract is not about speed: the default half-second fail-fast timeouts
# flake on a busy 2-core machine. Tests about timeouts set their own.
PATIENT = {"connect_timeout": 5.0, "timeout": 5.0}


@pytest.fixture(params=BACKENDS)
async def make_storage(request, tmp_path):
    """Builds stores of one kind, all on the same file or server; closes them all."""
    made = []

    def make(limits=LIMITS, **options):
        if request.param == "memory":
            storage = MemoryStorage(limits, **options)
        elif request.param == "sqlite":
            storage = SQLiteStorage(str(tmp_path / "store.sqlite3"), limits, **options)
        else:
            server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
            storage = RedisStorage(server.url, limits, **{**PATIENT, **options})
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


async def test_a_batch_deletes_then_puts_across_tables_each_with_its_own_ttl(storage):
    await storage.put("entries", {b"a": b"1", b"b": b"2"}, ttl=60)
    await storage.write(Batch(
        deletes=[("entries", [b"a", b"never written"]), ("marks", [])],
        puts=[("entries", {b"c": b"3"}, 60), ("marks", {b"m": b"short"}, 0.5), ("refs", {}, 60)],
    ))
    await storage.write(Batch())
    assert await storage.get("entries", [b"a", b"b", b"c"]) == {b"b": b"2", b"c": b"3"}
    assert await storage.get("marks", [b"m"]) == {b"m": b"short"}
    await asyncio.sleep(0.7)
    assert await storage.get("marks", [b"m"]) == {}
    assert await storage.get("entries", [b"c"]) == {b"c": b"3"}
    with pytest.raises(ValueError):
        await storage.write(Batch(deletes=[("no spaces allowed", [])]))


@pytest.mark.parametrize("make_storage", ["sqlite", "redis"], indirect=True)
async def test_a_batch_that_fails_writes_nothing(storage):
    """One transaction (SQLite) or one script (Redis): the state never
    shows a batch half applied."""
    await storage.put("entries", {b"a": b"1"}, ttl=60)
    with pytest.raises(StorageError):
        await storage.write(Batch(deletes=[("entries", [b"a"])],
                                  puts=[("marks", {b"m": b"1"}, 60), ("refs", {b"r": object()}, 60)]))  # type: ignore[dict-item]
    assert await storage.get("entries", [b"a"]) == {b"a": b"1"}
    assert await storage.get("marks", [b"m"]) == {}


async def test_records_expire_ttl_seconds_after_their_put(storage):
    await storage.put("entries", {b"short": b"1"}, ttl=0.5)
    await storage.put("entries", {b"long": b"2"}, ttl=60)
    assert await storage.get("entries", [b"short", b"long"]) == {b"short": b"1", b"long": b"2"}
    await asyncio.sleep(0.7)
    assert await storage.get("entries", [b"short", b"long"]) == {b"long": b"2"}
    assert await storage.scan("entries") == {b"long": b"2"}


async def test_a_table_over_its_limit_keeps_its_newest_records(storage):
    for n in range(5):
        await storage.put("small", {bytes([n]): b"v"}, ttl=60)
    assert await storage.scan("small") == {b"\x02": b"v", b"\x03": b"v", b"\x04": b"v"}
    await storage.put("small", {bytes([n]): b"w" for n in range(10, 20)}, ttl=60)
    survivors = await storage.scan("small")
    assert len(survivors) == 3 and set(survivors) <= {bytes([n]) for n in range(10, 20)}


async def test_thousands_of_records_in_one_call(storage):
    many = {n.to_bytes(2, "big"): b"v" for n in range(2500)}
    await storage.put("entries", many, ttl=60)
    await storage.put("small", many, ttl=60)
    assert await storage.get("entries", list(many)) == many
    assert await storage.scan("entries") == many
    assert len(await storage.scan("small")) == 3
    await storage.delete("entries", list(many)[:2000])
    assert len(await storage.scan("entries")) == 500
    await storage.clear()
    assert await storage.scan("entries") == {} and await storage.scan("small") == {}


async def test_a_table_without_a_limit_gets_the_default_one(make_storage):
    storage = make_storage(default_limit=4)
    await storage.put("unnamed", {bytes([n]): b"v" for n in range(10)}, ttl=60)
    assert len(await storage.scan("unnamed")) == 4


async def test_the_secret_is_created_once_and_survives_clear(storage):
    secret, older = await storage.keyring()
    assert len(secret) == 32 and secret != bytes(32) and older == ()
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    await storage.clear()
    assert await storage.keyring() == (secret, ())
    assert await storage.keyring(secret) == (secret, ())


async def test_a_secret_a_process_used_before_stays_among_the_older_ones(storage):
    secret, _ = await storage.keyring()
    mine = os.urandom(32)  # what a process used while the store had another (it restarted empty, say)
    assert await storage.keyring(mine) == (secret, (mine,))
    assert await storage.keyring() == (secret, (mine,))


async def test_a_touch_lengthens_a_record_and_never_shortens_or_revives_one(storage):
    await storage.put("entries", {b"short": b"1", b"long": b"2"}, ttl=0.3)
    await storage.put("entries", {b"longest": b"3"}, ttl=60)
    await storage.write(Batch(touches=[("entries", [b"short", b"absent", b"longest"], 30)]))
    await asyncio.sleep(0.5)
    assert await storage.get("entries", [b"short", b"long", b"absent", b"longest"]) == {b"short": b"1",
                                                                                        b"longest": b"3"}
    await storage.write(Batch(touches=[("entries", [b"long"], 30)]))  # expired: stays gone
    assert await storage.get("entries", [b"long"]) == {}


async def test_clear_forgets_every_table_and_the_store_stays_usable(storage):
    await storage.put("entries", {b"a": b"1"}, ttl=60)
    await storage.put("marks", {b"b": b"2"}, ttl=60)
    await storage.clear()
    assert await storage.scan("entries") == {} and await storage.scan("marks") == {}
    await storage.open()  # idempotent
    await storage.ping()
    await storage.put("entries", {b"c": b"3"}, ttl=60)
    assert await storage.get("entries", [b"a", b"c"]) == {b"c": b"3"}


async def test_keys_led_by_a_shard_tag_are_keys_like_any_other(storage):
    tagged = {shard_key(b"tenant-1", b"turn"): b"1", shard_key(b"tenant-1", b"item"): b"2",
              shard_key(b"tenant-2", b"turn"): b"3"}
    assert len({key[:SHARD_TAG_SIZE] for key in tagged}) == 2
    await storage.write(Batch(puts=[("turns", tagged, 60)], deletes=[("turns", [shard_key(b"tenant-2", b"none")])]))
    assert await storage.get("turns", list(tagged)) == tagged
    assert await storage.scan("turns") == tagged


# Append-only logs

LOG = bytes(range(16))


async def read_log(storage, log: bytes = LOG, table: str = "entries") -> list[bytes] | None:
    """A log's entries in order (None: no such log), as a reader gets them."""
    length = (await storage.get(table, [log])).get(log)
    if length is None:
        return None
    keys = [log_entry(log, n) for n in range(log_length(length))]
    found = await storage.get(table, keys)
    return [found.get(key) for key in keys]


async def test_a_log_is_started_then_appended_to_in_order(storage):
    await storage.write(Batch(appends=[("entries", LOG, [b"created"], 60, True)]))
    await storage.write(Batch(appends=[("entries", LOG, [b"one", b"two"], 60, False),
                                       ("entries", LOG, [b"three"], 60, False)]))
    assert await read_log(storage) == [b"created", b"one", b"two", b"three"]
    assert log_length((await storage.get("entries", [LOG]))[LOG]) == 4


async def test_a_log_that_is_not_there_takes_nothing_unless_started(storage):
    await storage.write(Batch(appends=[("entries", LOG, [b"lost"], 60, False)]))
    assert await read_log(storage) is None and await storage.scan("entries") == {}


async def test_a_dropped_log_is_gone_whole_and_takes_no_later_append(storage):
    other = b"\xff" * 16
    await storage.write(Batch(appends=[("entries", LOG, [b"a", b"b"], 60, True),
                                       ("entries", other, [b"kept"], 60, True)]))
    await storage.write(Batch(drops=[("entries", [LOG])], appends=[("entries", LOG, [b"late"], 60, False)]))
    assert await read_log(storage) is None
    assert await storage.scan("entries") == {other: (1).to_bytes(8, "big"), log_entry(other, 0): b"kept"}


async def test_log_entries_expire_each_ttl_after_its_append_and_a_touch_keeps_them(storage):
    await storage.write(Batch(appends=[("entries", LOG, [b"old"], 0.4, True)]))
    await storage.write(Batch(appends=[("entries", LOG, [b"new"], 60, False)]))
    await asyncio.sleep(0.6)
    assert await read_log(storage) == [None, b"new"]  # a reader sees the hole: the log is no longer whole
    await storage.write(Batch(appends=[("entries", LOG, [b"a"], 0.4, False)]))
    await storage.write(Batch(touches=[("entries", [log_entry(LOG, 2)], 60)]))
    await asyncio.sleep(0.6)
    assert (await read_log(storage))[1:] == [b"new", b"a"]  # the length record lives as long as its longest entry


async def test_the_writer_keeps_every_append_and_a_drop_takes_what_was_queued_before_it(storage):
    """What the state store's writer makes of queued writes: appends to one
    log each kept, in order; a log started and dropped in the same batch (a
    conversation made and deleted at once) leaves nothing."""
    from stateful_responses.state.outbox import Write, apply_writes

    other = b"\xff" * 16
    await apply_writes(storage, [Write("entries", LOG, b"start", 60, log="start"),
                           Write("entries", LOG, b"one", 60, log="append"),
                           Write("entries", LOG, b"two", 60, log="append"),
                           Write("entries", other, b"doomed", 60, log="start"),
                           Write("entries", other, b"also doomed", 60, log="append"),
                           Write("entries", other, None, log="drop")])
    assert await read_log(storage) == [b"start", b"one", b"two"]
    assert await read_log(storage, other) is None


@pytest.mark.parametrize("make_storage", ["redis", "redis-cluster"], indirect=True)
async def test_a_batch_sent_again_with_its_once_token_appends_nothing_twice(make_storage):
    """A retry after a failure that may have applied the batch (a timeout):
    the part with appends is skipped, whatever was appended since; a put is
    applied again, alike. Another batch with the same writes appends."""
    storage = make_storage()
    await storage.open()
    other = b"\xff" * 16
    batch = Batch(appends=[("entries", LOG, [b"created"], 60, True)], puts=[("entries", {other: b"v"}, 60)],
                  once=os.urandom(16))
    await storage.write(batch)
    await storage.write(Batch(appends=[("entries", LOG, [b"another writer's"], 60, False)]))
    await storage.write(batch)
    assert await read_log(storage) == [b"created", b"another writer's"]
    assert await storage.get("entries", [other]) == {other: b"v"}
    await storage.write(dataclasses.replace(batch, once=os.urandom(16)))
    assert await read_log(storage) == [b"created", b"another writer's", b"created"]


@pytest.mark.parametrize("make_storage", ["sqlite", "redis", "redis-cluster"], indirect=True)
async def test_concurrent_appends_each_get_their_own_places(make_storage):
    """Two stores on one file or server (two replicas) appending at once:
    every value lands once, nothing is overwritten, each writer's in order."""
    left, right = make_storage(), make_storage()
    await left.open()
    await right.open()
    await left.write(Batch(appends=[("entries", LOG, [b"start"], 60, True)]))

    async def appender(storage, name: bytes) -> None:
        for n in range(40):
            await storage.write(Batch(appends=[("entries", LOG, [name + b"%d" % n], 60, False)]))

    await asyncio.gather(appender(left, b"L"), appender(right, b"R"))
    entries = await read_log(left)
    assert entries[0] == b"start" and sorted(entries[1:]) == sorted([b"L%d" % n for n in range(40)] +
                                                                    [b"R%d" % n for n in range(40)])
    for name in (b"L", b"R"):
        assert [e for e in entries if e.startswith(name)] == [name + b"%d" % n for n in range(40)]


@pytest.mark.parametrize("table", ["", "a:b", "t" * 65, "tab le"])
async def test_table_names_are_plain(storage, table):
    with pytest.raises(ValueError, match="table names"):
        await storage.get(table, [b"k"])


# Other processes


# Run in another process: say "ready", wait for a line on stdin (so that
# several children act at once), open the store, do one thing, print the result.
CHILD = f"""
import asyncio, sys
sys.path.insert(0, {str(ROOT / "addon")!r})
from stateful_responses.state.storage import open_storage

async def main(spec, command, *args):
    storage = open_storage(spec, ".", {{}})
    try:
        print("ready", flush=True)
        sys.stdin.readline()
        await storage.open()
        if command == "secret":
            print((await storage.keyring())[0].hex())
        elif command == "put":
            await storage.put("entries", {{bytes.fromhex(args[0]): bytes.fromhex(args[1])}}, ttl=60)
            print("stored")
        elif command == "get":
            print((await storage.get("entries", [bytes.fromhex(args[0])])).get(bytes.fromhex(args[0]), b"").hex())
    finally:
        await storage.close()

asyncio.run(main(*sys.argv[1:]))
"""


def in_other_processes(spec: str, command: str, *args: str, count: int = 1) -> list[str]:
    """Run CHILD in ``count`` processes that act at the same moment; their outputs."""
    children = [subprocess.Popen([sys.executable, "-c", CHILD, spec, command, *args], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(count)]
    try:
        for child in children:
            assert child.stdout.readline() == "ready\n", child.communicate()[1]
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = [child.communicate(timeout=30) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert all(child.returncode == 0 for child in children), [err for _, err in results]
    return [out.strip() for out, _ in results]


# SQLite


@pytest.fixture
async def sqlite_path(tmp_path):
    return tmp_path / "store.sqlite3"


def query(path, sql: str, *parameters) -> list[tuple]:
    """Look at the file the way another program would."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        return db.execute(sql, parameters).fetchall()


@pytest.fixture
async def make_sqlite(sqlite_path):
    """Builds SQLite stores on one file; closes them all."""
    made = []

    def make(**options):
        made.append(SQLiteStorage(str(sqlite_path), LIMITS, **options))
        return made[-1]

    yield make
    for storage in made:
        await storage.close()


def test_sqlite_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert SQLiteStorage("state.db").name == f"sqlite:{tmp_path}/state.db"


async def test_the_file_and_its_wal_and_shm_are_owner_only_whatever_the_umask(make_sqlite, sqlite_path):
    previous = os.umask(0)
    try:
        storage = make_sqlite()
        await storage.put("entries", {b"k": b"v"}, ttl=60)
    finally:
        os.umask(previous)
    files = [sqlite_path, sqlite_path.with_name(sqlite_path.name + "-wal"), sqlite_path.with_name(sqlite_path.name + "-shm")]
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o600 for f in files}
    assert query(sqlite_path, "PRAGMA journal_mode") == [("wal",)]


async def test_two_processes_read_what_the_other_wrote(make_sqlite, sqlite_path):
    storage = make_sqlite()
    await storage.put("entries", {b"\x01": b"from parent"}, ttl=60)
    assert in_other_processes(f"sqlite:{sqlite_path}", "get", "01") == [b"from parent".hex()]
    assert in_other_processes(f"sqlite:{sqlite_path}", "put", "02", b"from child".hex()) == ["stored"]
    assert await storage.get("entries", [b"\x02"]) == {b"\x02": b"from child"}


async def test_processes_creating_one_file_at_once_get_one_secret(make_sqlite, sqlite_path):
    secrets = in_other_processes(f"sqlite:{sqlite_path}", "secret", count=3)
    assert len(set(secrets)) == 1
    assert (await make_sqlite().keyring())[0].hex() == secrets[0]


async def test_a_file_locked_by_another_process_fails_within_the_busy_timeout(make_sqlite, sqlite_path):
    storage = make_sqlite(busy_timeout=0.3)
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); sys.stdin.readline()", str(sqlite_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(StorageError, match="locked by another connection"):
            await asyncio.wait_for(storage.put("entries", {b"k": b"w"}, ttl=60), timeout=10)
        ticker.cancel()
        assert ticks >= 5  # the event loop ran while the worker waited for the lock
        assert await storage.get("entries", [b"k"]) == {b"k": b"v"}  # WAL: readers do not wait
    finally:
        holder.communicate("release\n", timeout=10)
    await storage.put("entries", {b"k": b"w"}, ttl=60)
    assert await storage.get("entries", [b"k"]) == {b"k": b"w"}


async def test_a_reader_in_another_process_holds_a_write_up_for_about_the_busy_timeout_at_most(make_sqlite,
                                                                                                 sqlite_path):
    """Another process reading an old snapshot keeps the WAL from being
    truncated; the writer's catch-up checkpoint waits the busy timeout on each
    try, so it stops trying once that time went by (fifty tries would hold
    every write of the proxy five seconds here)."""
    storage = make_sqlite(max_bytes=256 * 1024, busy_timeout=0.1)
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "db.execute('BEGIN'); db.execute('SELECT count(*) FROM records').fetchall(); print('reading', flush=True); "
         "sys.stdin.readline()", str(sqlite_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "reading\n"
        for n in range(10):  # 200 KB: the WAL passes twice its bound (64 KiB) and cannot be truncated
            await asyncio.wait_for(storage.put("entries", {n.to_bytes(2, "big"): os.urandom(20_000)}, ttl=60), 2)
    finally:
        reader.communicate("done\n", timeout=10)
    assert len(await storage.get("entries", [n.to_bytes(2, "big") for n in range(10)])) == 10


async def test_a_corrupt_file_fails_to_open_and_a_replaced_one_opens(make_sqlite, sqlite_path):
    sqlite_path.write_bytes(os.urandom(64 * 1024))
    storage = make_sqlite()
    with pytest.raises(StorageError, match="not a database"):
        await storage.open()
    sqlite_path.unlink()
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    assert await storage.get("entries", [b"k"]) == {b"k": b"v"}


async def test_a_path_under_a_regular_file_cannot_be_created(tmp_path):
    (tmp_path / "a_file").write_text("")
    storage = SQLiteStorage(str(tmp_path / "a_file" / "store.sqlite3"))
    with pytest.raises(StorageError, match=r"cannot open or create the file \(Not a directory\)"):
        await storage.open()
    await storage.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
async def test_a_read_only_file_fails_cleanly(make_sqlite, sqlite_path):
    await make_sqlite().put("entries", {b"k": b"v"}, ttl=60)
    sqlite_path.chmod(0o400)
    with pytest.raises(StorageError, match=r"cannot open or create the file \(Permission denied\)"):
        await make_sqlite().put("entries", {b"k": b"w"}, ttl=60)


async def test_another_schema_version_is_refused(make_sqlite, sqlite_path):
    query(sqlite_path, "PRAGMA user_version = 99")
    with pytest.raises(StorageError, match=r"written by another version \(schema 99\)"):
        await make_sqlite().open()


# A full disk, for real: the child's file size limit (RLIMIT_FSIZE) makes the
# kernel refuse SQLite's write() mid-transaction, as a full disk does, and
# SQLite must roll back. (PRAGMA max_page_count would only exercise SQLite's
# own page counting, never a failed write, and would need a test-only argument.)
# The kernel says EFBIG where a full disk says ENOSPC, so SQLite reports an I/O
# error rather than SQLITE_FULL ("disk full"); the recovery is the same.
DISK_FULL_CHILD = f"""
import asyncio, json, os, resource, sys
sys.path.insert(0, {str(ROOT / "addon")!r})
from stateful_responses.state.storage import StorageError
from stateful_responses.state.storage.sqlite import GET, SQLiteStorage

async def main(path):
    storage = SQLiteStorage(path)
    await storage.put("entries", {{b"small": b"v"}}, ttl=60)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        await storage.put("entries", {{b"big": os.urandom(1024 * 1024)}}, ttl=60)
        failure = None
    except StorageError as error:
        failure = str(error)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after_failure = await storage.get("entries", [b"small", b"big"])
    await storage.put("entries", {{b"big": b"fits now"}}, ttl=60)
    after_space = await storage.get("entries", [b"small", b"big"])
    await storage.close()
    print(json.dumps({{"failure": failure, "after_failure": sorted(k.decode() for k in after_failure),
                      "after_space": {{k.decode(): v.decode() for k, v in after_space.items()}}}}))

asyncio.run(main(sys.argv[1]))
"""


def test_a_full_disk_fails_the_put_and_the_store_works_once_there_is_room(sqlite_path):
    child = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(sqlite_path)],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["failure"] == f"sqlite:{sqlite_path}: I/O error"
    assert result["after_failure"] == ["small"]  # the failed put was rolled back whole
    assert result["after_space"] == {"small": "v", "big": "fits now"}


async def test_the_file_stops_growing_at_its_byte_cap(make_sqlite, sqlite_path):
    cap = 512 * 1024
    storage = make_sqlite(max_bytes=cap)
    wal = sqlite_path.with_name(sqlite_path.name + "-wal")
    largest_wal = 0
    for n in range(3000):  # 3 MB of values through a 512 KiB file
        await storage.put("turns", {n.to_bytes(4, "big"): os.urandom(1000)}, ttl=60)
        largest_wal = max(largest_wal, wal.stat().st_size)
    await storage.close()  # once the evictions under way are done
    assert sqlite_path.stat().st_size <= cap * 1.1
    storage = make_sqlite()
    assert await storage.get("turns", [(0).to_bytes(4, "big")]) == {}  # the oldest went first
    assert (2999).to_bytes(4, "big") in await storage.get("turns", [(2999).to_bytes(4, "big")])
    assert largest_wal <= cap  # journal_size_limit and checkpoints keep the WAL small too


async def test_past_its_byte_cap_the_file_loses_the_largest_owners_records_not_a_smaller_ones(make_sqlite,
                                                                                                sqlite_path):
    """One tenant's records (one shard tag, several tables) written first,
    then another's flood and a spread table's: the flood and the spread table
    lose their soonest-expiring records; the small tenant loses nothing, though
    its records are the oldest in the file."""
    storage = make_sqlite(max_bytes=512 * 1024, spread={"entries"})
    kept, flooder = shard_tag(b"kept"), shard_tag(b"flooder")
    conversation = {kept + n.to_bytes(4, "big"): os.urandom(500) for n in range(20)}
    await storage.put("conversations", conversation, ttl=600)
    await storage.put("turns", {kept + b"turn": os.urandom(2000)}, ttl=600)
    for n in range(300):  # 1.5 MB of one tenant's records and 0.75 MB of a spread table's through 512 KiB
        await storage.put("turns", {flooder + n.to_bytes(4, "big"): os.urandom(3500)}, ttl=600)
        await storage.put("items", {flooder + n.to_bytes(4, "big"): os.urandom(1500)}, ttl=600)
        await storage.put("entries", {os.urandom(16): os.urandom(2500)}, ttl=600)
    await storage.close()  # once the evictions under way are done
    assert sqlite_path.stat().st_size <= 512 * 1024 * 1.1
    storage = make_sqlite()
    assert await storage.get("conversations", list(conversation)) == conversation
    assert len(await storage.get("turns", [kept + b"turn"])) == 1
    flood = await storage.get("turns", [flooder + n.to_bytes(4, "big") for n in range(300)])
    assert flooder + (0).to_bytes(4, "big") not in flood and flooder + (299).to_bytes(4, "big") in flood
    assert 0 < len(await storage.scan("entries")) < 300


async def test_an_eviction_that_fails_leaves_the_write_before_it_done(make_sqlite, sqlite_path, monkeypatch):
    """Past the cap, evicting runs after the write's own transaction: a lock
    it meets is not the write's failure, so an append is never sent twice."""
    storage = make_sqlite(max_bytes=64 * 1024)
    await storage.put("entries", {b"big": os.urandom(100_000)}, ttl=60)

    def locked(*_):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(SQLiteStorage, "_evict", locked)
    await storage.write(Batch(appends=[("entries", LOG, [b"once"], 60, True)], once=b"token"))
    assert await read_log(storage) == [b"once"]


async def test_a_get_finds_each_key_by_the_primary_key_not_by_walking_the_table(make_sqlite, sqlite_path):
    await make_sqlite().put("entries", {bytes([n]): b"v" for n in range(100)}, ttl=60)
    plan = query(sqlite_path, "EXPLAIN QUERY PLAN " + GET.format("?, ?"), "entries", 0, b"a", b"b")
    assert [step[3] for step in plan] == ["SEARCH records USING INDEX sqlite_autoindex_records_1 (tbl=? AND key=?)"]


async def test_expired_rows_are_swept_from_the_file(make_sqlite, sqlite_path):
    storage = make_sqlite(sweep_interval=0)
    await storage.put("entries", {bytes([n]): b"v" for n in range(100)}, ttl=0.05)
    await asyncio.sleep(0.1)
    await storage.put("marks", {b"live": b"v"}, ttl=60)
    rows = query(sqlite_path, "SELECT tbl, count(*) FROM records GROUP BY tbl")
    assert rows == [("marks", 1)]


async def test_the_wal_reaches_the_file_in_the_background_between_writes(make_sqlite, sqlite_path):
    """A checkpoint ends in an fsync; the writer's commits (which answers wait
    on) leave it to a thread of its own, long before SQLite's automatic one
    (at 2048 pages here) would run it in a commit."""
    storage = make_sqlite()
    await storage.open()
    before = os.path.getsize(sqlite_path)
    await storage.put("turns", {n.to_bytes(4, "big"): os.urandom(1000) for n in range(200)}, ttl=60)
    for _ in range(100):
        if os.path.getsize(sqlite_path) > before + 200_000:
            break
        await asyncio.sleep(0.02)
    assert os.path.getsize(sqlite_path) > before + 200_000


async def test_close_joins_the_worker_thread(make_sqlite):
    storage = make_sqlite()
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    assert any(t.name.startswith("stateful-sqlite") for t in threading.enumerate())
    await storage.close()
    assert not any(t.name.startswith("stateful-sqlite") for t in threading.enumerate())


# Redis


@pytest.fixture
async def make_redis(redis_server):
    """Builds Redis stores on one server; closes them all."""
    made = []

    def make(url=None, **options):
        made.append(RedisStorage(url or redis_server.url, LIMITS, **{**PATIENT, **options}))
        return made[-1]

    yield make
    for storage in made:
        await storage.close()


@pytest.fixture
async def raw_redis(redis_server):
    """A plain client, to look at what the backend wrote."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_two_processes_share_redis_and_one_secret(make_redis, redis_server):
    storage = make_redis()
    secrets = in_other_processes(redis_server.url, "secret", count=3)
    assert len(set(secrets)) == 1
    assert (await storage.keyring())[0].hex() == secrets[0]
    assert in_other_processes(redis_server.url, "put", "02", b"from child".hex()) == ["stored"]
    assert await storage.get("entries", [b"\x02"]) == {b"\x02": b"from child"}


async def test_every_key_sits_under_one_hash_tag(make_redis, raw_redis):
    storage = make_redis()
    await storage.keyring()
    await storage.put("entries", BINARY, ttl=60)
    await storage.put("marks", {b"m": b"1"}, ttl=60)
    keys = await raw_redis.keys("*")
    assert len(keys) == len(BINARY) + 6  # records, two indexes, the tables set, the secret, the secrets used
    assert all(key.startswith(b"{stateful-responses}:") for key in keys)
    assert len({key_slot(key) for key in keys}) == 1  # one Redis Cluster slot


async def test_the_index_drops_expired_members_and_expires_itself(make_redis, raw_redis):
    storage = make_redis()
    await storage.put("entries", {bytes([n]): b"v" for n in range(50)}, ttl=0.05)
    await asyncio.sleep(0.1)
    await storage.put("entries", {b"live": b"v"}, ttl=30)
    index = b"{stateful-responses}:i:entries"
    assert await raw_redis.zrange(index, 0, -1) == [b"{stateful-responses}:r:entries:live"]
    assert 20_000 < await raw_redis.pttl(index) <= 30_000


async def test_clear_walks_the_indexes_never_the_keyspace(make_redis, raw_redis):
    storage = make_redis()
    await storage.put("entries", BINARY, ttl=60)
    await storage.put("marks", {b"m": b"1"}, ttl=60)
    await raw_redis.set(b"someone else's key", b"kept")
    await raw_redis.config_resetstat()
    await storage.clear()
    commands = await raw_redis.info("commandstats")
    assert not {"cmdstat_scan", "cmdstat_keys"} & set(commands)
    assert sorted(await raw_redis.keys("*")) == [b"someone else's key"]


async def test_a_wrong_password_fails_without_saying_it(tmp_path):
    server = start_redis_server(tmp_path / "redis", password="right-password")
    try:
        storage = RedisStorage(server.url.replace("right-password", "hunter2"))
        with pytest.raises(StorageError) as error:
            await storage.open()
        assert str(error.value) == f"redis://127.0.0.1:{server.port}/0: authentication failed"
        assert "hunter2" not in repr(error.value.__cause__)
        await storage.close()
        storage = RedisStorage(server.url)
        await storage.put("entries", {b"k": b"v"}, ttl=60)
        assert await storage.get("entries", [b"k"]) == {b"k": b"v"}
        await storage.close()
    finally:
        server.stop()


async def test_a_stopped_server_fails_fast_and_a_restarted_one_works_at_the_next_call(make_redis, redis_server):
    storage = make_redis()
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    redis_server.stop()
    for operation in (storage.ping(), storage.get("entries", [b"k"]), storage.put("entries", {b"k": b"w"}, ttl=60)):
        with pytest.raises(StorageError, match=rf"^redis://127.0.0.1:{redis_server.port}/0: unreachable$"):
            await asyncio.wait_for(operation, timeout=10)
    redis_server.start()
    await storage.ping()
    assert await storage.get("entries", [b"k"]) == {}  # persistence is off: the restarted server is empty
    await storage.put("entries", {b"k": b"w"}, ttl=60)
    assert await storage.scan("entries") == {b"k": b"w"}


async def test_a_server_that_stops_answering_times_out_then_recovers(make_redis, redis_server):
    storage = make_redis(timeout=0.3)
    await storage.put("entries", {b"k": b"v"}, ttl=60)
    redis_server.pause()
    try:
        with pytest.raises(StorageError, match="timed out"):
            await asyncio.wait_for(storage.get("entries", [b"k"]), timeout=10)
    finally:
        redis_server.resume()
    assert await storage.get("entries", [b"k"]) == {b"k": b"v"}


async def test_a_redis_that_lost_its_secret_gets_it_back_before_any_record(make_redis, raw_redis):
    storage = make_redis()
    secret, _ = await storage.keyring()
    await raw_redis.flushall()  # a restart without persistence, or an allkeys-* eviction
    await storage.put("entries", {b"k": b"v"}, ttl=60)  # the same transaction publishes the secret again
    assert await raw_redis.get(b"{stateful-responses}:secret") == secret
    assert (await make_redis().keyring())[0] == secret  # a replica starting now shares it
    await raw_redis.flushall()
    assert await make_redis().keyring(secret) == (secret, ())  # so does a reconnect


# Redis Cluster


@pytest.fixture
async def make_redis_at():
    """Builds Redis stores on the URLs given; closes them all."""
    made = []

    def make(url, limits=LIMITS, **options):
        made.append(RedisStorage(url, limits, **{**PATIENT, **options}))
        return made[-1]

    yield make
    for storage in made:
        await storage.close()


def record_keys(cluster) -> list[bytes]:
    """Every record key on every master (KEYS: fine for a test's few thousand)."""
    keys = []
    for master in range(len(cluster.masters)):
        with cluster.client(master) as client:
            keys += [key for key in client.keys("*") if b"}:r:" in key]
    return keys


async def test_any_node_names_the_cluster_and_every_process_gets_one_secret(redis_cluster, make_redis_at):
    stores = [make_redis_at(master.url) for master in redis_cluster.masters]
    records = {bytes([n]): b"%d" % n for n in range(100)}
    await stores[0].put("entries", records, ttl=60)
    for storage in stores[1:]:
        assert await storage.get("entries", list(records)) == records
    secrets = in_other_processes(redis_cluster.masters[2].url, "secret", count=3)
    assert len(set(secrets)) == 1
    assert {(await storage.keyring())[0].hex() for storage in stores} == set(secrets)
    with pytest.raises(StorageError, match="a Redis Cluster has database 0 only"):
        await make_redis_at(redis_cluster.url.removesuffix("/0") + "/1").open()


async def test_a_thousand_tags_spread_over_every_master_each_tag_in_one_slot(redis_cluster, make_redis_at):
    storage = make_redis_at(redis_cluster.url, default_limit=10**6)  # too high a limit for the write to count the table
    await storage.put("turns", {b"warm": b"up"}, ttl=60)  # the scripts are on every master now
    for master in range(len(redis_cluster.masters)):
        with redis_cluster.client(master) as client:
            client.config_resetstat()
    tags = [b"tenant-%d" % n for n in range(1000)]
    await storage.write(Batch(puts=[("turns", {shard_key(tag, b"turn"): b"t" for tag in tags}, 60),
                                    ("items", {shard_key(tag, b"item"): b"i" for tag in tags}, 60)]))

    scripts = 0
    for master in range(len(redis_cluster.masters)):
        with redis_cluster.client(master) as client:
            scripts += client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert scripts == SHARDS  # one script per shard, whatever the tables and tags in it
    keys = redis_cluster.keys_per_master()
    shares = [count / sum(keys) for count in keys]
    print(f"keys per master (DBSIZE) for 1000 tags: {keys}, shares {', '.join(f'{s:.1%}' for s in shares)}")
    assert all(0.25 < share < 0.42 for share in shares), keys
    slots_of_tag: dict[bytes, set[int]] = {}
    for key in record_keys(redis_cluster):
        table_and_key = key.partition(b"}:r:")[2]
        record_key = table_and_key.partition(b":")[2]
        slots_of_tag.setdefault(record_key[:SHARD_TAG_SIZE], set()).add(key_slot(key))
    slots_of_tag.pop(b"warm"[:SHARD_TAG_SIZE], None)
    assert len(slots_of_tag) == len({shard_tag(tag) for tag in tags})  # two-byte tags: a few tenants share one
    assert all(len(slots) == 1 for slots in slots_of_tag.values())
    assert len(set().union(*slots_of_tag.values())) == SHARDS


async def test_a_cluster_table_keeps_about_its_limit_newest_first(redis_cluster, make_redis_at):
    """Each write bounds its shard; the writer counts the whole table after
    putting 1% of its limit, and evicts the soonest beyond it."""
    storage = make_redis_at(redis_cluster.url, limits={"turns": 1000})
    written: list[bytes] = []
    for batch in range(60):
        records = {shard_key(b"tag-%d" % (batch * 50 + n), b"turn"): b"v" for n in range(50)}
        await storage.put("turns", records, ttl=60)
        written += records
    survivors = await storage.scan("turns")
    newest = set(written[-len(survivors):])
    print(f"3000 records put 50 at a time into a table of 1000: {len(survivors)} kept, "
          f"{len(newest & set(survivors))} of them among the newest {len(survivors)}")
    assert 1000 <= len(survivors) <= 1010
    assert len(newest & set(survivors)) >= 0.98 * len(survivors)


async def test_writers_that_each_fill_one_shard_still_keep_a_cluster_table_near_its_limit(redis_cluster,
                                                                                           make_redis_at):
    """A writer counts every shard, not only those it writes to."""
    limit = 200
    writers = [make_redis_at(redis_cluster.masters[n % 3].url, limits={"turns": limit}) for n in range(4)]
    for turn in range(100):
        for n, writer in enumerate(writers):
            await writer.put("turns", {shard_key(b"tenant-%d" % n, b"turn %d" % turn): b"v"}, ttl=60)
    kept = len(await writers[0].scan("turns"))
    print(f"4 writers, one tag each, 400 records into a table of {limit}: {kept} kept")
    assert limit <= kept <= limit + len(writers) * (limit // 100 + 1)


async def test_a_slot_migration_mid_run_loses_nothing(own_redis_cluster, make_redis_at):
    cluster = own_redis_cluster
    storage = make_redis_at(cluster.url)
    acknowledged = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(1000)}
    await storage.put("turns", acknowledged, ttl=600)

    async def step(n: int) -> None:
        """Write a new record, read back fifty acknowledged ones."""
        key = shard_key(b"later-%d" % n, b"turn")
        await storage.put("turns", {key: b"later %d" % n}, ttl=600)
        acknowledged[key] = b"later %d" % n
        sample = list(acknowledged)[n % 1000:][:50]
        assert await storage.get("turns", sample) == {key: acknowledged[key] for key in sample}

    shard_slots = [key_slot(prefix) for prefix in cluster_shards("stateful-responses")]
    moving = [slot for slot in shard_slots if cluster.owner(slot) == 0][:4]
    migration = asyncio.ensure_future(asyncio.to_thread(cluster.move_slots, moving, 2, batch=5, pause=0.02))
    steps = failures = 0
    while not migration.done():
        try:
            await step(steps)
        except StorageError:
            failures += 1  # allowed while a slot is half moved (TRYAGAIN past redis-py's redirections)
        steps += 1
    await migration
    print(f"{steps} writes and reads during the migration of {len(moving)} shards' slots, {failures} failed")
    assert steps > 0 and [cluster.owner(slot) for slot in moving] == [2] * len(moving)
    for n in range(steps, steps + 100):  # settled: the client follows MOVED, no call fails
        await step(n)
    assert await storage.get("turns", list(acknowledged)) == acknowledged
    assert await storage.scan("turns") == acknowledged


async def test_a_stopped_master_fails_fast_and_once_restarted_has_lost_nothing(own_redis_cluster, make_redis_at):
    cluster = own_redis_cluster
    storage = make_redis_at(cluster.url, connect_timeout=0.5, timeout=2.0)  # the defaults
    records = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(300)}
    await storage.put("turns", records, ttl=600)
    await storage.put("marks", {b"m": b"1"}, ttl=600)
    cluster.stop_master(1)
    for operation in (storage.ping(), storage.get("turns", list(records)), storage.scan("marks"),
                      storage.put("turns", records, ttl=600)):  # 300 tags: every master has some
        started = time.monotonic()
        with pytest.raises(StorageError, match=rf"^redis://127.0.0.1:{cluster.masters[0].port}/0: "
                                               r"(unreachable|the cluster is down)$"):
            await asyncio.wait_for(operation, timeout=10)
        assert time.monotonic() - started < 3
    cluster.start_master(1)
    await storage.ping()  # no error once the cluster is ok again
    assert await storage.get("turns", list(records)) == records  # its append-only file kept them
    assert await storage.scan("marks") == {b"m": b"1"}
    await storage.put("turns", {shard_key(b"tenant-0", b"new"): b"v"}, ttl=600)


async def test_a_write_a_stopped_master_fails_names_its_part_and_sending_the_batch_again_completes_it(
        tmp_path, make_redis_at):
    # The production default node timeout: the other masters serve their slots meanwhile.
    cluster = start_redis_cluster(tmp_path / "cluster", node_timeout_ms=15000)
    try:
        storage = make_redis_at(cluster.url)
        await storage.put("turns", {b"warm": b"up"}, ttl=600)  # the scripts are on every master
        owners = [cluster.owner(key_slot(prefix)) for prefix in cluster_shards("stateful-responses")]

        def on_stopped(key: bytes) -> bool:
            return owners[zlib.crc32(key[:SHARD_TAG_SIZE]) % SHARDS] == 1

        records = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(300)}
        logs = [shard_key(b"tenant-%d" % n, b"log") for n in range(30)]
        batch = Batch(puts=[("turns", records, 600)], appends=[("logs", log, [b"entry"], 600, True) for log in logs],
                      once=os.urandom(16))
        cluster.stop_master(1)
        with pytest.raises(StorageError) as caught:
            await storage.write(batch)
        unwritten = caught.value.unwritten
        lost = {key for key in records if on_stopped(key)}
        assert 0 < len(lost) < len(records)
        assert unwritten is not None and unwritten.once == batch.once
        assert [set(part) for _, part, _ in unwritten.puts] == [lost]
        assert [log for _, log, *_ in unwritten.appends] == [log for log in logs if on_stopped(log)]
        cluster.start_master(1)
        assert await storage.get("turns", list(records)) == {k: v for k, v in records.items() if k not in lost}
        await storage.write(batch)  # whole: the parts written before are skipped or written alike
        assert await storage.get("turns", list(records)) == records
        assert [await read_log(storage, log, "logs") for log in logs] == [[b"entry"]] * len(logs)
    finally:
        cluster.stop()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_a_read_on_connections_the_server_closed_is_answered_on_new_ones(kind, request, make_redis_at):
    server = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
    storage = make_redis_at(server.url)
    records = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(300)}
    await storage.put("turns", records, ttl=600)
    for node in getattr(server, "masters", [server]):  # as a restart, or an idle timeout, would
        with redis.Redis(host="127.0.0.1", port=node.port) as admin:
            assert admin.client_kill_filter(_type="normal", skipme=True) > 0
    assert await storage.get("turns", list(records)) == records
    assert await storage.put("turns", records, ttl=600) is None  # the read left connections that work


async def test_a_stopped_master_fails_only_its_own_part_of_calls_in_flight_on_every_master(tmp_path, make_redis_at):
    # The production default node timeout: the other masters serve their slots meanwhile.
    cluster = start_redis_cluster(tmp_path / "cluster", node_timeout_ms=15000)
    try:
        storage = make_redis_at(cluster.url)
        owners = [cluster.owner(key_slot(prefix)) for prefix in cluster_shards("stateful-responses")]

        def on_stopped(key: bytes) -> bool:
            return owners[zlib.crc32(key[:SHARD_TAG_SIZE]) % SHARDS] == 1

        records = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(300)}
        await storage.put("turns", records, ttl=600)
        live = [key for key in records if not on_stopped(key)]
        stopped = {key for key in records if on_stopped(key)}
        cluster.stop_master(1)
        unwritten: list[set[bytes]] = []

        async def write() -> None:
            try:
                await storage.put("turns", records, ttl=600)
            except StorageError as e:
                unwritten.append({key for _, part, _ in e.unwritten.puts for key in part})

        async def read(key: bytes) -> dict[bytes, bytes]:
            return await storage.get("turns", [key])

        for _ in range(20):  # a failed call's recovery never closes the connections other calls are on
            outcomes = await asyncio.gather(write(), *(read(key) for key in live[:10]), write())
            assert outcomes[1:-1] == [{key: records[key]} for key in live[:10]]
        assert unwritten == [stopped] * 40
    finally:
        cluster.stop()


async def test_a_master_that_stops_answering_times_out_then_recovers(own_redis_cluster, make_redis_at):
    cluster = own_redis_cluster
    storage = make_redis_at(cluster.url, timeout=0.3)
    records = {shard_key(b"tenant-%d" % n, b"turn"): b"%d" % n for n in range(300)}
    await storage.put("turns", records, ttl=600)
    cluster.masters[1].pause()
    try:
        started = time.monotonic()
        with pytest.raises(StorageError, match="timed out"):
            await asyncio.wait_for(storage.get("turns", list(records)), timeout=10)
        assert time.monotonic() - started < 3
    finally:
        cluster.masters[1].resume()
    cluster.wait_until_ok()
    assert await storage.get("turns", list(records)) == records
