"""The planner and store against a reference upstream, without mitmproxy."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stateful_responses.continuation.planner import Planner
from stateful_responses.items import item_digest
from stateful_responses.request_reader import Request
from stateful_responses.settings import Config, Settings

URL = "https://api.example.test/v1/responses"
_ids = itertools.count()


def request(items, key="sk-a", model="gpt-test", **extra) -> Request:
    body = {"model": model, "input": items, **extra}
    return Request("POST", URL, {"authorization": f"Bearer {key}"}, json.dumps(body).encode())


class ReferenceUpstream:
    """The API's storage semantics, minimal: context = stored chain + input."""

    def __init__(self) -> None:
        self.stored: dict[tuple[str, str], list] = {}

    def answer(self, key: str, body: dict, output: list, store_ok: bool = True):
        prev = body.get("previous_response_id")
        chain = []
        if prev is not None:
            if (key, prev) not in self.stored:
                return 400, None, None
            chain = self.stored[(key, prev)]
        items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        context = chain + items
        rid = f"resp_{next(_ids)}"
        stored = body.get("store", True) is not False and store_ok
        if stored:
            self.stored[(key, rid)] = context + output
        return 200, {"id": rid, "status": "completed", "store": stored, "previous_response_id": prev,
                     "output": output}, context


def assistant_output(n: int) -> list:
    return [{"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": f"answer {n}", "annotations": []}]}]


def tool_output(n: int) -> list:
    return [{"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "f",
             "arguments": json.dumps({"n": n}), "status": "completed"}]


def echo(item: dict, style: int) -> dict:
    """How a client might hand an upstream item back, meaning unchanged."""
    if style == 1:  # model_dump(): null-valued extras
        return {**item, "phase": None, "caller": None}
    if style == 2 and item["type"] == "message":  # easy assistant message
        return {"role": "assistant", "content": item["content"][0]["text"]}
    if style == 2 and item["type"] == "function_call":  # compact re-serialization, no ids
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                "arguments": json.dumps(json.loads(item["arguments"]), separators=(",", ":"))}
    return dict(item)


def digests(items) -> list[bytes]:
    return [item_digest(i) for i in items]


def send(planner: Planner, upstream: ReferenceUpstream, key: str, items: list, output: list, **extra):
    """One client request through the planner; returns (plan, context the upstream saw)."""
    req = request(items, key, **extra)
    plan = planner.plan(req)
    sent = json.loads(plan.body) if plan.body is not None else json.loads(req.body)
    status, response, context = upstream.answer(key, sent, output)
    outcome = planner.settle(plan, status, response)
    if outcome.kind == "retry":  # what the glue does: the original body, once
        retry = planner.plan(req, rewrite=False)
        refused, refusal = status, json.dumps(response).encode()
        status, response, context = upstream.answer(key, json.loads(req.body), output)
        planner.retried(plan, refused, refusal, status)
        outcome = planner.settle(retry, status, response)
    assert status == 200
    prove(planner, upstream, key, plan, outcome)
    return plan, response, context


def prove(planner: Planner, upstream: ReferenceUpstream, key: str, plan, outcome) -> None:
    """What the glue's proof does after a stored answer: ask the upstream
    to read the response back, and mark the verdict."""
    if outcome.kind == "advanced" and planner.upstreams.unproven(plan.scope):
        planner.upstreams.mark("reads_back" if (key, outcome.response_id) in upstream.stored else "unsupported",
                               plan.scope)


def test_continues_with_exactly_the_new_items():
    planner, upstream = Planner(), ReferenceUpstream()
    items = [{"role": "user", "content": "hi"}]
    plan, response, _ = send(planner, upstream, "k", items, assistant_output(1))
    assert plan.action == "full" and json.loads(plan.body)["store"] is True
    items = items + [echo(o, 2) for o in response["output"]] + [{"role": "user", "content": "more"}]
    plan, _, context = send(planner, upstream, "k", items, assistant_output(2))
    assert plan.action == "continue"
    sent = json.loads(plan.body)
    assert sent["previous_response_id"] == response["id"]
    assert sent["input"] == [{"role": "user", "content": "more"}]
    assert digests(context) == digests(items)


def test_what_another_transport_sent_instead_of_the_plan_is_what_is_learned():
    """The WebSocket bridge sends a turn whole (a refused continuation, say), or continues it from its
    socket's memory: the answer is learned as that, and the next turn continues from it."""
    planner, upstream = Planner(), ReferenceUpstream()
    items = [{"role": "user", "content": "hi"}]
    _, first, _ = send(planner, upstream, "k", items, assistant_output(1))
    items = items + first["output"] + [{"role": "user", "content": "more"}]
    plan = planner.plan(request(items, "k"))
    assert plan.action == "continue"
    planner.carried(plan, None, len(items), None)  # sent whole instead
    status, second, _ = upstream.answer("k", {"input": items}, assistant_output(2))
    assert planner.settle(plan, status, second).kind == "advanced"
    items = items + second["output"] + [{"role": "user", "content": "again"}]
    plan = planner.plan(request(items, "k"))
    assert plan.previous_response_id == second["id"] and plan.items_sent == 1
    planner.carried(plan, first["id"], 4, b'{"input":[]}')  # continued from an older response instead
    assert plan.previous_response_id == first["id"] and plan.items_sent == 4
    status, third, context = upstream.answer("k", {"input": items[2:], "previous_response_id": first["id"]},
                                             assistant_output(3))
    assert digests(context) == digests(items)
    assert planner.settle(plan, status, third).kind == "advanced"
    plan = planner.plan(request(items + third["output"] + [{"role": "user", "content": "end"}], "k"))
    assert plan.previous_response_id == third["id"] and plan.items_sent == 1


