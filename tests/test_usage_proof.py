"""The proof that a stored chain feeds the model what it holds, without
mitmproxy: ``usage.input_tokens`` of a continuation against its parent's
counts (``chain_fell_short``) and against the same turn sent whole
(``same_context``), the verdicts per item kind the planner keeps, and the
emulator, OpenAI's faithful twin, which no check may flag."""

from __future__ import annotations

import json

import httpx
import pytest
from stateful_responses.continuation.planner import Planner
from stateful_responses.upstreams import Usage, chain_fell_short, item_kind, same_context, usage_of
from test_planner import ReferenceUpstream, assistant_output, echo, request, send

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]


def test_usage_is_read_with_its_reasoning_tokens_and_odd_usage_is_none():
    assert usage_of({"usage": {"input_tokens": 10, "output_tokens": 5,
                               "output_tokens_details": {"reasoning_tokens": 3}}}) == Usage(10, 5, 3)
    assert usage_of({"usage": {"input_tokens": 10, "output_tokens": 5}}) == Usage(10, 5, 0)
    for odd in ({}, {"usage": None}, {"usage": {"input_tokens": True, "output_tokens": 1}},
                {"usage": {"input_tokens": -1, "output_tokens": 1}}, {"usage": {"input_tokens": 1}}):
        assert usage_of(odd) is None


def test_vllms_measured_counts_are_caught_and_a_faithful_servers_are_not():
    # vLLM 0.32.0, a role:system input item then a text turn: parent 28 in, 8 out; the same turn sent whole
    # is fed 60 tokens, the continuation 44 (the system item dropped).
    parent = Usage(28, 8, 0)
    assert chain_fell_short(parent, Usage(44, 8, 0), parent_output_items=1) is False  # the new items hide it
    assert same_context(Usage(44, 8, 0), Usage(60, 8, 0)) is False  # the comparison does not
    assert chain_fell_short(parent, Usage(20, 8, 0), parent_output_items=1) is True
    # reasoning tokens are billed as output and not fed back: never a shortfall
    assert chain_fell_short(Usage(100, 60, 50), Usage(112, 8, 0), parent_output_items=2) is False
    assert same_context(Usage(57, 1, 0), Usage(58, 9, 0)) is True


def test_item_kinds():
    assert item_kind("message", "system") == "message:system"
    assert item_kind(None, "user") == "message:user"  # an easy message
    assert item_kind("function_call", None) == "function_call"
    assert item_kind(None, None) == "?"


