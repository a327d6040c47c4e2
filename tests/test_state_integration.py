"""Through real mitmdump processes: state outlives a restart (even a
kill -9), spans replicas sharing one SQLite file or one Redis, and every
store failure is invisible to clients."""

from __future__ import annotations

import json
import resource
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from driver import (
    ChainedConversation,
    Conversation,
    assert_chain_context_preserved,
    assert_context_preserved,
    drop_nulls,
    httpx,
    meaning,
    user_turns,
    without_comparisons,
)
from redis.crc import key_slot

AUTH = {"authorization": "Bearer sk-test-key"}
STORE_FILE = "stateful-responses.sqlite3"


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def continued(emulator) -> list[bool]:
    return [r["continued"] for r in log(emulator) if r["status_code"] == 200]


class Alternating:
    """One conversation whose every request goes to the next proxy in turn
    (a load balancer spreading one agent over replicas)."""

    def __init__(self, proxies, stream: bool = False, conversation=Conversation, **options) -> None:
        self.proxies = proxies
        self.conv = conversation(proxies[0].url, stream=stream, as_dicts=True, **options)
        self.clients = [self.conv.client] + [self.conv.client.with_options(base_url=p.url + "/v1")
                                             for p in proxies[1:]]
        self.requests = 0

    def _create(self):
        self.conv.client = self.clients[self.requests % len(self.clients)]
        self.requests += 1
        return type(self.conv)._create(self.conv)

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


def kill_9_mid_stream(proxy, body: dict) -> None:
    """Stream ``body`` through ``proxy`` and kill -9 it once the client has bytes of the answer."""
    got_bytes = threading.Event()

    def stream_until_killed() -> None:
        with httpx.Client(trust_env=False, timeout=30) as c:
            try:
                with c.stream("POST", proxy.url + "/v1/responses", json=body, headers=AUTH) as r:
                    for _ in r.iter_raw():
                        got_bytes.set()
            except httpx.HTTPError:
                pass

    reader = threading.Thread(target=stream_until_killed)
    reader.start()
    assert got_bytes.wait(10)
    proxy.kill()
    reader.join(10)


def test_kill_9_mid_stream_leaves_the_store_intact(emulator, start_proxy, tmp_path):
    confdir = str(tmp_path / "confdir")
    Path(confdir).mkdir()
    first = start_proxy(emulator.url, confdir=confdir)
    conv = Conversation(first.url, as_dicts=True)
    for text in user_turns(3):
        conv.turn(text)
    emulator.model.control({"slow_ms": 200})
    kill_9_mid_stream(first, {"model": "gpt-test", "stream": True,
                              "input": conv.history + [{"role": "user", "content": "cut"}]})
    emulator.model.control({"slow_ms": 0})
    start_proxy(emulator.url, confdir=confdir, port=first.port)
    before = len(log(emulator))
    conv.turn("after the crash")
    conv.close()
    assert log(emulator)[before]["continued"] is True
    assert sqlite3.connect(Path(confdir) / STORE_FILE).execute("PRAGMA integrity_check").fetchone() == ("ok",)


def replica_stores(request, store: str, tmp_path: Path | None = None) -> list[str]:
    """Two replicas' ``stateful_store`` for one shared ``store``: a redis-server, a Cluster (each replica names
    another node of it) or an SQLite file in ``tmp_path``."""
    if store == "redis-cluster":
        return [master.url for master in request.getfixturevalue("redis_cluster").masters[:2]]
    spec = request.getfixturevalue("redis_server").url if store == "redis" else f"sqlite:{tmp_path / 'shared.db'}"
    return [spec, spec]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("store", ["redis", "redis-cluster", "sqlite"])
def test_replicas_sharing_a_store_continue_every_request_of_a_client_alternating_between_them(
        emulator, start_proxy, tmp_path, request, store, stream):
    proxies = [start_proxy(emulator.url, "--set", f"stateful_store={spec}")
               for spec in replica_stores(request, store, tmp_path)]
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


def _of(records: list[dict], tag: str) -> list[dict]:
    """The emulator's records of the conversation whose texts carry ``tag``."""
    return [r for r in records if tag in json.dumps(r.get("context"))]


def _in_use(path: Path) -> bool:
    return all(path.with_name(path.name + suffix).exists() for suffix in ("-wal", "-shm"))