def test_interleaved_conversations_sharing_everything_all_continue():
    planner, upstream = Planner(), ReferenceUpstream()
    convs = [[{"role": "user", "content": f"user {u} opens"}] for u in range(4)]
    for turn in range(6):
        for u, conv in enumerate(convs):
            plan, response, context = send(planner, upstream, "k", conv, assistant_output(turn * 10 + u),
                                           instructions="same", tools=[{"type": "function", "name": "f"}])
            assert digests(context) == digests(conv)
            assert plan.action == ("full" if turn == 0 else "continue")
            conv += response["output"] + [{"role": "user", "content": f"user {u} turn {turn}"}]


def test_fork_continues_from_the_deepest_shared_ancestor():
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "start"}]
    ids = []
    for n in range(4):
        _, response, _ = send(planner, upstream, "k", conv, assistant_output(n))
        ids.append(response["id"])
        conv = conv + response["output"] + [{"role": "user", "content": f"next {n}"}]
    # regenerate from the second answer: items up to and including answer 1, then a new message
    fork = conv[:4] + [{"role": "user", "content": "a different question"}]
    plan, _, context = send(planner, upstream, "k", fork, assistant_output(99))
    assert plan.action == "continue" and plan.previous_response_id == ids[1]
    assert digests(context) == digests(fork)
    # an edit of the very first message shares nothing: full
    edited = [{"role": "user", "content": "edited start"}] + conv[1:]
    plan, _, _ = send(planner, upstream, "k", edited, assistant_output(100))
    assert plan.action == "full"


def test_tenants_and_models_never_mix():
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "shared words"}]
    _, response, _ = send(planner, upstream, "tenant-a", conv, assistant_output(1))
    later = conv + response["output"] + [{"role": "user", "content": "next"}]
    assert planner.plan(request(later, "tenant-b")).action == "full"
    assert planner.plan(request(later, "tenant-a", model="other")).action == "full"
    assert planner.plan(request(later, "tenant-a")).action == "continue"
    org = request(later, "tenant-a")
    org = Request(org.method, org.url, {**org.headers, "openai-organization": "org-2"}, org.body)
    assert planner.plan(org).action == "full"


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"previous_response_id": "resp_x"}, "client sent previous_response_id"),
        ({"conversation": "conv_1"}, "client uses a conversation"),
    ],
)
def test_client_managed_state_passes_untouched(extra, reason):
    plan = Planner().plan(request([{"role": "user", "content": "x"}], **extra))
    assert (plan.action, plan.reason, plan.body) == ("pass", reason, None)


def test_store_false_is_respected_without_force_store():
    planner = Planner(Config(Settings(force_store=False)))
    plan = planner.plan(request([{"role": "user", "content": "x"}], store=False))
    assert plan.action == "pass" and plan.body is None
    plan = planner.plan(request([{"role": "user", "content": "x"}]))
    assert plan.action == "full" and plan.body is None and not plan.asked_store


def test_no_continuation_without_a_stored_parent():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    req = request(conv)
    plan = planner.plan(req)
    # the upstream answered but did not store although asked: it is unsupported from now on
    outcome = planner.settle(plan, 200, {"id": "resp_1", "status": "completed", "store": False,
                                         "output": assistant_output(1)})
    assert outcome.kind == "unsupported"
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    plan = planner.plan(request(nxt))
    assert plan.action == "pass" and plan.body is None


@pytest.mark.parametrize("status", ["failed", "incomplete", "cancelled", "in_progress"])
def test_unfinished_answers_teach_nothing(status):
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv))
    outcome = planner.settle(plan, 200, {"id": "resp_1", "status": status, "store": True, "output": assistant_output(1)})
    assert outcome.kind == "dropped"
    assert planner.plan(request(conv + assistant_output(1) + [{"role": "user", "content": "y"}])).action == "full"
    assert "resp_1" not in str(planner.stats()) and planner.stats()["unsupported_upstreams"] == 0


def test_string_input_starts_a_chain():
    planner, upstream = Planner(), ReferenceUpstream()
    plan, response, _ = send(planner, upstream, "k", "hello", assistant_output(1))
    nxt = [{"role": "user", "content": "hello"}] + response["output"] + [{"role": "user", "content": "more"}]
    plan, _, context = send(planner, upstream, "k", nxt, assistant_output(2))
    assert plan.action == "continue" and digests(context) == digests(nxt)


# -- the property: random conversations against the reference upstream -------

