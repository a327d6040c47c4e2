"""Fixtures: the emulator in-process, a real mitmdump with the addon between
it and a client, and other real servers (redis-server, LiteLLM's proxy).
Everything binds 127.0.0.1 and is stopped even when a test fails."""

from __future__ import annotations

import os

import pytest
from agentic_server import agentic_server  # noqa: F401 (a fixture: vLLM's agentic-api in front of the emulator)
from harness import start_mitmdump
from litellm_server import fresh_emulator, litellm_gateway  # noqa: F401 (fixtures: a real LiteLLM proxy in front of
# the emulator)
from redis_cluster import own_redis_cluster, redis_cluster, shared_redis_cluster  # noqa: F401 (a real Redis Cluster)
from redis_server import redis_server  # noqa: F401 (a fixture: a real redis-server on loopback)
from stateful_responses.emulator import Emulator

# Tests talk to 127.0.0.1 only; a proxy from the environment must not intercept that.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = "127.0.0.1,localhost"


@pytest.fixture
def emulator():
    with Emulator() as emu:
        yield emu


PROXIES = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report shows the end of each proxy's output: a failure seen once in CI is read there."""
    report = yield
    if report.when == "call" and report.failed:
        for n, proxy in enumerate(item.stash.get(PROXIES, [])):
            report.sections.append((f"proxy {n}, its output's last 150 lines",
                                    "\n".join(proxy.output().splitlines()[-150:])))
    return report


@pytest.fixture
def start_proxy(request):
    """Start mitmdump with the addon; every proxy started is stopped at teardown."""
    started = request.node.stash[PROXIES] = []

    def start(upstream: str, *extra: str, **options):
        started.append(start_mitmdump(upstream, *extra, **options))
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(emulator, start_proxy):
    """mitmdump with the addon (debug on) in reverse mode in front of the emulator."""
    return start_proxy(emulator.url, "--set", "stateful_debug=true")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if {"start_proxy", "proxy", "litellm_gateway", "agentic_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)

