"""Never worse than no addon: refusals, failures, unsupported upstreams and bad
input, through a real mitmdump, driven by the emulator's fault injection."""

from __future__ import annotations

import gzip
import hashlib
import json
import threading

import openai
import pytest
from driver import (
    ChainedConversation,
    Conversation,
    assert_chain_context_preserved,
    assert_context_preserved,
    drop_nulls,
    httpx,
    user_turns,
    without_comparisons,
)

AUTH = {"authorization": "Bearer sk-test-key"}


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (the first continuation across tool calls is sent whole
    too, to compare their input tokens: the emulator, a faithful server, keeps them)."""
    return without_comparisons(emulator.model.snapshot_log())


def run_turns(conv: Conversation, texts) -> None:
    for text in texts:
        conv.turn(text)


def client_visible(emulator, conv) -> list[dict]:
    """Upstream records minus the rejected attempts the client never saw."""
    return [r for r in log(emulator) if r.get("status_code") == 200]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    "fault",
    [
        {"forget_all": True},
        {"fail_next": [{"kind": "reject", "when": "continued"}]},  # 400 "Invalid `previous_response_id`." no param
        {"fail_next": [{"kind": "reject", "status": 404, "when": "continued",
                        "message": "Response with id 'x' not found.", "code": None}]},  # vLLM
        {"fail_next": [{"kind": "reject", "status": 422, "when": "continued", "message": "unprocessable"}]},
    ],
    ids=["not-found", "invalid-id", "vllm-404", "any-4xx"],
)
def test_rejected_continuation_is_retried_invisibly_and_the_chain_restarts(proxy, emulator, stream, fault):
    conv = Conversation(proxy.url, stream=stream, as_dicts=True)
    run_turns(conv, user_turns(3))
    emulator.model.control(fault)
    run_turns(conv, ["after the upstream lost or refused it", "and one more"])
    conv.close()
    records = log(emulator)
    rejected = [r for r in records if r["status_code"] != 200]
    assert len(rejected) == 1 and rejected[0]["previous_response_id"] is not None
    # the retry right after the rejection carried the client's exact original body
    retry = records[records.index(rejected[0]) + 1]
    original = conv.sent[len([r for r in records[: records.index(rejected[0])] if r["status_code"] == 200])]
    assert retry["previous_response_id"] is None and retry["input_items"] == len(original.body["input"])
    assert retry["body_sha256"] == hashlib.sha256(json.dumps(original.body).encode()).hexdigest() or retry["body_bytes"] == original.size
    assert_context_preserved(conv.sent, client_visible(emulator, conv))
    assert records[-1]["continued"] is True  # the chain restarted from the retried answer
    assert "retrying with the original body after" in proxy.output()


def test_forced_store_refused_is_retried_and_never_forced_again(proxy, emulator):
    emulator.model.control({"refuse_store": True})
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(3))
    conv.close()
    records = log(emulator)
    # one refusal of the forced store, then the original; a forced store is never tried again
    # (the emulator refuses every explicit store: true)
    assert [r["status_code"] for r in records] == [400] + [200] * (len(records) - 1)
    assert_context_preserved(conv.sent, client_visible(emulator, conv))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_server_error_to_a_forced_store_teaches_nothing(proxy, emulator, stream):
    """A ``store: false`` client: one 500 to the forced store, which the retry with the client's body
    escapes, is chance, not a refusal of ``store`` (5xx, 408, 425 and 429 never are: tests/test_planner.py):
    the next turns are continued as before it."""
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500}]})
    conv = Conversation(proxy.url, stream=stream, options={"store": False})
    run_turns(conv, user_turns(7))
    conv.close()
    records = client_visible(emulator, conv)
    assert_context_preserved(conv.sent, records)
    assert [r["status_code"] for r in log(emulator)][:2] == [500, 200]
    # the first turn's retry stored nothing (the client's store: false); every request from the third on continued
    assert len(records) == len(conv.sent) >= 9 and all(r["continued"] for r in records[2:])


@pytest.mark.parametrize("mode", ["reject", "ignore"])
def test_stateless_upstream_is_marked_once_and_left_alone(proxy, emulator, mode):
    emulator.model.control({"stateless": mode})
    conv = Conversation(proxy.url, stream=True)
    run_turns(conv, user_turns(4))
    conv.close()
    records = log(emulator)
    assert all(r["previous_response_id"] is None for r in records)
    assert_context_preserved(conv.sent, records)
    assert proxy.output().count("sending full history to it from now on") == 1
    # after the first answer, requests pass untouched, byte for byte
    for sent, seen in zip(conv.sent[1:], records[1:], strict=True):
        assert seen["body_bytes"] == sent.size


@pytest.mark.parametrize("kind", ["failed", "incomplete"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_unfinished_answers_drop_the_branch_without_marking(proxy, emulator, kind, stream):
    conv = Conversation(proxy.url, stream=stream)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": kind}]})
    run_turns(conv, ["this one will not finish", "and the next"])
    conv.close()
    records = log(emulator)
    assert_context_preserved(conv.sent, records)
    assert records[-1]["status_code"] == 200
    assert "does not store" not in proxy.output()


def test_a_server_error_to_a_continuation_is_retried_invisibly_and_the_branch_is_forgotten(proxy, emulator):
    """A 5xx may be what the change caused (agentic-api's 500 on item ids it
    holds): the client's own body goes again, and its answer is the client's."""
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500, "when": "continued"}]})
    conv.turn("this continuation meets a 500: the client's own body goes again")
    conv.turn("the next turn")
    conv.close()
    failed = next(r for r in log(emulator) if r["status_code"] == 500)
    records = [r for r in log(emulator) if r["status_code"] == 200]
    assert_context_preserved(conv.sent, records)
    # planned afresh: never again from the parent that met the error (an older ancestor is fine)
    assert records[-1]["previous_response_id"] != failed["previous_response_id"]


def test_a_server_error_the_clients_own_body_also_gets_is_the_clients(proxy, emulator):
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500, "when": "continued"},
                                          {"kind": "status", "status": 500}]})
    import openai

    with pytest.raises(openai.InternalServerError):
        conv.turn("this gets a 500 the upstream caused")
    assert [r["status_code"] for r in log(emulator)][-2:] == [500, 500]


def test_an_expanded_chain_that_fails_goes_again_as_the_client_sent_it(emulator, start_proxy):
    """Store emulation expanded a chain, forward mode changed nothing more
    (``store: false``, no forced store): a failure of the expansion is
    retried with the client's own body, whose answer the client gets."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_force_store=false")
    first = httpx.post(f"{proxy.url}/v1/responses", headers=AUTH, json={"model": "m", "input": "hello"}).json()
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500}]})
    second = httpx.post(f"{proxy.url}/v1/responses", headers=AUTH, json={
        "model": "m", "input": "again", "previous_response_id": first["id"], "store": False})
    assert second.status_code == 200
    expanded, own = log(emulator)[-2:]
    assert expanded["status_code"] == 500 and expanded["previous_response_id"] is None
    assert own["status_code"] == 200 and own["previous_response_id"] == first["id"]


