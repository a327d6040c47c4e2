"""Forward mode through a real mitmdump, between the openai SDK and the emulator."""

from __future__ import annotations

import time

import pytest
from driver import Conversation, assert_context_preserved, client_turns, drop_nulls, httpx, user_turns


def get_log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("as_dicts", [False, True], ids=["sdk-objects", "model-dump"])
def test_long_tool_conversation_continues_every_request(proxy, emulator, stream, as_dicts):
    conv = Conversation(proxy.url, stream=stream, as_dicts=as_dicts)
    try:
        for text in user_turns(12):
            conv.turn(text)
    finally:
        conv.close()
    everything = get_log(emulator)
    assert len(conv.sent) >= 16  # 12 turns plus the tool loops
    assert_context_preserved(conv.sent, everything)
    # the first continuation whose conversation holds function calls and their outputs was compared with the
    # turn sent whole (once for both kinds); the emulator, a faithful server, keeps them: every turn continued
    log = client_turns(everything)
    assert len(everything) - len(log) == 1
    assert log[0]["continued"] is False
    assert all(r["continued"] for r in log[1:]), [r["continued"] for r in log]
    # each continued request carried only the new items
    for client, seen in zip(conv.sent[1:], log[1:], strict=True):
        assert seen["input_items"] < len(client.body["input"])
    upstream_bytes = sum(r["body_bytes"] for r in everything)
    client_bytes = sum(s.size for s in conv.sent)
    assert upstream_bytes < client_bytes / 2


def test_sse_bytes_reach_the_client_unchanged(proxy, emulator):
    conv = Conversation(proxy.url, as_dicts=True)
    conv.turn("hello there")
    conv.close()
    body = {"model": "gpt-test", "stream": True, "input": conv.history + [{"role": "user", "content": "and now?"}]}
    with httpx.Client(trust_env=False) as client:
        with client.stream("POST", proxy.url + "/v1/responses", json=body,
                           headers={"authorization": "Bearer sk-test-key"}) as answer:
            received = b"".join(answer.iter_raw())
    record = get_log(emulator)[-1]
    assert record["continued"] is True
    assert received == record["sse"].encode()


@pytest.mark.parametrize("restart", [False, True], ids=["same-proxy", "after-a-restart"])
def test_output_echoed_by_reference_continues_at_the_limit(emulator, start_proxy, tmp_path, restart):
    """Clients such as Vercel's AI SDK echo earlier output items as
    ``item_reference``; a reference to an output item equals that item."""
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, confdir=confdir)
    history: list = []
    with httpx.Client(trust_env=False, timeout=30) as c:
        for n in range(8):
            if restart and n == 4:
                proxy.stop()
                proxy = start_proxy(emulator.url, confdir=confdir, port=proxy.port)
            history.append({"role": "user", "content": f"turn {n}"})
            r = c.post(proxy.url + "/v1/responses", json={"model": "gpt-test", "input": history},
                       headers={"authorization": "Bearer sk-ref"})
            assert r.status_code == 200
            history += [{"type": "item_reference", "id": item["id"]} for item in r.json()["output"]]
    log = client_turns(get_log(emulator))  # the first continuation across references was compared, sent whole too
    assert all(r["continued"] for r in log[1:]), [r["continued"] for r in log]
    assert all(r["input_items"] == 1 for r in log)  # only the new user message crossed the wire
    # what the model saw: every reference resolved to the item it names, in order
    outputs = {o["id"]: o for r in log for o in r["output"]}
    for record in log:
        sent = history[: len(record["context"])]
        expected = [outputs[i["id"]] if i.get("type") == "item_reference" else i for i in sent]
        assert drop_nulls(record["context"]) == drop_nulls(expected)
    assert len(log[-1]["context"]) + len(log[-1]["output"]) == len(history)


def test_a_background_response_is_learned_from_when_a_poll_finds_it_finished(emulator, start_proxy):
    """``background: true`` answers at once with ``queued``; the
    finished response arrives by polling ``GET /responses/{id}``."""
    emulator.model.control({"background_delay_ms": 100})
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    headers = {"authorization": "Bearer sk-bg"}
    history = [{"role": "user", "content": "a long task"}]
    with httpx.Client(trust_env=False, timeout=30) as c:
        queued = c.post(proxy.url + "/v1/responses", headers=headers,
                        json={"model": "gpt-test", "input": history, "background": True}).json()
        assert queued["status"] == "queued"
        for _ in range(100):
            polled = c.get(f"{proxy.url}/v1/responses/{queued['id']}", headers=headers).json()
            if polled["status"] == "completed":
                break
            time.sleep(0.05)
        assert polled["status"] == "completed"
        history += polled["output"] + [{"role": "user", "content": "and then?"}]
        assert c.post(proxy.url + "/v1/responses", headers=headers,
                      json={"model": "gpt-test", "input": history}).status_code == 200
    last = get_log(emulator)[-1]
    assert last["continued"] and last["previous_response_id"] == queued["id"] and last["input_items"] == 1
    assert "background" in proxy.output() and "finished" in proxy.output()
