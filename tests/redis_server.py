"""A real redis-server for tests: 127.0.0.1 on a free port, nothing persisted
unless its options say so, stopped at teardown. It can be stopped and started
again on the same port, paused (SIGSTOP) to make calls time out, and given a
password."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

MISSING = "redis-server not found: install the Debian package redis-server"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    def __init__(self, directory: Path, password: str | None = None, *, port: int | None = None,
                 options: Sequence[str] = ()):
        self.directory = directory
        self.password = password
        self.port = port or free_port()
        self.options = list(options)  # more redis-server options; they win over the defaults above them
        self.process: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [
            shutil.which("redis-server") or "redis-server",
            "--bind", "127.0.0.1", "--port", str(self.port),
            "--save", "", "--appendonly", "no",  # persistence off
            "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log"),
        ]
        if self.password:
            command += ["--requirepass", self.password]
        command += self.options
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._answers_ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                reply = connection.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        os.kill(process.pid, signal.SIGCONT)  # in case it was paused
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """Stop answering (the kernel still accepts connections): calls time out."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


def start_redis_server(directory: Path, password: str | None = None) -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.skip(MISSING)
    server = RedisServer(directory, password)
    server.start()
    return server


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis_server(tmp_path / "redis")
    yield server
    server.stop()
