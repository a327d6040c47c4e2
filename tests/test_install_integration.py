"""Installed the way mitmproxy users install things: a wheel built
from the checkout, installed into a fresh virtual environment, run through its
``stateful-responses`` command and through ``mitmdump -s`` on the script path
that command prints; and a mitmproxy whose Python lacks a dependency.

Nothing is downloaded: the wheel is built with the test environment's
setuptools, installed without dependencies, and the fresh environment reaches
mitmproxy, blake3, msgspec and websockets through a ``.pth`` line naming the test
environment's site-packages (which does not process that directory's own
``.pth`` files, so the checkout's editable install stays out of sight)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from driver import Conversation
from harness import ROOT, Proxy, free_port, mitmdump_args

pytestmark = pytest.mark.integration

RUN_MITMDUMP = "from mitmproxy.tools.main import mitmdump; mitmdump()"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path
    command: Path
    site_packages: Path


def run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    work = tmp_path_factory.mktemp("install")
    source = work / "source"  # a copy, so that building leaves no build/ or egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "addon", source / "addon", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--disable-pip-version-check", "--wheel-dir", work / "dist", source)
    (wheel,) = (work / "dist").glob("stateful_responses-*.whl")

    venv = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
        "--disable-pip-version-check", wheel)
    site_packages = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    (site_packages / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return Installed(wheel, python, venv / "bin" / "stateful-responses", site_packages)


def test_the_wheel_holds_one_package_named_for_what_it_is(installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"stateful_responses"}
    assert "stateful_responses/mitmproxy_script.py" in names
    assert "stateful_responses/emulator/server.py" in names
    assert "stateful_responses/websocket/addon.py" in names
    assert "stateful-responses = stateful_responses.cli:main" in entry_points
    imported = run(installed.python, "-c", "import stateful_responses; print(stateful_responses.__file__)").stdout
    assert imported.startswith(str(installed.site_packages)), imported


def continues(proxy: Proxy, emulator) -> None:
    """Two turns of one conversation through ``proxy``: the second goes upstream as a continuation."""
    try:
        conversation = Conversation(proxy.url)
        conversation.turn("turn 0: tell me something")
        conversation.turn("turn 1: tell me more")
        conversation.close()
    except Exception:
        print(proxy.stop())
        raise
    last = emulator.model.snapshot_log()[-1]
    assert last["previous_response_id"] is not None and last["input_items"] == 1, last


def test_mitmdump_loads_the_script_the_command_names(installed, emulator, tmp_path):
    script = Path(run(installed.command, "--script").stdout.strip())
    assert script.is_file() and script.is_relative_to(installed.site_packages), script
    port = free_port()
    args = mitmdump_args(f"reverse:{emulator.url}", port, str(tmp_path), script=False)
    command = [str(installed.python), "-c", RUN_MITMDUMP, *args[1:], "-s", str(script)]
    proxy = Proxy(command, port, str(tmp_path)).ready()
    try:
        continues(proxy, emulator)
    finally:
        output = proxy.stop()
    assert f"Loading script {script}" in output


def test_the_command_runs_a_reverse_proxy_with_the_addon(installed, emulator, tmp_path):
    port = free_port()
    proxy = Proxy([str(installed.command), emulator.url, "--listen-host", "127.0.0.1", "--listen-port", str(port),
                   "--set", f"confdir={tmp_path}", "--set", "stateful_debug=true"], port, str(tmp_path)).ready()
    try:
        continues(proxy, emulator)
    finally:
        output = proxy.stop()
    assert "ws: continued from resp_" in output  # by default, over the upstream's WebSocket mode


@pytest.mark.parametrize("package", ["blake3", "msgspec", "websockets"])
def test_a_mitmproxy_without_a_dependency_exits_with_one_clear_message(package, tmp_path):
    hide = f"import sys; sys.modules[{package!r}] = None; "  # import fails as if it were not installed
    args = mitmdump_args("reverse:http://127.0.0.1:9", free_port(), str(tmp_path))  # with the checkout's script
    result = subprocess.run([sys.executable, "-c", hide + RUN_MITMDUMP, *args[1:]],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count(f"stateful-responses needs the Python package {package!r}") == 1, output
    assert "pipx inject mitmproxy stateful-responses" in output
    assert "uv tool install mitmproxy --with stateful-responses" in output
    assert "Traceback" not in output