actions = st.sampled_from(["turn", "turn", "turn", "tool", "fork", "edit", "forget", "new"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), max_chains=st.integers(1, 6))
def test_effective_context_always_equals_client_input(data, max_chains):
    planner = Planner(Config(Settings(max_chains=max_chains)))
    upstream = ReferenceUpstream()
    convs: list[tuple[str, list]] = [("k1", [{"role": "user", "content": "open 0"}])]
    for step in range(data.draw(st.integers(1, 25), label="steps")):
        action = data.draw(actions, label="action")
        c = data.draw(st.integers(0, len(convs) - 1), label="conversation")
        key, conv = convs[c]
        if action == "new":
            convs.append((data.draw(st.sampled_from(["k1", "k2"])), [{"role": "user", "content": f"open {step % 3}"}]))
            continue
        if action == "forget" and upstream.stored:
            victim = data.draw(st.sampled_from(sorted(upstream.stored)), label="forgotten")
            del upstream.stored[victim]
            continue
        if action == "fork" and len(conv) > 1:
            cut = data.draw(st.integers(1, len(conv)), label="cut")
            conv = conv[:cut] + [{"role": "user", "content": f"fork {step}"}]
            convs.append((key, conv))
        elif action == "edit" and len(conv) > 1:
            i = data.draw(st.integers(0, len(conv) - 1), label="edited")
            conv = conv[:i] + [{"role": "user", "content": f"edited {step}"}] + conv[i + 1 :]
            convs[c] = (key, conv)
        output = tool_output(step) if action == "tool" else assistant_output(step % 4)
        plan, response, context = send(planner, upstream, key, conv, output)
        assert digests(context) == digests(conv), "upstream context differs from the client's input"
        event(f"{action}: {plan.action}")
        if plan.action == "continue":
            assert plan.items_sent >= 1
        style = data.draw(st.integers(0, 2), label="echo style")
        conv = conv + [echo(o, style) for o in response["output"]]
        if action == "tool":
            conv.append({"type": "function_call_output", "call_id": f"call_{step}", "output": "ok"})
        else:
            conv.append({"role": "user", "content": f"turn {step}"})
        convs[c] = (key, conv)
        assert planner.store.branch_count <= max_chains


def test_a_rewritten_body_is_spliced_from_the_clients_own_bytes():
    planner, upstream = Planner(), ReferenceUpstream()
    send(planner, upstream, "k", [{"role": "user", "content": "hi"}], assistant_output(1))
    # odd spacing, unicode, escapes and a float: none of it may be re-serialized
    new_item = b'{ "role" : "user",  "content" : "caf\\u00e9 \xc3\xa9 \\"q\\" 1.50" }'
    echo_bytes = json.dumps(assistant_output(1)[0]).encode()
    body = (b'{"model":"gpt-test", "temperature": 1.50, "input": [{"role": "user", "content": "hi"}, '
            + echo_bytes + b", " + new_item + b'], "metadata": {"k": "v"}}')
    plan = planner.plan(Request("POST", URL, {"authorization": "Bearer k"}, body))
    assert plan.action == "continue"
    assert b'"input":[' + new_item + b"]" in plan.body
    assert b'"temperature":1.50' in plan.body and b'"metadata":{"k": "v"}' in plan.body
    sent = json.loads(plan.body)
    assert sent["previous_response_id"].startswith("resp_") and sent["store"] is True


@pytest.mark.parametrize("body", [b'{"model":"m","input":"x"}', b'{"model":"m","input":"x"}  \n'])
def test_a_forced_store_is_inserted_without_touching_the_rest(body):
    plan = Planner().plan(Request("POST", URL, {}, body))
    assert plan.body == body.rstrip()[:-1] + b',"store":true}' + body[len(body.rstrip()):]


def test_a_clients_store_false_is_replaced_in_place_when_forcing():
    plan = Planner().plan(Request("POST", URL, {}, b'{"model":"m","store":false,"input":"x"}'))
    assert plan.body == b'{"model":"m","store":true,"input":"x"}'


@pytest.mark.parametrize("body", [b"", b"[1]", b'"s"', b"{", b'{"model": 1, "input": []}',
                                  b'{"model":"m","input":[1]}', b'{"model":"m","input":{}}',
                                  b'{"model":"m","input":[]}', b'{"model":"m","input":[{"a":1}, {]}',
                                  b'{"model":"m","input":"\xff"}', b'{"model":"m","input":[{"role":NaN}]}'])
def test_malformed_bodies_pass(body):
    assert Planner().plan(Request("POST", URL, {}, body)).action == "pass"


def test_a_request_that_got_no_answer_forgets_the_branch_it_continued_from():
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
    nxt = conv + response["output"] + [{"role": "user", "content": "y"}]
    plan = planner.plan(request(nxt, "k"))
    assert plan.action == "continue"
    assert planner.abandon(plan, "connection reset").kind == "dropped"
    assert planner.plan(request(nxt, "k")).action == "full"


