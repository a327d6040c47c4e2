"""A real three-master Redis Cluster for tests: redis-server processes with
cluster mode on, on free loopback ports, joined by ``redis-cli --cluster
create`` and stopped at teardown.

Each master keeps an append-only file and its cluster config in a directory
of its own, so it can be stopped and started again (same port, same data,
same node id) and keep what it acknowledged. Slots can be moved between
masters mid-run, and keys counted per master."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer, free_port

MISSING = "redis-server or redis-cli not found: install the Debian package redis-server"
SLOTS = 16384
# Low enough that a stopped master is marked failed, and cleared once back, in
# seconds (a failure is undone after twice this); high enough that a busy
# 2-core machine does not make a live master look failed.
NODE_TIMEOUT_MS = 2000


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    while True:
        port = free_port()
        bus = port + 10000
        if port in taken or bus in taken or bus > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", bus))
            except OSError:
                continue
        return port


class LocalCluster:
    def __init__(self, directory: Path, masters: int = 3, *, node_timeout_ms: int = NODE_TIMEOUT_MS):
        taken: set[int] = set()
        self.masters: list[RedisServer] = []
        for i in range(masters):
            port = free_cluster_port(taken)
            taken |= {port, port + 10000}
            self.masters.append(RedisServer(directory / f"master-{i}", port=port, options=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--appendonly", "yes",  # fsync'd every second, and at a clean shutdown
            ]))

    @property
    def url(self) -> str:
        """Any node names the whole cluster: the first one."""
        return self.masters[0].url

    def start(self) -> None:
        for master in self.masters:
            master.start()
        created = subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{master.port}" for master in self.masters), "--cluster-replicas", "0", "--cluster-yes"],
            check=False, capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}{created.stderr}")
        self.wait_until_ok()

    def stop(self) -> None:
        for master in self.masters:
            master.stop()

    def client(self, master: int) -> redis.Redis:
        """A plain client of one master (close it after use)."""
        return redis.Redis(host="127.0.0.1", port=self.masters[master].port, socket_timeout=5)

    def _each(self, command: Callable[[redis.Redis], object], masters: Iterable[int] | None = None) -> list:
        results = []
        for i in range(len(self.masters)) if masters is None else masters:
            with self.client(i) as client:
                results.append(command(client))
        return results

    def wait_until_ok(self, timeout: float = 60) -> None:
        """Until every master says the cluster is ok, with every slot served
        and every master known and not suspected of failing."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = self._each(lambda client: client.cluster("INFO"))
                if all(info["cluster_state"] == "ok" and int(info["cluster_slots_ok"]) == SLOTS
                       and int(info["cluster_known_nodes"]) == len(self.masters) for info in infos):
                    return
            except redis.ConnectionError:
                infos = "a master does not answer"
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout} s: {infos}")
            time.sleep(0.05)

    def stop_master(self, master: int) -> None:
        """Shut one master down (cleanly: its append-only file is complete)."""
        self.masters[master].stop()

    def start_master(self, master: int) -> None:
        """Start a stopped master again on its port and directory; return once
        the cluster is ok again."""
        self.masters[master].start()
        self.wait_until_ok()

    def node_id(self, master: int) -> str:
        with self.client(master) as client:
            return client.cluster("MYID").decode()

    def owner(self, slot: int) -> int:
        """Which master serves ``slot``, as the first master sees it."""
        with self.client(0) as client:
            for address, node in client.cluster("NODES").items():
                for first, *last in node["slots"]:
                    if int(first) <= slot <= int(last[0] if last else first):
                        return next(i for i, m in enumerate(self.masters) if address.endswith(f":{m.port}"))
        raise LookupError(f"no master serves slot {slot}")

    def slots_of(self, master: int) -> list[int]:
        """The slots ``master`` serves, as the first master sees it, lowest first."""
        port = f":{self.masters[master].port}"
        with self.client(0) as client:
            nodes = client.cluster("NODES")
        ranges = next(node["slots"] for address, node in nodes.items() if address.endswith(port))
        return [slot for first, *last in ranges for slot in range(int(first), int(last[0] if last else first) + 1)]

    def move_slots(self, slots: Iterable[int], target: int, *, batch: int = 10, pause: float = 0.0) -> None:
        """Migrate each slot to master ``target`` the way redis-cli's reshard
        does (IMPORTING, MIGRATING, MIGRATE ``batch`` keys at a time, then
        SETSLOT NODE everywhere), waiting ``pause`` seconds between batches so
        that clients meet the slot half moved (ASK, TRYAGAIN)."""
        target_id = self.node_id(target)
        target_port = self.masters[target].port
        for slot in slots:
            source = self.owner(slot)
            if source == target:
                continue
            source_id = self.node_id(source)
            with self.client(source) as source_client, self.client(target) as target_client:
                target_client.cluster("SETSLOT", slot, "IMPORTING", source_id)
                source_client.cluster("SETSLOT", slot, "MIGRATING", target_id)
                # Not client.cluster("GETKEYSINSLOT"): its reply callback decodes keys as text.
                while keys := source_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                    source_client.migrate("127.0.0.1", target_port, keys, 0, 5000)
                    time.sleep(pause)
            # The target first, so that it serves the slot before the source redirects there.
            for i in [target, source, *(i for i in range(len(self.masters)) if i not in (target, source))]:
                with self.client(i) as client:
                    client.cluster("SETSLOT", slot, "NODE", target_id)
        self.wait_until_ok()

    def keys_per_master(self) -> list[int]:
        """DBSIZE of each master: how the keys are spread."""
        return self._each(lambda client: client.dbsize())

    def flush(self) -> None:
        """Forget every key on every master (the cluster stays as it is)."""
        self._each(lambda client: client.flushall())


def start_redis_cluster(directory: Path, **options) -> LocalCluster:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip(MISSING)
    cluster = LocalCluster(directory, **options)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def shared_redis_cluster(tmp_path_factory):
    """One cluster for the tests that neither stop a master nor move slots."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(shared_redis_cluster):
    """The shared cluster, empty."""
    shared_redis_cluster.wait_until_ok()
    shared_redis_cluster.flush()
    return shared_redis_cluster


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A cluster of this test's own, to stop masters or move slots in."""
    cluster = start_redis_cluster(tmp_path / "redis-cluster")
    yield cluster
    cluster.stop()
