"""Forward mode's glue where it went wrong once, each through a real mitmdump:
transient refusals, a failed retry, ``stream_large_bodies``, answers that prove
nothing, and credentials in odd places."""

from __future__ import annotations

import json

import openai
import pytest
from driver import Conversation, assert_context_preserved, httpx, user_turns, without_comparisons

AUTH = {"authorization": "Bearer sk-test-key", "content-type": "application/json"}


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def post(url: str, body: dict, headers: dict = AUTH, **client) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30, **client) as c:
        return c.post(url + "/v1/responses", content=json.dumps(body).encode(), headers=headers)


def test_one_429_never_switches_forcing_off_for_a_store_false_client(proxy, emulator):
    """A Codex-like client (store:false, full history) meets a 429 on its first
    request: the client gets the 429 itself, and is continued afterwards."""
    emulator.model.control({"fail_next": [{"kind": "status", "status": 429}]})
    history = [{"role": "user", "content": "first"}]
    first = post(proxy.url, {"model": "gpt-test", "store": False, "input": history})
    assert first.status_code == 429
    assert [r["status_code"] for r in log(emulator)] == [429]  # passed on, not retried by us
    for n in range(6):
        answer = post(proxy.url, {"model": "gpt-test", "store": False, "input": history})
        assert answer.status_code == 200
        history += answer.json()["output"] + [{"role": "user", "content": f"turn {n}"}]
    served = [r for r in log(emulator) if r["status_code"] == 200]
    assert [r["continued"] for r in served] == [False] + [True] * 5


def test_a_429_on_a_continuation_keeps_its_parent(proxy, emulator):
    conv = Conversation(proxy.url, as_dicts=True)
    conv.turn("one")
    emulator.model.control({"fail_next": [{"kind": "status", "status": 429, "when": "continued"}]})
    with pytest.raises(openai.RateLimitError):  # the upstream's own answer, untouched
        conv.turn("two")
    conv.history.pop()
    conv.sent.pop()
    conv.turn("two")
    conv.close()
    refused, served = log(emulator)[-2:]
    assert refused["status_code"] == 429 and served["status_code"] == 200
    assert served["previous_response_id"] == refused["previous_response_id"]  # the parent was not dropped


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failed_retry_hands_the_client_a_502_not_our_refusal(proxy, emulator, stream):
    conv = Conversation(proxy.url, stream=stream)
    conv.turn("one")
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}, {"kind": "reset"}]})
    with pytest.raises(openai.InternalServerError) as caught:  # an SDK retries this one
        conv.turn("two")
    conv.close()
    assert caught.value.status_code == 502
    statuses = [r["status_code"] for r in log(emulator)]
    assert statuses[-2:] == [400, 200]  # our refused rewrite, then the original, reset on the wire
    assert "internal error" not in proxy.output()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stream_large_bodies_neither_switches_the_addon_off_nor_empties_a_retry(emulator, start_proxy, stream):
    proxy = start_proxy(emulator.url, "--set", "stream_large_bodies=1k", "--set", "stateful_debug=true")
    conv = Conversation(proxy.url, stream=stream, as_dicts=True)
    for text in user_turns(5):
        conv.turn(text)
    assert all(r["continued"] for r in log(emulator)[1:]), "requests above stream_large_bodies went out full"
    assert sum(s.size > 1024 for s in conv.sent) >= 4  # most bodies were above the limit
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}]})
    conv.turn("a rejected continuation whose retry answer is above the limit")
    conv.close()
    retried = log(emulator)[-1]
    assert retried["status_code"] == 200 and not retried["continued"]
    if stream:
        assert len(retried["sse"]) > 1024
    assert_context_preserved(conv.sent, [r for r in log(emulator) if r["status_code"] == 200])


def test_a_retried_json_answer_above_stream_large_bodies_arrives_whole(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stream_large_bodies=1k")
    metadata = {f"k{n}": "m" * 500 for n in range(4)}  # echoed in the answer: above the limit
    history = [{"role": "user", "content": "x" * 2000}]
    first = post(proxy.url, {"model": "gpt-test", "input": history, "metadata": metadata}).json()
    history += first["output"] + [{"role": "user", "content": "y" * 2000}]
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}]})
    answer = post(proxy.url, {"model": "gpt-test", "input": history, "metadata": metadata})
    assert answer.status_code == 200 and len(answer.content) > 2048
    assert answer.json()["id"] == log(emulator)[-1]["response_id"]
    assert [r["status_code"] for r in log(emulator)] == [200, 400, 200]