def test_proxies_sharing_one_sqlite_file_each_stopped_killed_and_restarted_lose_nothing(emulator, start_proxy,
                                                                                      tmp_path):
    """Three proxies on one SQLite file (mitmweb and mitmdump on one confdir):
    a full-history client and a ``previous_response_id`` client (the proxy is
    its store) each alternate between them, while one stops and another is
    killed mid-stream, and each comes back. A proxy that stops while others
    use the file leaves their WAL alone, so what they write next is never lost
    to the others: every turn is exact and every id goes on through any proxy."""
    path = tmp_path / "shared.db"
    options = ("--set", f"stateful_store=sqlite:{path}", "--set", "stateful_emulate=always")

    def start(port: int | None = None):
        return start_proxy(emulator.url, *options, port=port)

    with ThreadPoolExecutor(3) as pool:  # three processes creating the file at once
        proxies = list(pool.map(lambda _: start(), range(3)))
    full = Alternating(proxies)
    chain = Alternating(proxies, conversation=ChainedConversation, api_key="sk-chain-key")
    every = [full.clients, chain.clients]
    clients = [list(c) for c in every]
    texts = iter(zip(user_turns(40, tag="full "), user_turns(40, tag="chain "), strict=True))

    def turns(through: list[int], n: int) -> None:
        for kept, used in zip(clients, every, strict=True):
            used[:] = [kept[i] for i in through]
        for _ in range(n):
            one, other = next(texts)
            full.turns([one])
            chain.turns([other])

    turns([0, 1, 2], 3)
    proxies[1].stop()
    assert _in_use(path)  # the others still use its WAL: it stays
    turns([0, 2], 2)
    proxies[1] = start(proxies[1].port)
    turns([0, 1, 2], 3)

    emulator.model.control({"slow_ms": 200})
    kill_9_mid_stream(proxies[2], {"model": "gpt-test", "stream": True, "input": "cut short by kill -9"})
    emulator.model.control({"slow_ms": 0})
    assert _in_use(path)
    turns([0, 1], 2)
    proxies[2] = start(proxies[2].port)
    turns([2, 1, 0], 3)
    proxies[0].stop()
    assert _in_use(path)
    turns([1, 2], 2)
    proxies[0] = start(proxies[0].port)
    turns([0, 2, 1], 3)
    full.close()
    chain.close()

    records = log(emulator)
    assert_context_preserved(full.conv.sent, _of(records, "full turn"))
    assert_chain_context_preserved(chain.conv, _of(records, "chain turn"))
    for proxy in proxies:
        assert "internal error" not in proxy.output()
        proxy.stop()
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_one_credential_filling_the_sqlite_file_never_evicts_another_credentials_conversations(emulator, start_proxy,
                                                                                                tmp_path):
    """At the smallest byte cap (1 MiB), a credential's plain turns fill the
    file over and over; another credential's conversation (Conversations API)
    and ``previous_response_id`` chain, made before and left alone meanwhile,
    go on after a restart, the proxy reading them from the file."""
    path = tmp_path / "capped.db"
    options = ("--set", f"stateful_store=sqlite:{path}", "--set", "stateful_store_max_mb=1",
               "--set", "stateful_emulate=always")
    proxy = start_proxy(emulator.url, *options)
    kept = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-kept-key", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=30))
    conversation = kept.conversations.create(items=[{"role": "user", "content": "kept conversation: opening"}])
    kept.responses.create(model="gpt-test", conversation=conversation.id,
                          input=[{"role": "user", "content": "kept conversation: first question"}])
    items = [item.model_dump(exclude_unset=True)
             for item in kept.conversations.items.list(conversation.id, order="asc", limit=100)]
    chain = ChainedConversation(proxy.url, api_key="sk-kept-key", as_dicts=True)
    for text in user_turns(3, tag="kept chain "):
        chain.turn(text)
    flooded = 0
    with httpx.Client(trust_env=False, timeout=30) as client:
        for n in range(50):  # 1.9 MB of plain turns through a 1 MiB file
            text = f"flood {n}: " + "plain turn padding " * 2000
            answer = client.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-flood-key"},
                                 json={"model": "gpt-test", "input": [{"role": "user", "content": text}]})
            assert answer.status_code == 200, answer.text
            flooded += len(text)
    assert "internal error" not in proxy.stop()
    assert flooded > 1.5 * 1024 * 1024 and path.stat().st_size <= 1.1 * 1024 * 1024

    proxy = start_proxy(emulator.url, *options, port=proxy.port)
    assert [item.model_dump(exclude_unset=True)
            for item in kept.conversations.items.list(conversation.id, order="asc", limit=100)] == items
    question = [{"role": "user", "content": "kept conversation: after the flood"}]
    kept.responses.create(model="gpt-test", conversation=conversation.id, input=question)
    assert meaning(log(emulator)[-1]["context"]) == meaning(items + question)
    chain.turn("kept chain: after the flood")
    chain.close()
    kept.close()
    assert_chain_context_preserved(chain, _of(log(emulator), "kept chain"))
    assert "internal error" not in proxy.output()