def test_an_upstream_that_does_not_store_is_marked_per_credential():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv, "zdr-tenant"))
    planner.settle(plan, 200, {"id": "resp_1", "status": "completed", "store": False, "output": assistant_output(1)})
    assert planner.plan(request(conv, "zdr-tenant")).action == "pass"
    assert planner.plan(request(conv, "other-tenant")).action == "full"  # not switched off for everyone


ZDR_REFUSAL = json.dumps({"error": {"message": "Store must be false for this organization due to Zero Data "
                                     "Retention.", "type": "invalid_request_error", "param": "store",
                                     "code": None}}).encode()


def test_a_forced_store_counts_as_refused_only_when_the_original_then_went_through():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv))
    assert planner.settle(plan, 400, None).kind == "retry"
    planner.retried(plan, 400, ZDR_REFUSAL, 400)  # the original failed too: the client's own error
    assert planner.plan(request(conv)).forced_store
    plan = planner.plan(request(conv))
    planner.settle(plan, 400, None)
    planner.retried(plan, 400, ZDR_REFUSAL, 200)  # the original went through: the forced store was refused
    assert not planner.plan(request(conv)).forced_store
    assert planner.plan(request(conv, "other-tenant")).forced_store
    planner.config.clock = lambda: time.time() + 29 * 86400  # named: the time to live
    assert not planner.plan(request(conv)).forced_store


@pytest.mark.parametrize("refused", [500, 502, 503, 504, 408, 425, 429])
def test_a_transient_failure_the_retry_escaped_never_unforces_store(refused):
    """A 5xx, 408, 425 or 429 to the forced body says nothing about ``store``: a
    retry that went through is chance, not a refusal of the field."""
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv, store=False))
    planner.settle(plan, refused, None)
    planner.retried(plan, refused, b'{"error": {"message": "Store is temporarily unavailable"}}', 200)
    assert planner.plan(request(conv, store=False)).forced_store


def test_a_refusal_that_does_not_name_store_unforces_it_for_an_hour():
    planner = Planner()
    now = time.time()
    planner.config.clock = lambda: now
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv, store=False))
    planner.settle(plan, 400, None)
    planner.retried(plan, 400, b'{"error": {"message": "Bad request", "param": null}}', 200)
    assert not planner.plan(request(conv, store=False)).forced_store
    planner.config.clock = lambda: now + 3601
    assert planner.plan(request(conv, store=False)).forced_store


def test_no_store_is_forced_where_the_upstreams_websocket_mode_may_serve_the_deltas():
    """Until the upstream + credential refused the upgrade: its verdict pending, the upgrade resting
    after a failure, or every socket busy, the request goes with the client's store."""
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv, store=False), websocket_mode=True)
    assert not plan.forced_store and plan.body is None  # the client's own body, store: false kept
    assert planner.plan(request(conv, store=False)).forced_store  # no bridge in this proxy mode (upstream:)
    planner.config.update(Settings(upstream_websocket="off"))  # no bridge: forward mode forces as before
    assert planner.plan(request(conv, store=False), websocket_mode=True).forced_store
    planner.config.update(Settings())
    planner.upstreams.mark("refuses_websocket", plan.scope, 3600.0)  # sockets found no use for an hour: a fault
    assert not planner.plan(request(conv, store=False), websocket_mode=True).forced_store  # is no licence to store
    planner.upstreams.mark("lacks_websocket", plan.scope)  # the upgrade refused: no WebSocket mode there
    assert planner.plan(request(conv, store=False), websocket_mode=True).forced_store
    assert not planner.plan(request(conv, "other-tenant", store=False), websocket_mode=True).forced_store


def a_continuing_request() -> tuple[Planner, Request]:
    """A planner that stored one answer for credential "k", and k's next
    request, which continues from it."""
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "shared words"}]
    _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
    base = request(conv + response["output"] + [{"role": "user", "content": "next"}], "k")
    assert planner.plan(base).action == "continue"
    return planner, base


def with_header(base: Request, name: str, value: str) -> Request:
    return Request(base.method, URL, {**base.headers, name: value}, base.body)


def test_a_key_in_the_query_string_or_a_proxy_credential_separates_tenants():
    planner, base = a_continuing_request()
    other_query = Request(base.method, URL + "?key=tenant-b", base.headers, base.body)
    assert planner.plan(other_query).action == "full"
    assert planner.plan(with_header(base, "proxy-authorization", "Basic Yjpi")).action == "full"
    proxyauth_user = Request(base.method, URL, base.headers, base.body, proxy_user="alice\x00secret")
    assert planner.plan(proxyauth_user).action == "full"


@pytest.mark.parametrize("header", ["x-goog-api-key", "Ocp-Apim-Subscription-Key", "x-portkey-api-key",
                                    "cf-aig-authorization", "Helicone-Auth", "x-custom-token"])
def test_a_gateways_own_credential_header_separates_tenants(header):
    planner, base = a_continuing_request()
    assert planner.plan(with_header(base, header, "tenant-b")).action == "full"


def test_what_names_a_request_or_a_session_is_not_a_credential():
    planner, base = a_continuing_request()
    for header in ("Idempotency-Key", "x-stainless-retry-count", "session-id", "cookie", "content-type"):
        assert planner.plan(with_header(base, header, "a value of its own")).action == "continue", header


