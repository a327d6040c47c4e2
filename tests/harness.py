"""Processes for the tests, the demo and the benchmarks: free loopback ports,
and mitmdump (or mitmweb) with the addon, started, awaited and stopped.

The emulator has WebSocket mode, as OpenAI's API does, so the addon's default
(``stateful_upstream_websocket=auto``) would answer every full-history request
over an upstream socket. Processes started here take the HTTP path unless they
ask for the bridge (``upstream_websocket="auto"``): most tests are about
forward mode, store emulation and the record over HTTP."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADDON = ROOT / "addon" / "stateful_responses.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, process: subprocess.Popen, what: str,
                   output: Callable[[], str] = lambda: "", timeout: float = 30) -> None:
    """Until ``process`` accepts connections on ``port``; RuntimeError if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode}:\n{output()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start listening:\n{output()}")


class LoopbackServer:
    """A gateway process in front of ``upstream``, on 127.0.0.1 and a free
    port, its output in a log in ``directory``; stopped by ``stop``."""

    name = "server"  # its log's name, and what errors call it

    def __init__(self, upstream: str, directory: Path) -> None:
        self.upstream = upstream
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.log_path = directory / f"{self.name}.log"
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self, args: list[str], env: dict[str, str], timeout: float) -> None:
        """Run ``args`` in ``directory`` until it listens (stopped again if it never does)."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.directory, env=env)
        try:
            wait_listening(self.port, self.process, self.name, self.output, timeout)
        except BaseException:
            self.stop()
            raise

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def mitmdump_binary(name: str = "mitmdump") -> str:
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def mitmdump_args(mode: str, port: int, confdir: str, *extra: str, script: bool = True,
                  upstream_websocket: str = "off") -> list[str]:
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
        args += ["-s", str(ADDON), "--set", f"stateful_upstream_websocket={upstream_websocket}"]
    return args + list(extra)


class Proxy:
    """A mitmdump or mitmweb process; its output goes to a log in ``confdir``."""

    def __init__(self, args: list[str], port: int, confdir: str, owns_confdir: bool = False,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.port = port
        self.confdir = confdir
        self.owns_confdir = owns_confdir
        self._stopped_output: str | None = None
        self.log_path = Path(confdir) / f"mitmdump-{port}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=preexec_fn
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        if self._stopped_output is not None:
            return self._stopped_output
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def ready(self, timeout: float = 30) -> Proxy:
        """This proxy once it listens; stopped (its output kept) if it never does."""
        try:
            wait_listening(self.port, self.process, "mitmdump", self.output, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> str:
        """``kill -9``: no clean shutdown at all."""
        self.process.kill()
        self.process.wait(5)
        return self.stop()

    def stop(self) -> str:
        """Stop the process (and remove its confdir if it owns it); returns its
        output. Stopping again returns the same output."""
        if self._stopped_output is not None:
            return self._stopped_output
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        self._stopped_output = self.log_path.read_text(errors="replace")
        if self.owns_confdir:
            shutil.rmtree(self.confdir, ignore_errors=True)
        return self._stopped_output


def start_mitmdump(upstream: str, *extra: str, mode: str | None = None, script: bool = True,
                   confdir: str | None = None, port: int | None = None,
                   preexec_fn: Callable[[], None] | None = None, upstream_websocket: str = "off") -> Proxy:
    """mitmdump listening when returned, on a free port (or ``port``), with a
    confdir of its own (or ``confdir``, which outlives it: a restart)."""
    owns = confdir is None
    confdir = confdir or tempfile.mkdtemp(prefix="mitm-")
    port = port or free_port()
    return Proxy(mitmdump_args(mode or f"reverse:{upstream}", port, confdir, *extra, script=script,
                               upstream_websocket=upstream_websocket),
                 port, confdir, owns_confdir=owns, preexec_fn=preexec_fn).ready()


NPM_OFFLINE_CODES = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH")


def npm_installed(directory: Path) -> Path:
    """``directory`` with its locked npm packages installed by ``npm ci``, once for as long as its lock is
    unchanged. Test workers run side by side and several modules share a directory (tests/codex,
    tests/node): a file lock makes the others wait for the one install, which they would otherwise tear
    down under each other (``npm ci`` starts by deleting node_modules). Skips (pytest) without Node.js or
    when the registry is unreachable; any other failure fails."""
    import fcntl
    import hashlib

    import pytest

    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js (node and npm) is not installed")
    lock = directory / "package-lock.json"
    stamp = directory / "node_modules" / f".installed-{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}"
    with open(directory / ".npm-install.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not stamp.exists():
            result = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=directory, capture_output=True,
                                    text=True, timeout=600)
            if result.returncode != 0:
                offline = [line for line in result.stderr.splitlines() if any(c in line for c in NPM_OFFLINE_CODES)]
                if offline:
                    pytest.skip(f"npm ci could not reach the registry: {offline[0]}")
                pytest.fail(f"npm ci failed:\n{result.stderr[-3000:]}")
            stamp.touch()
    return directory
