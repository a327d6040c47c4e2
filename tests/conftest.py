"""Fixtures: the emulator in-process, and a real mitmdump with the addon between
it and a client. Everything binds 127.0.0.1 and is stopped even when a test
fails."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from responses_emulator import Emulator

ROOT = Path(__file__).resolve().parents[1]
# Tests talk to 127.0.0.1 only; a proxy from the environment must not intercept that.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = "127.0.0.1,localhost"
ADDON = ROOT / "addon" / "stateful_responses.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mitmdump_binary() -> str:
    candidate = Path(sys.executable).with_name("mitmdump")
    return str(candidate) if candidate.exists() else (shutil.which("mitmdump") or "mitmdump")


class Proxy:
    """A mitmdump process running the addon."""

    def __init__(self, args: list[str], port: int, confdir: str) -> None:
        self.port = port
        self.confdir = confdir
        self.log_path = Path(confdir) / "mitmdump.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mitmdump exited {self.process.returncode}:\n{self.output()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"mitmdump did not start listening:\n{self.output()}")

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        return self.log_path.read_text(errors="replace")


def mitmdump_args(mode: str, port: int, confdir: str, *extra: str, script: bool = True) -> list[str]:
    args = [
        mitmdump_binary(),
        "--mode", mode,
        "--listen-host", "127.0.0.1",
        "--listen-port", str(port),
        "--set", f"confdir={confdir}",
        "--set", "flow_detail=0",
        "--set", "termlog_verbosity=info",
    ]
    if script:
        args += ["-s", str(ADDON)]
    return args + list(extra)


@pytest.fixture
def emulator():
    with Emulator() as emu:
        yield emu


@pytest.fixture
def start_proxy():
    """Start mitmdump with the addon; every proxy started is stopped at teardown."""
    started: list[Proxy] = []
    dirs: list[str] = []

    def start(upstream: str, *extra: str, mode: str | None = None, script: bool = True) -> Proxy:
        confdir = tempfile.mkdtemp(prefix="mitm-")
        dirs.append(confdir)
        port = free_port()
        proxy = Proxy(mitmdump_args(mode or f"reverse:{upstream}", port, confdir, *extra, script=script), port, confdir)
        started.append(proxy)
        proxy.wait_ready()
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def proxy(emulator, start_proxy):
    """mitmdump with the addon (debug on) in reverse mode in front of the emulator."""
    return start_proxy(emulator.url, "--set", "stateful_debug=true")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "start_proxy" in getattr(item, "fixturenames", ()) or "proxy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)

