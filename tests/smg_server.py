"""SGLang's Shepherd Model Gateway (smg) for tests, a stateful Rust gateway in
front of the emulator: ``smg launch --backend openai`` on 127.0.0.1 and a free
port, its history in memory (its default: lost on a restart) or in the tests'
Redis, stopped at teardown. It runs from a venv of its own (scripts/install-smg),
as LiteLLM and agentic-api do.

It keeps responses and conversations itself and calls the emulator's own
``/v1/responses`` with the whole context each time (never
``previous_response_id``, always ``store: false``), so the emulator stands in
for the model server behind it and records what the model was sent. It passes
the client's ``Authorization`` on and scopes nothing per credential (no
``--tenant-api-key``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness import ROOT, LoopbackServer, free_port

REQUIREMENTS = ROOT / "tests" / "smg-requirements.txt"
VERSION = re.search(r"^smg==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE).group(1)
VENV = Path(os.environ.get("SMG_VENV") or ROOT / ".venv-smg")
STARTUP_TIMEOUT = 30  # it listens within a second on an idle machine


def smg_binary() -> Path:
    """smg in its venv. Skips when the venv is absent, except in CI (where
    scripts/install-smg ran and a missing venv is a failure); a venv without the
    pinned release is a broken install, a failure."""
    if not VENV.exists():
        message = f"smg's venv {VENV} is absent: scripts/install-smg makes it (scripts/test runs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    binary = VENV / "bin" / "smg"
    if not binary.exists() or not list(VENV.glob(f"lib/python*/site-packages/smg-{VERSION}.dist-info")):
        pytest.fail(f"{VENV} has no smg {VERSION}: run scripts/install-smg again")
    return binary


def server_environment(home: Path) -> dict[str, str]:
    """The tests' environment without anything that would configure smg
    otherwise (a Redis URL, keys, a config file in the home)."""
    ignored = ("OPENAI_", "REDIS_", "SMG_", "SGLANG_", "ORACLE_", "POSTGRES_", "DATABASE_", "RUST_LOG")
    inherited = {name: value for name, value in os.environ.items() if not name.startswith(ignored)}
    return {**inherited, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class SmgServer(LoopbackServer):
    """``redis``: a Redis URL for its history (``--history-backend redis``);
    else its memory backend."""

    name = "smg"

    def __init__(self, upstream: str, directory: Path, redis: str | None = None) -> None:
        super().__init__(upstream, directory)
        self.redis = redis
        self.metrics_port = free_port()  # its Prometheus listener (0.0.0.0:29000 unless told)

    def start(self) -> None:
        history = ["--history-backend", "redis", "--redis-url", self.redis] if self.redis else \
            ["--history-backend", "memory"]
        self.launch([str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--backend", "openai", "--worker-urls", self.upstream, "--disable-health-check",
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                     "--log-level", "warn", *history],
                    server_environment(self.directory), STARTUP_TIMEOUT)

    def restart(self) -> None:
        """Stopped and started again on the same port: its memory backend forgets everything."""
        self.stop()
        self.start()
