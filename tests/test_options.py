"""Options through a real mitmdump: bad values and misspelled names fail loudly."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
from harness import ADDON, mitmdump_binary


def run_mitmdump(tmp_path, *sets: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Load the addon with no server, replaying an empty flow file: mitmdump
    configures the script, then exits on its own."""
    empty = tmp_path / "empty.flows"
    empty.write_bytes(b"")
    args = [mitmdump_binary(), "-n", "-r", str(empty), "-s", str(ADDON),
            "--set", f"confdir={tmp_path}", "--set", "flow_detail=0"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("stateful_max_chains=lots", "stateful_max_chains"),
        ("stateful_max_chains=0", "stateful_max_chains"),
        ("stateful_debug=maybe", "stateful_debug"),
        ("stateful_base_urls=api.openai.com", "stateful_base_urls"),
        ("stateful_debgu=true", "stateful_debgu"),
        ("stateful_metrics=127.0.0.1:notaport", "stateful_metrics"),
        ("stateful_metrics=9464", "stateful_metrics"),
        ("stateful_traces=jaeger", "stateful_traces"),
    ],
)
def test_bad_options_make_mitmdump_exit_nonzero_naming_the_option(tmp_path, setting, named):
    result = run_mitmdump(tmp_path, setting)
    assert result.returncode != 0
    assert named in result.stdout + result.stderr


def test_good_options_load(tmp_path):
    result = run_mitmdump(tmp_path, "stateful_debug=yes", "stateful_max_chains=9",
                          "stateful_models=gpt-5*", "stateful_base_urls=https://api.openai.com/v1")
    assert result.returncode == 0, result.stdout + result.stderr


def test_metrics_on_an_address_in_use_make_mitmdump_exit_naming_the_option(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_mitmdump(tmp_path, f"stateful_metrics=127.0.0.1:{taken.getsockname()[1]}")
    assert result.returncode != 0
    assert "stateful_metrics: cannot listen on" in result.stdout + result.stderr


def test_traces_without_the_otel_extra_make_mitmdump_exit_naming_it(tmp_path):
    """The SDK hidden from the interpreter (as where the extra is not installed)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hidden:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Hidden())\n")
    result = run_mitmdump(tmp_path, "stateful_traces=otlp", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "pip install 'stateful-responses[otel]'" in result.stdout + result.stderr
    assert run_mitmdump(tmp_path, "stateful_traces=off", env={**os.environ, "PYTHONPATH": str(tmp_path)}
                        ).returncode == 0
