"""The served WebSocket mode in front of a real gateway without the mode:
LiteLLM 1.108.7's native pass-through, which accepts the upgrade and closes
the socket after the first ``response.create`` when its own upstream (the
emulator, its WebSocket mode off) refuses the socket. The proxy learns that
from the first socket (a verdict, like a refused upgrade) and serves the mode
from the next one on: each turn over HTTP through LiteLLM, continued there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from driver import expand_input, meaning
from litellm_server import litellm_gateway, module_emulator  # noqa: F401 - fixtures

CLIENTS = Path(__file__).with_name("ws_served_clients.py")
emulator = module_emulator()


def client_run(scenario: str, base_url: str, gateway) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(WS_MODEL=gateway.native_model, WS_KEY=gateway.master_key)
    return subprocess.run([sys.executable, str(CLIENTS), scenario, base_url], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_gateway_that_closes_the_socket_is_learned_once_then_served(litellm_gateway, emulator, start_proxy):
    emulator.model.control({"reset": True, "websocket": "refuse"})
    proxy = start_proxy(litellm_gateway.url, "--set", "stateful_store=memory", "--set", "stateful_debug=true")
    first = client_run("stored", proxy.url + "/v1", litellm_gateway)
    assert first.returncode != 0  # the gateway's socket closed before any event, as without the proxy
    assert not [r for r in emulator.model.snapshot_log() if "context" in r]
    for scenario in ("stored", "store_false"):
        emulator.model.control({"reset": True, "websocket": "refuse"})
        result = client_run(scenario, proxy.url + "/v1", litellm_gateway)
        assert result.returncode == 0, result.stderr[-3000:] + proxy.output()[-3000:]
        got, log = json.loads(result.stdout), [r for r in emulator.model.snapshot_log() if "context" in r]
        assert len(log) == 3 and all(r["transport"] == "http" for r in log)
        for meant, seen in zip(got["meant"], log, strict=True):
            assert meaning(seen["context"]) == meaning(expand_input(meant))
        if scenario == "stored":
            assert [r["continued"] for r in log] == [False, True, True]  # LiteLLM decodes its ids: continued
        else:
            assert [r["input_items"] for r in log] == [1, 3, 5] and not any(r["store"] for r in log)
    assert "closed a WebSocket before its first event" in proxy.output()