def test_a_credential_in_the_upstream_path_never_reaches_the_scope_label():
    planner = Planner()
    url = "https://user:pw@gw.example.test:8443/key/sk-path-secret/v1/responses"
    plan = planner.plan(Request("POST", url, {"authorization": "Bearer sk-header-secret"},
                                json.dumps({"model": "m", "input": "x"}).encode()))
    assert plan.scope_label.startswith("https://gw.example.test:8443 (upstream #")
    for secret in ("sk-path-secret", "sk-header-secret", "user", "pw", "/key"):
        assert secret not in plan.scope_label and secret not in plan.scope


# -- transient refusals, and answers that prove nothing --------------

@pytest.mark.parametrize("status", [408, 425, 429])
def test_a_transient_4xx_teaches_nothing_and_forgets_nothing(status):
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
    nxt = conv + response["output"] + [{"role": "user", "content": "y"}]
    plan = planner.plan(request(nxt, "k"))
    assert plan.action == "continue"
    assert planner.settle(plan, status, None).kind == "transient"
    assert planner.plan(request(nxt, "k")).action == "continue"  # the parent is still valid
    first = planner.plan(request([{"role": "user", "content": "z"}], store=False))
    assert first.forced_store and planner.settle(first, status, None).kind == "transient"
    assert planner.plan(request([{"role": "user", "content": "z"}], store=False)).forced_store


def _answer(rid, **fields):
    return {"id": rid, "status": "completed", "output": assistant_output(1), **fields}


def test_an_answer_without_store_is_taken_as_asked_and_continued_only_once_read_back():
    """agentic-api's answers carry no ``store``: what the request asked
    stands, and the GET of the proof decides before anything is continued."""
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    first = planner.plan(request(conv))
    assert first.forced_store and planner.settle(first, 200, _answer("resp_1")).kind == "advanced"
    assert planner.plan(request(nxt)).action == "full"  # not read back yet
    planner.upstreams.mark("reads_back", first.scope)
    assert planner.plan(request(nxt)).action == "continue"
    # a request that does not say store, unforced (stateful_force_store=false, or a turn the upstream's
    # WebSocket mode may serve, over a socket or HTTP): the API's default, stored, until the GET says otherwise
    unforced = Planner(Config(Settings(force_store=False)))
    plan = unforced.plan(request(conv))
    assert not plan.asked_store and unforced.settle(plan, 200, _answer("resp_2")).kind == "advanced"
    bridged = planner.plan(request([{"role": "user", "content": "z"}]), websocket_mode=True)
    assert not bridged.forced_store and planner.settle(bridged, 200, _answer("resp_3")).kind == "advanced"
    # one that says store: false is not taken as stored, nor our own retry of a client's body
    plan = unforced.plan(request(conv, store=False))
    assert unforced.settle(plan, 200, _answer("resp_4")).kind == "ignored"
    retry = unforced.plan(request(conv), rewrite=False)
    assert unforced.settle(retry, 200, _answer("resp_5")).kind == "ignored"


def test_a_continuation_whose_answer_does_not_echo_the_id_is_not_built_upon():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    first = planner.plan(request(conv))
    planner.settle(first, 200, _answer("resp_1", store=True))
    planner.upstreams.mark("reads_back", first.scope)
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    plan = planner.plan(request(nxt))
    assert plan.action == "continue" and not plan.checked
    assert planner.settle(plan, 200, _answer("resp_2", store=True)).kind == "unverified"  # its input items tell
    third = nxt + assistant_output(1) + [{"role": "user", "content": "z"}]
    assert planner.plan(request(third)).previous_response_id == "resp_1"
    null_echo = planner.plan(request(third))
    assert planner.settle(null_echo, 200, _answer("resp_3", store=True, previous_response_id=None)).kind == "unsupported"


def test_nothing_is_continued_until_the_upstream_read_a_stored_response_back():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    first = planner.plan(request(conv))
    assert planner.settle(first, 200, _answer("resp_1", store=True)).kind == "advanced"
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    unproven = planner.plan(request(nxt))
    assert unproven.action == "full" and "read a stored response back" in unproven.reason
    assert planner.lookups(unproven) == []
    planner.upstreams.mark("reads_back", first.scope)
    assert planner.plan(request(nxt)).previous_response_id == "resp_1"
    planner.upstreams.mark("refuses_previous", first.scope)  # what store emulation learned stops forward mode too
    assert planner.plan(request(nxt)).action == "pass"


def a_proven_continuation(store_answer: dict | None = None):
    planner = Planner()
    conv = [{"role": "user", "content": "x" * 40}]
    first = planner.plan(request(conv))
    planner.settle(first, 200, _answer("resp_gw_first", store=True, **(store_answer or {})))
    planner.upstreams.mark("reads_back", first.scope)
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    plan = planner.plan(request(nxt))
    assert plan.action == "continue"
    return planner, plan, nxt


