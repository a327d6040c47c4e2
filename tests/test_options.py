"""Options through a real mitmdump: bad values and misspelled names fail loudly."""

from __future__ import annotations

import subprocess

import pytest
from harness import ADDON, mitmdump_binary


def run_mitmdump(tmp_path, *sets: str) -> subprocess.CompletedProcess:
    """Load the addon with no server, replaying an empty flow file: mitmdump
    configures the script, then exits on its own."""
    empty = tmp_path / "empty.flows"
    empty.write_bytes(b"")
    args = [mitmdump_binary(), "-n", "-r", str(empty), "-s", str(ADDON),
            "--set", f"confdir={tmp_path}", "--set", "flow_detail=0"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("stateful_max_chains=lots", "stateful_max_chains"),
        ("stateful_max_chains=0", "stateful_max_chains"),
        ("stateful_debug=maybe", "stateful_debug"),
        ("stateful_base_urls=api.openai.com", "stateful_base_urls"),
        ("stateful_debgu=true", "stateful_debgu"),
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
