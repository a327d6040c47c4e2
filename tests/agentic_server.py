"""vLLM's agentic-api for tests, a stateful Rust gateway in front of the
emulator: ``agentic-server`` on 127.0.0.1 and a free port, its database in
memory, stopped at teardown. It runs from a venv of its own
(scripts/install-agentic-api), as LiteLLM does.

It calls the inference server's own ``/v1/responses`` with the whole context
each time (never ``previous_response_id``, never ``store``), so the emulator
stands in for vLLM behind it and records what the model was sent. No
``OPENAI_API_KEY``: it scopes nothing per credential and passes the client's
``Authorization`` on to the emulator."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness import ROOT, LoopbackServer

REQUIREMENTS = ROOT / "tests" / "agentic-api-requirements.txt"
VERSION = re.search(r"^agentic-api==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE).group(1)
VENV = Path(os.environ.get("AGENTIC_API_VENV") or ROOT / ".venv-agentic")
STARTUP_TIMEOUT = 30  # it listens within a second on an idle machine


def agentic_server_binary() -> Path:
    """agentic-api's server in its venv. Skips when the venv is absent; a venv
    without the pinned release is a broken install, a failure."""
    if not VENV.exists():
        pytest.skip(f"agentic-api's venv {VENV} is absent: scripts/install-agentic-api makes it "
                    "(scripts/test runs it)")
    binary = VENV / "bin" / "agentic-server"
    if not binary.exists() or not list(VENV.glob(f"lib/python*/site-packages/agentic_api-{VERSION}.dist-info")):
        pytest.fail(f"{VENV} has no agentic-api {VERSION}: run scripts/install-agentic-api again")
    return binary


def server_environment(home: Path) -> dict[str, str]:
    """The tests' environment without anything that would configure the
    gateway otherwise (a key, OIDC, a database, a config file in the home)."""
    ignored = ("OPENAI_", "OIDC_", "DATABASE_", "LLM_", "GATEWAY_", "AGENTIC_", "SKIP_LLM", "MAX_REQUEST")
    inherited = {name: value for name, value in os.environ.items() if not name.startswith(ignored)}
    return {**inherited, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


class AgenticServer(LoopbackServer):
    name = "agentic-server"

    def start(self) -> None:
        self.launch([str(agentic_server_binary()), "--llm-api-base", f"{self.upstream}/v1",
                     "--gateway-host", "127.0.0.1", "--gateway-port", str(self.port),
                     "--db-url", "sqlite::memory:", "--skip-llm-ready-check"],
                    server_environment(self.directory), STARTUP_TIMEOUT)


@pytest.fixture
def agentic_server(emulator, tmp_path):
    """agentic-server in front of this test's emulator, its store empty."""
    server = AgenticServer(emulator.url, tmp_path / "agentic")
    server.start()
    yield server
    server.stop()