def test_in_always_mode_a_continuation_is_checked_until_the_upstream_showed_it_honours_the_field():
    planner, plan, nxt = a_proven_continuation()
    assert not plan.checked  # forward mode alone: the first continued answer's echo is the check
    planner.config.update(dataclasses.replace(planner.settings, emulate="always"))
    checked = planner.plan(request(nxt))
    assert (checked.action, checked.checked) == ("continue", True)
    unheld = planner.plan(request(nxt), checkable=False)  # an answer that must stream as it comes
    assert (unheld.action, unheld.reason) == ("full", "full; a continuation to check, of an answer that cannot be held")
    planner.upstreams.mark("honours_previous", checked.scope)
    assert not planner.plan(request(nxt)).checked
    assert planner.plan(request(nxt), checkable=False).action == "continue"


def test_an_echo_in_another_spelling_proves_nothing_by_itself():
    planner, plan, nxt = a_proven_continuation()
    outcome = planner.settle(plan, 200, _answer("resp_gw_2", store=True, previous_response_id="resp_raw_1",
                                                usage={"input_tokens": 10}))
    assert outcome.kind == "unverified" and planner.stats()["unsupported_upstreams"] == 0
    assert planner.plan(request(nxt)).previous_response_id == "resp_gw_first"  # neither marked nor built upon


def test_an_echo_in_another_spelling_is_honoured_when_more_was_billed_than_sent():
    planner, plan, nxt = a_proven_continuation()
    billed = len(plan.body) + 200
    outcome = planner.settle(plan, 200, _answer("resp_gw_2", store=True, previous_response_id="resp_raw_1",
                                                usage={"input_tokens": billed}))
    assert outcome.kind == "advanced" and planner.upstreams.has("honours_previous", plan.scope)
    third = nxt + assistant_output(1) + [{"role": "user", "content": "z"}]
    again = planner.plan(request(third))
    assert again.previous_response_id == "resp_gw_2"
    assert planner.settle(again, 200, _answer("resp_gw_3", store=True, previous_response_id="resp_raw_2")).kind \
        == "advanced"  # the scope showed it honours the field: other spellings are its ids


def test_an_answer_echoing_nothing_is_built_upon_once_a_listing_showed_it_was_made_from_the_chain():
    planner, plan, nxt = a_proven_continuation()
    answer = _answer("resp_2", store=True)  # no previous_response_id at all
    assert planner.settle(plan, 200, answer).kind == "unverified"
    planner.upstreams.mark("honours_previous", plan.scope)  # what the listing of its input items showed
    assert planner.settle(plan, 200, answer).kind == "ignored"  # an echo-less answer alone still proves nothing
    assert planner.settle(plan, 200, answer, chain_read=True).kind == "advanced"
    third = nxt + assistant_output(1) + [{"role": "user", "content": "z"}]
    assert planner.plan(request(third)).previous_response_id == "resp_2"


@pytest.mark.parametrize("echo_id", [None, "", "chatcmpl-abc"])
def test_an_echo_that_cannot_be_a_response_marks_the_upstream(echo_id):
    planner, plan, _ = a_proven_continuation()
    outcome = planner.settle(plan, 200, _answer("resp_2", store=True, previous_response_id=echo_id,
                                                usage={"input_tokens": 10 ** 6}))
    assert outcome.kind == "unsupported"


def test_usage_proves_nothing_where_input_costs_tokens_without_bytes():
    planner, plan, _ = a_proven_continuation()
    plan.body = plan.body.replace(b'"input":[', b'"input":[{"type":"input_image","image_url":"https://x/i.png"},')
    outcome = planner.settle(plan, 200, _answer("resp_2", store=True, previous_response_id="resp_raw",
                                                usage={"input_tokens": 10 ** 6}))
    assert outcome.kind == "unverified"


# -- bodies whose meaning depends on the parser ----------------------

@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","input":[{"role":"user","content":"short"}],"input":[{"role":"user","content":"real"}]}',
        b'{"model":"m","input":[{"role":"user","content":"same"}],"input":[{"role":"user","content":"same"}]}',
        b'{"model":"m","store":false,"store":true,"input":"x"}',
        b'{"model":"m","input":[{"role":"user","content":"a","content":"b"}]}',
        b'{"model":"m","input":[{"role":"user","content":"\\ud800x"}]}',
        b'{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":Infinity}]}',
        b'{"model":"m","tools":[{"type":"function","name":"f","name":"g"}],"input":"x"}',
        b'{"model":"m","tools":[{"type":"function\xed\xa0\x80","name":"f"}],"input":"x"}',
        b'{"model":"m","temperature":1e400,"input":"x"}',
        b'{"model":"m","metadata":{"a":{"b":1,"b":2}},"input":"x"}',
    ],
    ids=["duplicate-input", "duplicate-identical-input", "duplicate-store", "duplicate-in-item",
         "lone-surrogate", "infinity", "duplicate-in-tools", "surrogate-bytes-in-tools", "overflowing-number",
         "duplicate-deep-in-metadata"],
)
def test_ambiguous_bodies_pass_byte_identical(body):
    planner = Planner()
    plan = planner.plan(Request("POST", URL, {}, body))
    assert (plan.action, plan.reason, plan.body) == ("pass", "ambiguous body", None)
    assert planner.stats()["ambiguous"] == 1