def emulating_replicas(emulator, start_proxy, cluster) -> list:
    """Two proxies emulating the store in front of an upstream that keeps
    nothing, each through another node of the cluster."""
    emulator.model.control({"stateless": "reject"})
    return [start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", f"stateful_store={master.url}")
            for master in cluster.masters[:2]]


def records_per_master(cluster, table: str) -> list[int]:
    """How many records of ``table`` each master holds."""
    counts = []
    for master in range(len(cluster.masters)):
        with cluster.client(master) as client:
            counts.append(sum(1 for _ in client.scan_iter(match=f"*}}:r:{table}:*", count=1000)))
    return counts


def test_a_thousand_conversations_of_as_many_tenants_spread_over_every_master(emulator, start_proxy,
                                                                               redis_cluster):
    """Each conversation's first turn through one of two proxies; every
    tenth goes on through the other, continued from the record the first
    left in the cluster."""
    proxies = emulating_replicas(emulator, start_proxy, redis_cluster)
    meant: dict[str, list] = {}
    started = time.monotonic()

    def conversation(n: int) -> None:
        key = {"authorization": f"Bearer sk-tenant-{n}"}
        first, second = {"role": "user", "content": f"c{n} t1"}, {"role": "user", "content": f"c{n} t2"}
        with httpx.Client(trust_env=False, timeout=30) as client:
            one = client.post(proxies[n % 2].url + "/v1/responses", headers=key,
                              json={"model": "gpt-test", "input": [first]})
            assert one.status_code == 200, one.text
            meant[first["content"]] = [first]
            if n % 10 == 0:
                two = client.post(proxies[1 - n % 2].url + "/v1/responses", headers=key,
                                  json={"model": "gpt-test", "input": [second],
                                        "previous_response_id": one.json()["id"]})
                assert two.status_code == 200, two.text
                meant[second["content"]] = [first, *one.json()["output"], second]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(conversation, range(1000)))
    took = time.monotonic() - started
    served = [r for r in log(emulator) if r["status_code"] == 200]
    assert len(served) == len(meant) == 1100
    for record in served:
        text = record["context"][-1]["content"]
        assert drop_nulls(record["context"]) == drop_nulls(meant[text]), text
    turns = records_per_master(redis_cluster, "turns")
    shares = [n / sum(turns) for n in turns]
    shards = set()
    for master in range(3):
        with redis_cluster.client(master) as client:
            shards |= {key.partition(b"}")[0] for key in client.scan_iter(match="*}:r:turns:*", count=1000)}
    print(f"1000 conversations of 1000 tenants, 1100 turns in {took:.1f} s: turn records per master {turns}, "
          f"shares {', '.join(f'{share:.1%}' for share in shares)}, {len(shards)} of 64 shards")
    assert sum(turns) == 1100 and all(0.25 < share < 0.42 for share in shares), turns
    assert len(shards) == 64
    for proxy in proxies:
        assert "unavailable" not in proxy.output() and "internal error" not in proxy.output()