def test_an_upstream_that_omits_store_and_echo_and_ignores_the_field_loses_nothing(proxy, emulator):
    """Answers carry neither ``store`` nor ``previous_response_id``, and the
    upstream silently ignores continuations: nothing may be continued."""
    emulator.model.control({"echo_store": False, "echo_previous": False, "stateless": "ignore"})
    conv = Conversation(proxy.url)
    for text in user_turns(6):
        conv.turn(text)
    conv.close()
    records = log(emulator)
    assert all(r["previous_response_id"] is None for r in records)
    assert_context_preserved(conv.sent, records)


def test_an_upstream_that_omits_store_is_trusted_once_it_echoed_a_clients_continuation(proxy, emulator):
    emulator.model.control({"echo_store": False})
    own = post(proxy.url, {"model": "gpt-test", "input": "a client-managed conversation"}).json()
    post(proxy.url, {"model": "gpt-test", "input": "go on", "previous_response_id": own["id"]})
    conv = Conversation(proxy.url)
    for text in user_turns(4):
        conv.turn(text)
    conv.close()
    records = log(emulator)[2:]
    assert_context_preserved(conv.sent, records)
    assert all(r["continued"] for r in records[1:])


def test_users_behind_proxyauth_sharing_one_key_never_share_response_ids(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "proxyauth=any", mode="regular")
    history = [{"role": "user", "content": "the same words from two users"}]

    def as_user(user: str, items: list) -> httpx.Response:
        return post(emulator.url, {"model": "gpt-test", "input": items},
                    proxy=f"http://{user}:pw@127.0.0.1:{proxy.port}")

    first = as_user("alice", history).json()
    history += first["output"] + [{"role": "user", "content": "and more"}]
    assert as_user("alice", history).status_code == 200
    assert emulator.model.snapshot_log()[-1]["continued"] is True
    assert as_user("bob", history).status_code == 200
    assert emulator.model.snapshot_log()[-1]["previous_response_id"] is None  # never alice's response id


# Loaded after the addon: shrinks what the proxy's Upstreams holds in memory to a bound a test reaches
# quickly, and answers GET /_marks with how many it holds.
SMALL_MARKS = """
from mitmproxy import ctx, http

from stateful_responses.bounded import Bounded


def upstreams():
    return ctx.master.addons.get("forwardmode").planner.upstreams


class SmallMarks:
    def running(self):
        marks = upstreams()
        bounded = Bounded({limit})
        bounded.update(marks._expires)
        marks._expires = bounded

    def request(self, flow):
        if flow.request.path == "/_marks":
            flow.response = http.Response.make(200, str(len(upstreams()._expires)))


addons = [SmallMarks()]
"""


def test_what_is_learned_per_credential_is_bounded_in_memory(emulator, start_proxy, tmp_path):
    """Rotating credentials (OAuth, Azure AD tokens) name new scopes without end: the marks memory holds
    stay within their bound, and a credential in use keeps continuing meanwhile."""
    script = tmp_path / "small_marks.py"
    script.write_text(SMALL_MARKS.format(limit=32))
    proxy = start_proxy(emulator.url, "-s", str(script))
    kept = {"authorization": "Bearer sk-kept", "content-type": "application/json"}
    history = [{"role": "user", "content": "the conversation that goes on"}]
    for n in range(120):
        rotated = {"authorization": f"Bearer sk-rotated-{n}", "content-type": "application/json"}
        assert post(proxy.url, {"model": "gpt-test", "input": f"hello {n}"}, rotated).status_code == 200
        if n % 20 == 0:
            answer = post(proxy.url, {"model": "gpt-test", "input": history}, kept)
            assert answer.status_code == 200
            history += answer.json()["output"] + [{"role": "user", "content": f"turn {n}"}]
    with httpx.Client(trust_env=False, timeout=30) as c:
        held = int(c.get(proxy.url + "/_marks").text)
    assert 0 < held <= 32
    served = [r for r in log(emulator) if r["status_code"] == 200 and r["body_bytes"] and r.get("input_items")]
    kept_turns = [r for r in served if r["input_items"] != 1 or r["continued"]]
    assert kept_turns[-1]["continued"]  # the credential in use was never pushed out
