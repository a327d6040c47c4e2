"""Installed the way README says a user installs it: a wheel built from the
checkout, installed into a fresh virtual environment of each Python the
project supports **with its dependencies resolved from the package index**
(no ``--no-deps``, nothing of the test environment on the path), then
``stateful-responses --script`` loaded by that environment's own mitmdump and
a tool-using conversation through it, exact and continued.

A release of any dependency that breaks the addon (websockets 17 dropping
``OP_CONT``, mitmproxy 12.3 no longer bringing zstandard) breaks this test the
day it is published, not a user's install. The three environments are made
side by side (pip mostly waits on downloads). In CI a Python that is missing
fails the test; elsewhere it is skipped.

Also here: a mitmproxy whose Python lacks a dependency ends with one message
that names the package and the command for that environment."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from driver import Conversation, assert_context_preserved, user_turns, without_comparisons
from harness import ROOT, Proxy, free_port, mitmdump_args

pytestmark = pytest.mark.integration

PYTHONS = ("3.11", "3.12", "3.13")
RUN_MITMDUMP = "from mitmproxy.tools.main import mitmdump; mitmdump()"


def run(*args: str | Path, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL, **kwargs)
    assert result.returncode == 0, f"{args}:\n{result.stdout}{result.stderr}"
    return result


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` that really runs (pyenv's shims may not)."""
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("pyenv") else ""
    candidates = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"), reverse=True) if root else []
    candidates += [p for p in (shutil.which(f"python{version}"),) if p]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", f"import sys; assert sys.version.startswith('{version}.')"],
                               capture_output=True)
        if probe.returncode == 0:
            return candidate
    return None


@dataclass(frozen=True)
class Installed:
    python: Path
    bin: Path
    versions: str  # what the index gave, for the failure messages

    @property
    def command(self) -> Path:
        return self.bin / "stateful-responses"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy, so that building leaves no build/ or egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "addon", source / "addon", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--disable-pip-version-check", "--wheel-dir", work / "dist", source)
    (built,) = (work / "dist").glob("stateful_responses-*.whl")
    return built


