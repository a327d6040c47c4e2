"""What an operator sees: decision lines, counters, and never any content."""

from __future__ import annotations

import re

from driver import Conversation, user_turns, without_comparisons

SECRET_KEY = "sk-proj-VerySecretKey0123456789"


def test_debug_log_has_decisions_but_no_prompt_text_or_credential(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    conv = Conversation(proxy.url, api_key=SECRET_KEY, stream=True)
    turns = [t.replace("tell me", "confidential plan zebra-42:") for t in user_turns(7)]
    for text in turns:
        conv.turn(text)
    conv.close()
    # a rejected continuation and a retry, so those lines are printed too
    emulator.model.control({"forget_all": True})
    conv = Conversation(proxy.url, api_key=SECRET_KEY, history=conv.history)
    conv.turn("confidential plan zebra-42: after forgetting")
    conv.close()
    output = proxy.stop()
    texts = {t for t in turns} | {"zebra-42", "confidential plan", SECRET_KEY, SECRET_KEY[8:], "VerySecretKey"}
    answers = [r["output"][-1]["content"][0]["text"] for r in emulator.model.snapshot_log()
               if r.get("output") and r["output"][-1]["type"] == "message"]
    for needle in texts | set(answers) | {"City1", "I saw"}:
        assert needle not in output, f"the proxy printed content: {needle!r}"
    assert re.search(r"rewritten gpt-test: \d+ items, 1 new, previous resp_", output)
    assert "advanced: resp_" in output
    assert "retrying with the original body after 400" in output
    assert "full gpt-test: 1 items (no stored prefix)" in output
    stats = re.search(r"stateful-responses: (requests=.*)", output).group(1)
    counters = dict(kv.split("=") for kv in stats.split())
    # the retry is ours, and so is the comparison (the first continuation across tool calls, sent whole too)
    assert int(counters["requests"]) == len(without_comparisons(emulator.model.snapshot_log())) - 1
    assert int(counters["retries"]) == 1 and int(counters["fallbacks"]) == 1
    assert int(counters["continued"]) >= 8 and int(counters["bytes_saved"]) > 0
