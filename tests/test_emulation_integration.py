"""Store emulation (issue 11) through real mitmdump: clients that send
previous_response_id keep working where the upstream stores nothing, forgets,
or silently ignores the field; the context the upstream sees is, on every
request, the chain the client named."""

from __future__ import annotations

import pytest
from driver import ChainedConversation, assert_chain_context_preserved, user_turns


def log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


UPSTREAMS = {
    "stateless": {"stateless": "reject"},  # llama.cpp: refuses the field
    "ignoring": {"stateless": "ignore"},  # Ollama: accepts it and ignores it
    "forgetting": {"forget_probability": 1.0},  # stores, then has forgotten (expiry, restart, replica)
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("upstream", sorted(UPSTREAMS))
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_the_openai_sdk_with_previous_response_id_keeps_its_context(emulator, start_proxy, mode, upstream, stream):
    emulator.model.control(UPSTREAMS[upstream])
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    conv = ChainedConversation(proxy.url, stream=stream)
    for text in user_turns(7):
        conv.turn(text)
    conv.close()
    assert_chain_context_preserved(conv, log(emulator))
    output = proxy.output()
    assert "internal error" not in output and "Traceback" not in output
