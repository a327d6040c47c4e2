"""Through real mitmdump processes: state outlives a restart (even a
kill -9), spans replicas sharing one SQLite file or one Redis, and every
store failure is invisible to clients."""

from __future__ import annotations

import resource
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from driver import Conversation, assert_context_preserved, httpx, user_turns

AUTH = {"authorization": "Bearer sk-test-key"}
STORE_FILE = "stateful-responses.sqlite3"


def log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


def continued(emulator) -> list[bool]:
    return [r["continued"] for r in log(emulator) if r["status_code"] == 200]


class Alternating:
    """One conversation whose every request goes to the next proxy in turn
    (a load balancer spreading one agent over replicas)."""

    def __init__(self, proxies, stream: bool = False) -> None:
        self.proxies = proxies
        self.conv = Conversation(proxies[0].url, stream=stream, as_dicts=True)
        self.clients = [self.conv.client] + [self.conv.client.with_options(base_url=p.url + "/v1")
                                             for p in proxies[1:]]
        self.requests = 0

    def _create(self):
        self.conv.client = self.clients[self.requests % len(self.clients)]
        self.requests += 1
        return Conversation._create(self.conv)

    def turns(self, texts) -> None:
        self.conv._create = self._create
        for text in texts:
            self.conv.turn(text)

    def close(self) -> None:
        self.conv.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_after_a_restart_the_first_request_of_a_running_conversation_continues(emulator, start_proxy,
                                                                               tmp_path, stream):
    confdir = str(tmp_path / "confdir")
    Path(confdir).mkdir()
    first = start_proxy(emulator.url, "--set", "stateful_debug=true", confdir=confdir)
    conv = Conversation(first.url, stream=stream, as_dicts=True)
    for text in user_turns(3):
        conv.turn(text)
    output = first.stop()
    assert f"state in sqlite:{confdir}/{STORE_FILE}" in output
    assert "internal error" not in output
    second = start_proxy(emulator.url, "--set", "stateful_debug=true", confdir=confdir, port=first.port)
    before = len(log(emulator))
    conv.turn("the first request after the restart")
    conv.close()
    assert log(emulator)[before]["continued"] is True
    assert "from the store" in second.output()
    assert_context_preserved(conv.sent, log(emulator))
    assert (Path(confdir) / STORE_FILE).stat().st_mode & 0o777 == 0o600


def test_kill_9_mid_stream_leaves_the_store_intact(emulator, start_proxy, tmp_path):
    confdir = str(tmp_path / "confdir")
    Path(confdir).mkdir()
    first = start_proxy(emulator.url, confdir=confdir)
    conv = Conversation(first.url, as_dicts=True)
    for text in user_turns(3):
        conv.turn(text)
    emulator.model.control({"slow_ms": 200})
    body = {"model": "gpt-test", "stream": True, "input": conv.history + [{"role": "user", "content": "cut"}]}
    got_bytes = threading.Event()

    def stream_until_killed() -> None:
        with httpx.Client(trust_env=False, timeout=30) as c:
            try:
                with c.stream("POST", first.url + "/v1/responses", json=body, headers=AUTH) as r:
                    for _ in r.iter_raw():
                        got_bytes.set()
            except httpx.HTTPError:
                pass

    reader = threading.Thread(target=stream_until_killed)
    reader.start()
    assert got_bytes.wait(10)
    first.kill()
    reader.join(10)
    emulator.model.control({"slow_ms": 0})
    start_proxy(emulator.url, confdir=confdir, port=first.port)
    before = len(log(emulator))
    conv.turn("after the crash")
    conv.close()
    assert log(emulator)[before]["continued"] is True
    assert sqlite3.connect(Path(confdir) / STORE_FILE).execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("store", ["redis", "redis-cluster", "sqlite"])
def test_replicas_sharing_a_store_continue_every_request_of_a_client_alternating_between_them(
        emulator, start_proxy, tmp_path, request, store, stream):
    if store == "redis-cluster":  # each replica names another node of the cluster
        specs = [master.url for master in request.getfixturevalue("redis_cluster").masters[:2]]
    else:
        spec = request.getfixturevalue("redis_server").url if store == "redis" else f"sqlite:{tmp_path / 'shared.db'}"
        specs = [spec, spec]
    proxies = [start_proxy(emulator.url, "--set", f"stateful_store={spec}") for spec in specs]
    client = Alternating(proxies, stream=stream)
    client.turns(user_turns(8))
    client.close()
    records = log(emulator)
    assert_context_preserved(client.conv.sent, records)
    assert client.requests >= 10
    assert all(continued(emulator)[1:]), continued(emulator)
    for proxy in proxies:
        assert "unavailable" not in proxy.output() and "internal error" not in proxy.output()
    if store == "redis-cluster":  # the records spread over the masters
        assert sum(1 for keys in request.getfixturevalue("redis_cluster").keys_per_master() if keys) >= 2


