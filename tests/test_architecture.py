"""The pure core never imports mitmproxy: tests and benchmarks drive it alone."""

import subprocess
import sys

from harness import ROOT

CORE = [f"stateful_responses.{m}" for m in (
    "items", "store", "planner", "sse", "settings", "state", "chain", "turns", "recorder",
    "storage", "storage.memory", "storage.sqlite", "storage.redis",
    "protocols", "protocols.common", "protocols.responses", "protocols.chat", "protocols.anthropic",
    "protocols.gemini",
)]


def test_the_core_imports_without_mitmproxy():
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'addon')!r}); "
            + "; ".join(f"import {m}" for m in CORE)
            + "; loaded = [m for m in sys.modules if m.split('.')[0] == 'mitmproxy']; print(loaded); assert not loaded")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_emulator_never_imports_the_addon():
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'addon')!r}); import stateful_responses.emulator; "
            "assert not [m for m in sys.modules if m.startswith('stateful_responses.')\n"
            "            and not m.startswith('stateful_responses.emulator')]")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