def _post(client: httpx.Client, body: dict) -> dict:
    answer = client.post("/v1/responses", json={"model": "gpt-test", "tools": TOOLS, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _echoes(output: list, style: str) -> list:
    if style == "model_dump":
        return [{**item, "phase": None, "caller": None} for item in output]
    if style == "easy":
        return [{"role": "assistant", "content": item["content"][0]["text"]} if item["type"] == "message"
                else {k: v for k, v in item.items() if k not in ("id", "status")} for item in output]
    return output


@pytest.mark.parametrize("style", ["as-is", "model_dump", "easy"])
def test_the_emulator_a_faithful_server_is_never_flagged(emulator, style):
    """Every continuation of a conversation with text, a system and a
    developer item, tool calls and reasoning is fed what the same turn sent
    whole is, and never less than its chain holds: the emulator bills as
    OpenAI does (what the model reads; reasoning tokens not fed back)."""
    turns = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
             [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": 'call:get_weather({})'}],
             "tool", [{"role": "user", "content": "thanks"}], [{"role": "user", "content": "and tomorrow?"}]]
    history: list = []
    previous: dict | None = None
    with httpx.Client(base_url=emulator.url, headers={"authorization": "Bearer sk-faithful"}, timeout=30) as c:
        for n, new in enumerate(turns):
            if new == "tool":
                call = next(i for i in previous["output"] if i["type"] == "function_call")
                new = [{"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp": 21}'}]
            extra = {"reasoning": {"effort": "low"}} if n % 2 else {}
            history += new
            whole = _post(c, {"input": history, **extra})
            if previous is not None:
                continued = _post(c, {"input": new, "previous_response_id": previous["id"], **extra})
                parent, answer = usage_of(previous), usage_of(continued)
                assert not chain_fell_short(parent, answer, len(previous["output"])), (n, parent, answer)
                assert same_context(answer, usage_of(whole)), (n, answer, usage_of(whole))
            if extra:
                assert usage_of(whole).reasoning > 0
            previous = whole
            history += _echoes(whole["output"], style)


class LossyUpstream(ReferenceUpstream):
    """vLLM's chain: ``role: system`` items dropped when a chain is rebuilt;
    answers bill one token per item of their context, ten per output item."""

    def answer(self, key, body, output, store_ok=True):
        status, response, context = super().answer(key, body, output, store_ok)
        if response is None:
            return status, response, context
        if body.get("previous_response_id") is not None:
            context = [i for i in context if i.get("role") != "system" or i in body["input"]]
        response["usage"] = {"input_tokens": 10 * len(context), "output_tokens": 10 * len(output)}
        return status, response, context


def test_a_shortfall_marks_the_chain_lossy_and_its_kinds_go_whole_from_then_on():
    """The check every continued answer gets, over HTTP and over a socket alike
    (the bridge settles its answers into the same planner)."""
    planner, upstream = Planner(), LossyUpstream()
    items = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plan, response, _ = send(planner, upstream, "k", items, assistant_output(1))
    items = items + [echo(o, 0) for o in response["output"]]
    # the check is on the answer: a continuation billed less than its chain holds
    nxt = items + [{"role": "user", "content": "more"}]
    plan = planner.plan(request(nxt, "k"))
    assert plan.action == "continue" and plan.verify == {"message:system"} and plan.checked
    status, answer, _ = upstream.answer("k", json.loads(plan.body), assistant_output(2))
    answer["usage"]["input_tokens"] = 15  # fewer than the parent's 20 + 10
    outcome = planner.settle(plan, status, answer)
    assert outcome.kind == "lossy"
    assert planner.upstreams.drops(plan.scope, "message:system")
    assert not planner.upstreams.drops(plan.scope, "message:user")  # only the kind not known kept
    # from then on: never continued, this conversation or another with a system item; text still is
    again = planner.plan(request(nxt, "k"))
    assert again.action == "full" and "message:system" in again.reason
    plain = [{"role": "user", "content": "plain"}]
    _, first, _ = send(planner, upstream, "k", plain, assistant_output(3))
    plan, _, _ = send(planner, upstream, "k", plain + first["output"] + [{"role": "user", "content": "on"}],
                      assistant_output(4))
    assert plan.action == "continue" and not plan.checked


def test_a_comparison_teaches_kept_or_dropped_for_the_kinds_compared_only():
    planner, upstream = Planner(), ReferenceUpstream()
    items = [{"role": "developer", "content": "terse"}, {"role": "user", "content": "hi"}]
    _, response, _ = send(planner, upstream, "k", items, assistant_output(1))
    plan = planner.plan(request(items + response["output"] + [{"role": "user", "content": "more"}], "k"))
    assert plan.verify == {"message:developer"}
    assert planner.judge_chain(plan, kept=True) == ["message:developer"]
    again = planner.plan(request(items + response["output"] + [{"role": "user", "content": "more"}], "k"))
    assert again.action == "continue" and not again.verify and not again.checked
    tools = items + response["output"] + [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                         {"type": "function_call_output", "call_id": "c", "output": "1"}]
    plan = planner.plan(request(tools, "k"))
    assert plan.verify == {"function_call", "function_call_output"}
    assert sorted(planner.judge_chain(plan, kept=False)) == ["function_call", "function_call_output"]
    assert not planner.upstreams.drops(plan.scope, "message:developer")
    assert planner.plan(request(tools, "k")).action == "full"


def test_a_continuation_that_cannot_be_held_is_not_compared_but_sent_whole():
    planner, upstream = Planner(), ReferenceUpstream()
    items = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, response, _ = send(planner, upstream, "k", items, assistant_output(1))
    plan = planner.plan(request(items + response["output"] + [{"role": "user", "content": "more"}], "k"),
                        checkable=False)
    assert plan.action == "full" and "cannot be held" in plan.reason


def test_instructions_changed_or_truncation_make_counts_incomparable():
    planner, upstream = Planner(), LossyUpstream()
    items = [{"role": "user", "content": "hi"}]
    _, response, _ = send(planner, upstream, "k", items, assistant_output(1), instructions="a long instruction")
    plan = planner.plan(request(items + response["output"] + [{"role": "user", "content": "x"}], "k",
                                instructions="short"))
    status, answer, _ = upstream.answer("k", json.loads(plan.body), assistant_output(2))
    answer["usage"]["input_tokens"] = 1
    assert planner.settle(plan, status, answer).kind == "advanced"  # not comparable: today's rule
    assert not planner.upstreams.drops_any(plan.scope)


def test_an_answer_over_a_socket_is_checked_as_one_over_http():
    """The WebSocket bridge continues a turn from its socket's own memory and
    reports what it sent (``carried``) before settling the answer: a socket
    that dropped the chain (vLLM's WebSocket mode strips previous_response_id)
    shows it in the answer's count alike."""
    planner, upstream = Planner(), LossyUpstream()
    items = [{"role": "user", "content": "hi"}]
    _, first, _ = send(planner, upstream, "k", items, assistant_output(1))
    items = items + first["output"] + [{"role": "user", "content": "more"}]
    plan = planner.plan(request(items, "k"))
    sent = json.dumps({"model": "gpt-test", "input": items[-1:], "previous_response_id": first["id"]}).encode()
    planner.carried(plan, first["id"], 1, sent)
    answer = {"id": "resp_socket", "status": "completed", "previous_response_id": first["id"],
              "output": assistant_output(2), "usage": {"input_tokens": 10, "output_tokens": 10}}
    assert planner.settle(plan, 200, answer).kind == "lossy"
    assert planner.upstreams.drops_any(plan.scope)
    assert planner.plan(request(items, "k")).action == "full"