def test_redis_stopping_mid_run_is_invisible_and_heals(emulator, start_proxy, redis_server):
    proxy = start_proxy(emulator.url, "--set", f"stateful_store={redis_server.url}")
    conv = Conversation(proxy.url, as_dicts=True)
    for text in user_turns(3):
        conv.turn(text)
    redis_server.stop()
    for text in user_turns(4, tag="outage "):
        conv.turn(text)  # no client-visible error
    redis_server.start()  # same port, empty: a new secret
    healed_after = None
    for n in range(20):
        before = len(log(emulator))
        conv.turn(f"after the outage {n}")
        if log(emulator)[before]["continued"] and n > 0:
            healed_after = n
            break
        time.sleep(0.3)
    conv.close()
    assert healed_after is not None and healed_after <= 12
    assert all(r["status_code"] == 200 for r in log(emulator))
    assert_context_preserved(conv.sent, log(emulator))
    output = proxy.output()
    assert output.count("unavailable") == 1 and output.count("is back") == 1
    assert "internal error" not in output


def _corrupt(path: Path) -> str:
    path.write_bytes(b"this is not a database, whatever its name says\n" * 100)
    return "default"


def _unwritable(path: Path) -> str:
    blocker = path.parent / "not-a-directory"
    blocker.write_text("a file where a directory should be")
    return f"sqlite:{blocker}/state.db"


@pytest.mark.parametrize("damage", [_corrupt, _unwritable], ids=["corrupt", "unwritable"])
def test_a_broken_sqlite_file_is_one_warning_and_the_addon_works_from_memory(emulator, start_proxy, tmp_path,
                                                                            damage):
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    spec = damage(confdir / STORE_FILE)
    extra = [] if spec == "default" else ["--set", f"stateful_store={spec}"]
    proxy = start_proxy(emulator.url, *extra, confdir=str(confdir))
    conv = Conversation(proxy.url)
    for text in user_turns(5):
        conv.turn(text)
    conv.close()
    assert_context_preserved(conv.sent, log(emulator))
    assert all(continued(emulator)[1:])
    output = proxy.output()
    assert output.count("unavailable") == 1 and "working from memory" in output
    assert "Traceback" not in output and "internal error" not in output


def test_a_sqlite_file_locked_by_another_process_is_one_warning(emulator, start_proxy, tmp_path):
    path = tmp_path / "locked.db"
    proxy = start_proxy(emulator.url, "--set", f"stateful_store=sqlite:{path}")
    conv = Conversation(proxy.url)
    conv.turn("before the lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for text in user_turns(4, tag="locked "):
            conv.turn(text)
        time.sleep(2.5)  # past the busy timeout of the writes queued meanwhile
        conv.turn("still locked")
    finally:
        holder.kill()
        holder.wait()
    conv.close()
    assert_context_preserved(conv.sent, log(emulator))
    assert all(continued(emulator)[1:])
    output = proxy.output()
    assert output.count("unavailable") == 1 and "locked" in output


def test_a_full_disk_is_one_warning_and_the_addon_works_from_memory(emulator, start_proxy, tmp_path):
    """No file may grow past 64 KiB (RLIMIT_FSIZE: writes fail as on a full disk).
    The state of this run takes 80 KiB in the file alone (and more in its WAL
    before a checkpoint), so the disk fills up whatever the checkpoints' timing."""
    limit = 64 * 1024

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proxy = start_proxy(emulator.url, "--set", f"stateful_store=sqlite:{tmp_path / 'full.db'}",
                        preexec_fn=small_disk)
    conversations = [Conversation(proxy.url) for _ in range(4)]
    for n in range(12):
        for k, conv in enumerate(conversations):
            conv.turn(f"conversation {k} turn {n}: " + "padding " * 50)
    for conv in conversations:
        conv.close()
    assert all(r["status_code"] == 200 for r in log(emulator))
    assert sum(continued(emulator)) >= 40
    output = proxy.output()
    assert output.count("unavailable") == 1 and "Traceback" not in output
    assert (tmp_path / "full.db").stat().st_size <= limit


def test_a_bad_store_value_stops_mitmdump_naming_the_option(tmp_path):
    from test_options import run_mitmdump

    result = run_mitmdump(tmp_path, "stateful_store=postgres://db/state")
    assert result.returncode != 0 and "stateful_store" in result.stdout + result.stderr
    result = run_mitmdump(tmp_path, "stateful_store=redis://:hunter2@127.0.0.1:notaport/0")
    assert result.returncode != 0 and "hunter2" not in result.stdout + result.stderr
