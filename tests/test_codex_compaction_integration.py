"""The real Codex CLI (``tests/codex``, @openai/codex 0.171.0) compacting
through mitmdump: set to compact early (``model_auto_compact_token_limit``),
it sends its remote compaction v2 request (the ``compaction_trigger`` last)
on the second turn of a session. Against an upstream that has compaction the
trigger passes untouched; against one that lacks it the proxy compacts, and
Codex goes on with the proxy's item, which the upstream gets as its summary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from harness import npm_installed

CODEX_DIR = Path(__file__).parent / "codex"


@pytest.fixture(scope="session")
def codex() -> str:
    """The Codex CLI, installed by ``npm ci`` (once, shared with the other Codex tests); skips without Node.js or
    the registry."""
    return str(npm_installed(CODEX_DIR) / "node_modules" / ".bin" / "codex")


def run_session(codex: str, proxy, home: Path, prompts: list[str]) -> list[subprocess.CompletedProcess]:
    """One Codex session, a turn per prompt (``exec``, then ``exec resume --last``),
    its provider the proxy (named OpenAI: Codex compacts remotely only there)."""
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(home), "OPENAI_API_KEY": "sk-codex",
           "NO_PROXY": "*", "no_proxy": "*"}
    env.pop("OPENAI_BASE_URL", None)
    provider = (f'model_providers.proxy={{name="OpenAI", base_url="{proxy.url}/v1", wire_api="responses", '
                'env_key="OPENAI_API_KEY", supports_websockets=false}')
    runs = []
    for n, prompt in enumerate(prompts):
        args = [codex, "exec", "--skip-git-repo-check", "-m", "gpt-5.1-codex", "-c", "model_provider=proxy",
                "-c", provider, "-c", "model_auto_compact_token_limit=2000", "-c", "model_reasoning_effort=low",
                *(["resume", "--last"] if n else []), prompt]
        runs.append(subprocess.run(args, env=env, cwd=home, capture_output=True, text=True, timeout=300,
                                   stdin=subprocess.DEVNULL))
    return runs


def summaries_in(record: dict) -> int:
    return sum(1 for item in record.get("context") or [] if item.get("role") == "user"
               for part in item.get("content") or [] if isinstance(part, dict)
               and part.get("text", "").startswith("A summary of the conversation so far"))


@pytest.mark.parametrize("upstream", ["compaction", "no compaction"])
def test_codex_compacts_early_through_the_proxy(codex, emulator, start_proxy, tmp_path, upstream):
    if upstream == "no compaction":
        emulator.model.control({"compaction": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    runs = run_session(codex, proxy, tmp_path, ["say hi", "say hi again", "and once more"])
    assert [r.returncode for r in runs] == [0, 0, 0], runs[-1].stderr[-3000:]
    assert "context compacted" in runs[1].stderr + runs[2].stderr
    records = emulator.model.snapshot_log()
    for record in records:  # the emulator refuses a trigger anywhere but last, as the API does
        assert "final input item" not in str(record.get("error")), record["error"]
    triggered = [r for r in records if r.get("status_code") == 200 and r.get("previous_response_id") is None
                 and [o.get("type") for o in r.get("output") or []] == ["compaction"]]
    contexts = [i for r in records for i in r.get("context") or []]
    if upstream == "compaction":
        assert triggered and triggered[0]["store"] is False  # passed untouched: its store kept, nothing forced
        assert any(i.get("type") == "compaction" for i in contexts)  # Codex's next window, the item as it is
    else:
        assert not triggered and not any(i.get("type") == "compaction" for i in contexts)
        assert any(summaries_in(r) for r in records)  # the window after: the summary in the item's place
        assert "compacted trigger" in proxy.output()
    output = proxy.output()
    assert "Traceback" not in output and "internal error" not in output