def test_an_expanded_chain_forward_mode_changed_goes_as_the_client_sent_it_when_both_fail(emulator, start_proxy):
    """Forward mode sent the expansion as a continuation (500), then the
    expansion it was handed (500): the client's own body goes last."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    first = httpx.post(f"{proxy.url}/v1/responses", headers=AUTH, json={"model": "m", "input": "hello"},
                       timeout=30).json()
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500, "when": "continued"},
                                          {"kind": "status", "status": 500, "when": "fresh"}]})
    second = httpx.post(f"{proxy.url}/v1/responses", headers=AUTH, json={
        "model": "m", "input": "again", "previous_response_id": first["id"]}, timeout=30)
    assert second.status_code == 200
    continued, expanded, own = log(emulator)[-3:]
    assert (continued["status_code"], expanded["status_code"], own["status_code"]) == (500, 500, 200)
    assert expanded["previous_response_id"] is None and own["previous_response_id"] == first["id"]
    assert own["continued"] and own["input_items"] == 1


def test_connection_reset_on_a_continuation_heals_with_the_clients_own_retry(proxy, emulator):
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": "reset", "when": "continued"}]})
    conv.client = conv.client.with_options(max_retries=2)  # the SDK's default
    conv.turn("the upstream resets the connection")
    conv.close()
    records = log(emulator)
    reset, retried = records[-2], records[-1]
    assert reset["previous_response_id"] is not None
    # the client's own retry was planned afresh, never from the parent that met the reset
    assert retried["previous_response_id"] != reset["previous_response_id"]
    assert_context_preserved(conv.sent[-1:], records[-1:])


def test_a_stream_cut_mid_event_reaches_the_client_as_cut_and_teaches_nothing(proxy, emulator):
    conv = Conversation(proxy.url, as_dicts=True)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": "cut", "after_events": 4}]})
    body = {"model": "gpt-test", "stream": True, "input": conv.history + [{"role": "user", "content": "cut me"}]}
    with httpx.Client(trust_env=False) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", proxy.url + "/v1/responses", json=body, headers=AUTH) as r:
                b"".join(r.iter_raw())
    run_turns(conv, ["continue after the cut"])
    conv.close()
    assert log(emulator)[-1]["continued"] is True  # continued from the last *completed* answer


def test_concurrent_requests_on_one_branch_both_stay_correct(proxy, emulator):
    base = Conversation(proxy.url, as_dicts=True)
    run_turns(base, user_turns(3))
    base.close()
    convs = [Conversation(proxy.url, as_dicts=True, history=list(base.history)) for _ in range(4)]
    threads = [threading.Thread(target=run_turns, args=(c, [f"branch {i} a", f"branch {i} b"]))
               for i, c in enumerate(convs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in convs:
        c.close()
    records = log(emulator)[len(base.sent):]
    assert len(records) == 8 and all(r["status_code"] == 200 and r["continued"] for r in records)
    contexts = [json.dumps(drop_nulls(r["context"]), sort_keys=True) for r in records]
    for c in convs:
        for sent in c.sent:
            expected = json.dumps(drop_nulls(sent.body["input"]), sort_keys=True)
            assert contexts.count(expected) == 1, "a concurrent request's upstream context differs"


BAD_BODIES = {
    "not-json": (b"this is not json", "application/json"),
    "truncated": (b'{"model": "gpt-test", "input": [{"role": "user", "con', "application/json"),
    "not-utf8": (b'{"model": "gpt-test", "input": "\xff\xfe"}', "application/json"),
    "array": (b'[{"model": "gpt-test"}]', "application/json"),
    "string": (b'"hello"', "application/json"),
    "non-object-items": (b'{"model": "gpt-test", "input": [1, "two", null]}', "application/json"),
    "no-model": (b'{"input": [{"role": "user", "content": "x"}]}', "application/json"),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_input_passes_through_byte_identical(proxy, emulator, name):
    body, content_type = BAD_BODIES[name]
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", content=body, headers={**AUTH, "content-type": content_type})
    assert r.status_code == 400  # the emulator's own refusal, as without the addon
    assert log(emulator)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_compressed_request_body_passes_through_byte_identical(proxy, emulator):
    """Nothing to change (the store is the client's own): the client's compressed bytes go as they came."""
    body = gzip.compress(json.dumps({"model": "gpt-test", "input": "hello", "store": True}).encode())
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", content=body,
                   headers={**AUTH, "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 200
    assert log(emulator)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_a_50_mb_body_passes_and_the_proxy_keeps_running(proxy, emulator):
    big = {"model": "gpt-test", "input": [{"role": "user", "content": "x" * (50 * 1024 * 1024)}], "store": True}
    body = json.dumps(big).encode()
    with httpx.Client(trust_env=False, timeout=120) as c:
        r = c.post(proxy.url + "/v1/responses", content=body, headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 200
    assert log(emulator)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(2))
    conv.close()
    assert log(emulator)[-1]["continued"] is True


def test_an_html_answer_reaches_the_client_and_teaches_nothing(proxy, emulator):
    conv = Conversation(proxy.url, as_dicts=True)
    run_turns(conv, user_turns(1))
    emulator.model.control({"fail_next": [{"kind": "html"}]})
    body = {"model": "gpt-test", "input": conv.history + [{"role": "user", "content": "x"}]}
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", json=body, headers=AUTH)
    assert r.status_code == 200 and r.text.startswith("<html>")
    assert "internal error" not in proxy.output()


def test_gzip_answers_are_read_and_delivered_unchanged(proxy, emulator):
    emulator.model.control({"gzip": True})
    for stream in (False, True):
        conv = Conversation(proxy.url, stream=stream)
        run_turns(conv, user_turns(4))
        conv.close()
    records = log(emulator)
    assert [r["continued"] for r in records[:4]] == [False, True, True, True]
    assert "internal error" not in proxy.output()


def test_a_refusal_the_original_also_gets_is_the_clients_own_and_changes_nothing(proxy, emulator):
    emulator.model.control({"fail_next": [{"kind": "reject", "message": "Invalid value for 'temperature'."},
                                          {"kind": "reject", "message": "Invalid value for 'temperature'."}]})
    import openai

    conv = Conversation(proxy.url)
    with pytest.raises(openai.BadRequestError):  # the upstream's own answer to the client's own request
        conv.turn("a request the upstream refuses whatever we do")
    assert [r["status_code"] for r in log(emulator)] == [400, 400]  # ours, then the original
    conv = Conversation(proxy.url)
    conv.turn("a good request")
    forced = log(emulator)[-1]
    assert forced["body_bytes"] == conv.sent[-1].size + len(',"store":true')  # still forcing store


def test_a_completed_event_carrying_an_incomplete_response_teaches_nothing(proxy, emulator):
    """vLLM ends every stream with ``response.completed``: the status decides, not the event name."""
    conv = Conversation(proxy.url, as_dicts=True)
    run_turns(conv, user_turns(2))
    emulator.model.control({"fail_next": [{"kind": "incomplete", "terminal_event": "response.completed"}]})
    body = {"model": "gpt-test", "stream": True, "input": conv.history + [{"role": "user", "content": "more"}]}
    with httpx.Client(trust_env=False) as c:
        received = c.post(proxy.url + "/v1/responses", json=body, headers=AUTH).content
    odd = log(emulator)[-1]
    assert received == odd["sse"].encode()  # the client got exactly what the upstream sent
    assert b"event: response.completed" in received and odd["stored"] is False
    history = body["input"] + odd["output"] + [{"role": "user", "content": "after the odd answer"}]
    before = len(log(emulator))
    with httpx.Client(trust_env=False) as c:
        assert c.post(proxy.url + "/v1/responses", json={"model": "gpt-test", "input": history},
                      headers=AUTH).status_code == 200
    assert len(log(emulator)) == before + 1  # no continuation from the odd answer refused and retried
    after = log(emulator)[-1]
    assert after["previous_response_id"] not in (odd["response_id"], odd["previous_response_id"])
    assert drop_nulls(after["context"]) == drop_nulls(history)
    assert "does not store" not in proxy.output()  # the upstream is not marked
    run_turns(conv, ["a normal turn"])
    assert log(emulator)[-1]["continued"] is True


def test_a_clients_own_store_false_marks_nothing(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_force_store=false", "--set", "stateful_debug=true")
    body = json.dumps({"model": "gpt-test", "input": "not to be kept", "store": False}).encode()
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200 and r.json()["store"] is False
    assert log(emulator)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()  # passed untouched
    conv = Conversation(proxy.url)
    run_turns(conv, user_turns(3))
    conv.close()
    assert all(r["continued"] for r in log(emulator)[2:])  # the upstream was never marked
    assert "does not store" not in proxy.output()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_500_to_a_chain_expanded_before_the_upstream_is_proven_is_retried_with_the_clients_body(
        emulator, start_proxy, stream):
    """Store emulation expands a chain while the upstream's proof is still out (its GET slowed past the
    wait): a 500 to that expansion is the proxy's doing, and goes again with the client's own body,
    invisibly, as forward mode retries every request it changed, on every transport."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto", "--set", "stateful_force_store=false",
                        "--set", "stateful_debug=true")
    emulator.model.control({"fail_next": [{"kind": "stall", "endpoint": "retrieve", "ms": 6000}]})
    conv = ChainedConversation(proxy.url, stream=stream)
    conv.turn("first")
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500}]})
    conv.turn("second")
    conv.close()
    records = log(emulator)
    assert [r["status_code"] for r in records] == [200, 500, 200]  # the expansion's 500, then the client's body
    assert records[2]["previous_response_id"] == records[0]["response_id"]
    assert_chain_context_preserved(conv, records)
    output = proxy.stop()
    assert "expanded" in output and "internal error" not in output


def test_a_retry_cut_midway_reaches_the_client_as_mitmproxys_502_never_as_a_whole_answer(emulator, start_proxy):
    """The client's own body, sent again after its expanded chain met a 500, is cut mid-stream: the client has
    seen nothing of it (the retry is held whole), so it gets what mitmproxy answers a failed upstream with, a 502
    SDKs retry, never the cut answer under a head that says it is whole (CI once saw such an answer's
    Content-Length with no body after it)."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto", "--set", "stateful_force_store=false",
                        "--set", "stateful_debug=true")
    emulator.model.control({"fail_next": [{"kind": "stall", "endpoint": "retrieve", "ms": 6000}]})
    conv = ChainedConversation(proxy.url, stream=True)
    conv.turn("first")
    emulator.model.control({"fail_next": [{"kind": "status", "status": 500}, {"kind": "cut", "after_events": 2}]})
    with pytest.raises(openai.APIStatusError) as failed:
        conv.turn("second")
    conv.close()
    assert failed.value.status_code == 502
    assert [r["status_code"] for r in log(emulator)][1:] == [500, 200]  # the expansion's 500, the retry (cut)
    output = proxy.stop()
    assert "the retry failed" in output or "answered 502" in output
    assert "internal error" not in output