def test_a_duplicated_input_key_is_counted_as_ambiguous_and_never_continued():
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "real"}]
    _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
    history = json.dumps(conv + response["output"] + [{"role": "user", "content": "next"}]).encode()
    body = b'{"model":"gpt-test","input":[{"role":"user","content":"short"}],"input":' + history + b"}"
    plan = planner.plan(Request("POST", URL, {"authorization": "Bearer k"}, body))
    assert (plan.action, plan.reason, plan.body) == ("pass", "ambiguous body", None)
    assert planner.stats()["ambiguous"] == 1


@given(st.lists(st.sampled_from([" ", "\t", "\n", "\r\n", ""]), min_size=6, max_size=6))
def test_unusual_whitespace_between_top_level_fields_is_not_ambiguous(ws):
    pieces = ["{", '"model"', ":", '"m"', ",", '"input"', ':"x"}']
    body = "".join(p + w for p, w in zip(pieces, ws + [""], strict=True)) + ws[0]
    assert Planner().plan(Request("POST", URL, {}, body.encode())).action == "full"


# -- what outlives the process -----------------------------------------

def test_what_the_planner_learns_reaches_the_outbox_and_a_fresh_planner_continues_from_it():
    from stateful_responses.continuation.prefixes import ENTRIES, REFS, entries_found
    from stateful_responses.upstreams import MARKS

    first, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(first, upstream, "k", conv, assistant_output(1))
    writes = first.take_writes()
    assert sorted(w.table for w in writes) == [ENTRIES, REFS] and first.take_writes() == []
    stored = {w.key: w.value for w in writes if w.table == ENTRIES}

    # a restart: same secret (the store's), empty memory
    second = Planner()
    second.tenancy.use_secret(first.tenancy.secret)
    second.upstreams.load({w.key: w.value for w in first.upstreams.take_writes()})  # the marks, from the store
    nxt = conv + response["output"] + [{"role": "user", "content": "y"}]
    plan = second.plan(request(nxt, "k"))
    assert plan.action == "full" and plan.forced_store
    keys = second.lookups(plan)
    assert keys and set(stored) <= set(keys)
    second.improve(plan, entries_found({k: stored[k] for k in keys if k in stored}))
    assert plan.action == "continue" and plan.previous_response_id == response["id"]
    sent = json.loads(plan.body)
    assert sent["input"] == nxt[-1:] and sent["store"] is True
    assert second.counters.continued == 1 and second.counters.full_items == 0

    # a planner with another secret cannot use them
    third = Planner()
    plan = third.plan(request(nxt, "k"))
    third.improve(plan, entries_found(stored))
    assert plan.action == "full"

    # marks travel too
    first.settle(first.plan(request(conv, "zdr")), 200,
                 {"id": "r", "status": "completed", "store": False, "output": assistant_output(1)})
    marks = {w.key: w.value for w in first.upstreams.take_writes() if w.table == MARKS}
    second.upstreams.load(marks)
    assert second.plan(request(conv, "zdr")).action == "pass"


def answered_twice(planner: Planner) -> list:
    """A conversation of credential ``k`` after two stored answers, the writes taken: its next request continues."""
    upstream, conv = ReferenceUpstream(), [{"role": "user", "content": "x"}]
    for text in ("y", "z"):
        _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
        conv = conv + response["output"] + [{"role": "user", "content": text}]
    planner.take_writes()
    return conv


def test_a_refused_continuation_forgets_its_whole_branch_in_the_store_too():
    """An upstream that lost the parent (a restart) lost its ancestors too:
    the next turn is not continued from an older one, refused again."""
    planner = Planner()
    conv = answered_twice(planner)
    plan = planner.plan(request(conv, "k"))
    assert plan.action == "continue"
    assert planner.settle(plan, 404, None).kind == "retry"
    forgotten = {w.key for w in planner.take_writes() if w.value is None}
    assert plan.parent in forgotten and len(forgotten) == plan.items_total - plan.items_sent
    assert planner.plan(request(conv, "k")).action == "full"


def test_a_server_error_to_a_continuation_forgets_only_its_parent():
    planner = Planner()
    conv = answered_twice(planner)
    plan = planner.plan(request(conv, "k"))
    assert planner.settle(plan, 500, None).kind == "retry"  # a changed request: the glue retries it
    assert [(w.key, w.value) for w in planner.take_writes()] == [(plan.parent, None)]
    assert planner.plan(request(conv, "k")).action == "continue"  # from an older ancestor, which may be there


def test_entries_and_marks_expire():
    now = [1000.0]
    planner, upstream = Planner(Config(Settings(ttl_days=1), clock=lambda: now[0])), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(planner, upstream, "k", conv, assistant_output(1))
    nxt = conv + response["output"] + [{"role": "user", "content": "y"}]
    assert planner.plan(request(nxt, "k")).action == "continue"
    planner.settle(planner.plan(request(conv, "zdr")), 200,
                   {"id": "r", "status": "completed", "store": False, "output": assistant_output(1)})
    assert planner.plan(request(conv, "zdr")).action == "pass"
    now[0] += 86400
    assert planner.plan(request(nxt, "k")).action == "full"
    assert planner.plan(request(conv, "zdr")).action == "full"