def test_a_slot_resharded_mid_run_by_redis_cli_loses_no_turn(emulator, start_proxy, own_redis_cluster, tmp_path):
    """Clients alternating between two proxies that emulate the store: every
    request is expanded from the cluster (the other proxy recorded the turn
    before), while ``redis-cli --cluster reshard`` moves a slot holding a
    tenant's records (and the slots below it) to another master."""
    cluster = own_redis_cluster
    proxies = emulating_replicas(emulator, start_proxy, cluster)
    clients = [Alternating(proxies, conversation=ChainedConversation, api_key=f"sk-tenant-{n}") for n in range(12)]
    for n, client in enumerate(clients):
        client.turns([f"tenant {n}: the first turn"])
    used: dict[int, int] = {}  # slot -> its master, of every slot holding a turn
    for master in range(3):
        with cluster.client(master) as client:
            used.update((key_slot(key), master) for key in client.scan_iter(match="*}:r:turns:*"))
    owned = {master: cluster.slots_of(master) for master in range(3)}

    def moved_with(slot: int) -> int:
        """How many slots reshard moves from the slot's master to take it (it takes the lowest first)."""
        return sum(1 for s in owned[used[slot]] if s <= slot)

    slot = min(used, key=moved_with)
    source = used[slot]
    target = (source + 1) % 3
    report = open(tmp_path / "reshard.log", "w+")  # a file: a pipe nobody reads would fill and stop it
    reshard = subprocess.Popen(
        ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{cluster.masters[0].port}",
         "--cluster-from", cluster.node_id(source), "--cluster-to", cluster.node_id(target),
         "--cluster-slots", str(moved_with(slot)), "--cluster-yes", "--cluster-pipeline", "2"],
        stdout=report, stderr=subprocess.STDOUT, text=True)
    rounds = 0
    while reshard.poll() is None:  # paced: the chains stay far from the proxy's depth bound
        for n, client in enumerate(clients):
            client.turns([f"tenant {n}: while slots move, {rounds}"])
        rounds += 1
        time.sleep(0.05)
    report.seek(0)
    assert reshard.returncode == 0, report.read()[-2000:]
    report.close()
    cluster.wait_until_ok()
    for n, client in enumerate(clients):
        client.turns([f"tenant {n}: after the move"])
        client.close()
    print(f"{len(clients)} tenants alternating over 2 proxies, rounds of turns while reshard moved "
          f"{moved_with(slot)} slots from master {source} to {target}: {rounds}")
    assert rounds >= 1 and cluster.owner(slot) == target
    records = log(emulator)
    assert all(r["status_code"] == 200 for r in records)
    for n, client in enumerate(clients):
        assert_chain_context_preserved(client.conv, [r for r in records
                                                     if r["context"][0]["content"].startswith(f"tenant {n}:")])
    for proxy in proxies:
        assert "unavailable" not in proxy.output() and "internal error" not in proxy.output()


def test_a_master_stopped_and_restarted_mid_run_loses_no_turn(emulator, start_proxy, own_redis_cluster):
    """Forward mode, a client alternating between two proxies: while a master
    is down (and then the whole cluster, once it is marked failed) every
    request still gets its answer, whole where the store cannot say; once the
    master is back, what the proxies learned meanwhile reaches the store: a
    third proxy that has seen nothing continues from every turn of the
    outage."""
    cluster = own_redis_cluster
    proxies = [start_proxy(emulator.url, "--set", f"stateful_store={cluster.masters[n].url}") for n in (0, 2)]
    client = Alternating(proxies)
    client.turns(user_turns(3))
    cluster.stop_master(1)
    before = len(log(emulator))
    client.turns(user_turns(4, tag="outage "))
    during = log(emulator)[before:]
    cluster.start_master(1)
    client.turns(user_turns(2, tag="after "))
    client.close()
    records = log(emulator)
    assert all(r["status_code"] == 200 for r in records)
    assert_context_preserved(client.conv.sent, records)
    cold = start_proxy(emulator.url, "--set", f"stateful_store={cluster.masters[2].url}")
    sent = {record["response_id"]: client.conv.sent[records.index(record)].body["input"] for record in during}
    deadline = time.monotonic() + 30  # the proxies reconnect within seconds, then write what waited
    for record in during:  # a fork right after each answer of the outage
        fork = [*sent[record["response_id"]], *record["output"], {"role": "user", "content": "a fork"}]
        while True:
            with httpx.Client(trust_env=False, timeout=30) as http:
                answer = http.post(cold.url + "/v1/responses", headers=AUTH, json={"model": "gpt-test", "input": fork})
            assert answer.status_code == 200, answer.text
            if log(emulator)[-1]["previous_response_id"] == record["response_id"]:
                break
            assert time.monotonic() < deadline, [proxy.output()[-2000:] for proxy in proxies]
            time.sleep(0.5)
    print(f"{len(during)} requests while master 1 was down, each continued from by a cold proxy after "
          f"{30 - (deadline - time.monotonic()):.1f} s")
    for proxy in proxies:
        assert "internal error" not in proxy.output()


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
