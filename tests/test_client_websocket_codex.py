"""Codex CLI (npm ``@openai/codex`` 0.171.0, ``supports_websockets = true``) through mitmdump in front of
an upstream without WebSocket mode (the emulator's off): the proxy serves the mode, so each ``codex exec``
session opens one socket and is answered on it (without the proxy's mode, Codex retries a refused upgrade
several times before it falls back to HTTP). Its ``generate: false`` warm-up is answered by the proxy and
the turn continuing it goes upstream over HTTP with the warm-up's items first."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from harness import npm_installed
from stateful_responses.emulator import Emulator

CODEX_DIR = Path(__file__).with_name("codex")


@pytest.fixture(scope="session")
def codex() -> Path:
    """The Codex CLI from ``tests/codex``'s lock (``npm ci``, once, shared with the other Codex tests); skips
    without Node.js or the registry."""
    return npm_installed(CODEX_DIR) / "node_modules" / ".bin" / "codex"


def codex_exec(codex: Path, base_url: str, home: Path, prompt: str) -> subprocess.CompletedProcess:
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'''model = "gpt-test"
model_provider = "emu"
[model_providers.emu]
name = "emu"
base_url = "{base_url}"
wire_api = "responses"
env_key = "EMU_KEY"
supports_websockets = true
''')
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(CODEX_HOME=str(home), EMU_KEY="sk-codex")
    return subprocess.run([str(codex), "exec", "--skip-git-repo-check", prompt], env=env, cwd=home,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_codex_sessions_each_open_one_socket_the_proxy_serves(codex, start_proxy, tmp_path):
    with Emulator() as emu:
        emu.model.control({"websocket": "refuse"})
        proxy = start_proxy(emu.url, "--set", "stateful_store=memory", "--set", "stateful_debug=true")
        for n in range(2):
            result = codex_exec(codex, proxy.url + "/v1", tmp_path / f"home{n}", f"say hello {n}")
            assert result.returncode == 0, result.stderr[-3000:] + proxy.output()[-3000:]
            assert "I saw" in result.stdout  # the emulator's answer reached Codex
        log = [r for r in emu.model.snapshot_log() if "context" in r]
    output = proxy.output()
    assert output.count("ws client: serving WebSocket mode") == 2  # one upgrade per session, each served
    assert output.count("refused the WebSocket upgrade") == 1  # the probe, once: then the verdict
    assert len(log) == 2 and all(r["transport"] == "http" and r["store"] is False for r in log)
    for n, seen in enumerate(log):
        roles = [item.get("role") for item in seen["context"]]
        assert roles[0] == "developer"  # the warm-up's items first, from the socket's memory
        assert f"say hello {n}" in str(seen["context"][-1])