def test_an_unreadable_stored_record_is_ignored():
    from stateful_responses.continuation.prefixes import entries_found

    assert entries_found({b"k": b"\x00garbage", b"j": b""}) == {}


# -- clients that echo earlier output by reference ------------------------

def test_an_item_reference_to_an_output_item_equals_that_item():
    planner, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(planner, upstream, "k", conv, tool_output(1))
    call = response["output"][0]
    by_reference = conv + [{"type": "item_reference", "id": call["id"]},
                           {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    plan = planner.plan(request(by_reference, "k"))
    assert plan.action == "continue" and plan.items_sent == 1
    typeless = conv + [{"id": call["id"]}, {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    assert planner.plan(request(typeless, "k")).action == "continue"
    # never across namespaces, and an unknown id stays itself
    assert planner.plan(request(by_reference, "other-tenant")).action == "full"
    unknown = conv + [{"type": "item_reference", "id": "fc_unknown"}, by_reference[-1]]
    assert planner.plan(request(unknown, "k")).action == "full"


def test_a_reference_the_store_resolves_after_a_restart():
    from stateful_responses.continuation.prefixes import ENTRIES, REFS, entries_found

    first, upstream = Planner(), ReferenceUpstream()
    conv = [{"role": "user", "content": "x"}]
    _, response, _ = send(first, upstream, "k", conv, tool_output(1))
    writes = first.take_writes()
    second = Planner()
    second.tenancy.use_secret(first.tenancy.secret)
    second.upstreams.load({w.key: w.value for w in first.upstreams.take_writes()})  # the marks, from the store
    call = response["output"][0]
    items = conv + [{"type": "item_reference", "id": call["id"]},
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    plan = second.plan(request(items, "k"))
    keys = second.unresolved_references(plan)
    assert len(keys) == 1
    second.learn_references({w.key: w.value for w in writes if w.table == REFS and w.key in keys})
    second.discard(plan)
    plan = second.plan(request(items, "k"))
    assert second.unresolved_references(plan) == []
    second.improve(plan, entries_found({w.key: w.value for w in writes if w.table == ENTRIES}))
    assert plan.action == "continue" and plan.items_sent == 1
    assert second.stats()["requests"] == 1 and second.stats()["continued"] == 1


def test_a_background_response_waits_for_its_poll_from_the_same_tenant():
    planner = Planner()
    conv = [{"role": "user", "content": "x"}]
    plan = planner.plan(request(conv, "k"))
    queued = {"id": "resp_bg", "status": "queued", "background": True, "store": True, "output": []}
    assert planner.settle(plan, 200, queued).kind == "pending"
    finished = {**queued, "status": "completed", "output": assistant_output(1), "previous_response_id": None}
    other_scope = planner.plan(request(conv, "intruder")).scope
    assert planner.polled("resp_bg", other_scope, 200, finished) is None
    assert planner.polled("resp_bg", plan.scope, 200, {**queued, "status": "in_progress"}) is None
    assert planner.polled("resp_bg", plan.scope, 200, finished).kind == "advanced"
    planner.upstreams.mark("reads_back", plan.scope)
    nxt = conv + assistant_output(1) + [{"role": "user", "content": "y"}]
    assert planner.plan(request(nxt, "k")).previous_response_id == "resp_bg"


def test_a_mark_set_for_a_period_expires_after_it_and_is_written_with_it():
    now = [1000.0]
    planner = Planner(Config(clock=lambda: now[0]))
    upstreams = planner.upstreams
    assert upstreams.mark("refuses_websocket", "scope", 3600.0)
    (write,) = upstreams.take_writes()
    assert write.ttl == 3600.0
    now[0] += 3599
    assert upstreams.has("refuses_websocket", "scope")
    now[0] += 1
    assert not upstreams.has("refuses_websocket", "scope")
    assert upstreams.mark("reads_back", "scope") and upstreams.take_writes()[0].ttl == planner.config.ttl


def test_marks_in_memory_are_bounded_and_a_scan_never_pushes_out_those_in_use():
    import struct

    from stateful_responses.upstreams import Upstreams

    upstreams = Planner().upstreams
    for n in range(Upstreams.in_memory + 500):
        upstreams.mark("reads_back", f"scope-{n}")
    assert len(upstreams._expires) == Upstreams.in_memory and not upstreams.has("reads_back", "scope-0")
    assert upstreams.has("reads_back", "scope-4500")  # in use: the most recent
    expires = struct.pack("!d", time.time() + 3600)
    upstreams.load({f"reads_back\x00other-{n}".encode(): expires for n in range(Upstreams.in_memory)})
    assert upstreams.has("reads_back", "scope-4500")  # memory is full: the scan only fills free room
    upstreams.load({b"refuses_websocket\x00scope-4500": expires})  # a scope in use learns another replica's verdict
    assert upstreams.has("refuses_websocket", "scope-4500") and len(upstreams._expires) == Upstreams.in_memory