def install(python: str, wheel: Path, venv: Path) -> Installed:
    """``python -m venv``, then ``pip install <wheel>`` as README says: dependencies from the index."""
    run(python, "-m", "venv", venv)
    bin_dir = venv / "bin"
    run(bin_dir / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    run(bin_dir / "python", "-m", "pip", "check")
    versions = run(bin_dir / "python", "-c", "import importlib.metadata as m; print(' '.join(f'{d}=={m.version(d)}' "
                   "for d in ('mitmproxy', 'websockets', 'zstandard', 'redis', 'msgspec', 'blake3')))").stdout
    return Installed(bin_dir / "python", bin_dir, versions.strip())


@pytest.fixture(scope="module")
def environments(wheel, tmp_path_factory) -> dict[str, Installed | str]:
    """Each supported Python's fresh environment (or why there is none), made side by side."""
    work = tmp_path_factory.mktemp("venvs")
    found = {version: find_python(version) for version in PYTHONS}
    with ThreadPoolExecutor(len(PYTHONS)) as pool:
        futures = {version: pool.submit(install, python, wheel, work / version)
                   for version, python in found.items() if python}
        made: dict[str, Installed | str] = {version: f"no Python {version} interpreter here"
                                            for version, python in found.items() if not python}
        for version, future in futures.items():
            made[version] = future.result()
    return made


def installed_for(environments, version: str) -> Installed:
    env = environments[version]
    if isinstance(env, str):
        if os.environ.get("CI") == "true":
            pytest.fail(env)
        pytest.skip(env)
    return env


def test_the_wheel_holds_one_package_and_declares_what_it_imports(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"stateful_responses"}
    assert "stateful_responses/mitmproxy_script.py" in names
    assert "stateful_responses/emulator/server.py" in names
    assert "stateful-responses = stateful_responses.cli:main" in entry_points
    required = {line.split(":", 1)[1].strip().split(";")[0] for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    for requirement in required - {"certifi>=2019.9.11"}:  # certifi: a CA list by date, no major to bound
        assert "<" in requirement, f"{requirement} has no upper bound (bound it to the majors tested here)"


def six_tool_turns(proxy: Proxy, emulator) -> None:
    """Six user turns with tool calls through ``proxy``: every request exact, and continued upstream
    from the second on."""
    conversation = Conversation(proxy.url)
    try:
        for text in user_turns(6):
            conversation.turn(text)
    except Exception:
        print(proxy.stop())
        raise
    finally:
        conversation.close()
    log = without_comparisons(emulator.model.snapshot_log())  # the usage proof's one comparison is the proxy's
    assert_context_preserved(conversation.sent, log)
    requests = [r for r in log if "context" in r]
    assert len(requests) == len(conversation.sent) >= 8, len(requests)
    continued = [r for r in requests[1:] if r["previous_response_id"] is not None]
    assert len(continued) == len(requests) - 1, [(r["previous_response_id"], r["input_items"]) for r in requests]


@pytest.mark.parametrize("version", PYTHONS)
def test_mitmdump_of_a_fresh_install_continues_a_tool_using_conversation(version, environments, emulator, tmp_path):
    installed = installed_for(environments, version)
    script = Path(run(installed.command, "--script").stdout.strip())
    assert script.is_file() and script.is_relative_to(installed.bin.parent), script
    port = free_port()
    args = mitmdump_args(f"reverse:{emulator.url}", port, str(tmp_path), script=False)
    # the environment's own mitmdump, the addon's options at their defaults (the bridge on: the emulator
    # has WebSocket mode, as OpenAI has)
    proxy = Proxy([str(installed.bin / "mitmdump"), *args[1:], "-s", str(script)], port, str(tmp_path)).ready(60)
    try:
        six_tool_turns(proxy, emulator)
    finally:
        output = proxy.stop()
    assert f"Loading script {script}" in output, installed.versions
    assert "Traceback" not in output and "needs the Python package" not in output, output


@pytest.mark.parametrize("version", PYTHONS)
def test_the_command_of_a_fresh_install_runs_a_reverse_proxy_over_http(version, environments, emulator, tmp_path):
    """README's ``stateful-responses URL``, the bridge off: forward mode's HTTP continuation."""
    installed = installed_for(environments, version)
    port = free_port()
    proxy = Proxy([str(installed.command), emulator.url, "--listen-host", "127.0.0.1", "--listen-port", str(port),
                   "--set", f"confdir={tmp_path}", "--set", "stateful_upstream_websocket=off"],
                  port, str(tmp_path)).ready(60)
    try:
        six_tool_turns(proxy, emulator)
    finally:
        output = proxy.stop()
    assert "Traceback" not in output, output


@pytest.mark.parametrize("package", ["blake3", "msgspec", "websockets", "zstandard", "prometheus_client"])
def test_a_mitmproxy_without_a_dependency_exits_with_the_command_that_installs_it(package, tmp_path):
    from importlib import metadata

    if any(r.lower().startswith(package) for r in metadata.requires("mitmproxy") or []):
        pytest.skip(f"mitmproxy {metadata.version('mitmproxy')} cannot start without {package} itself")
    hide = f"import sys; sys.modules[{package!r}] = None; "  # import fails as if it were not installed
    args = mitmdump_args("reverse:http://127.0.0.1:9", free_port(), str(tmp_path))  # with the checkout's script
    result = subprocess.run([sys.executable, "-c", hide + RUN_MITMDUMP, *args[1:]],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count(f"stateful-responses needs the Python package {package!r}") == 1, output
    distribution = package.replace("_", "-")  # pip's name for it
    assert f"`{sys.executable} -m pip install '{distribution}" in output, output  # this environment's own pip
    assert "Traceback" not in output
