"""Telemetry's pure cores: decisions read off flow metadata, bounded labels,
the families' exposition, span attributes, and the usage the lifters read."""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from stateful_responses.record.protocols import AnswerLifter
from stateful_responses.telemetry.decisions import FALLBACKS, Counted, Hosts, classify, is_responses_api
from stateful_responses.telemetry.metrics import Metrics
from stateful_responses.telemetry.traces import attributes
from telemetry_support import samples, value


def counted(decision=None, bridged=None, emulated=None, conversation=None, routed=None, overflow=False,
            answered=False) -> Counted:
    return classify(decision or {}, bridged or {}, emulated or {}, conversation or {}, routed or {}, overflow,
                    answered)


def test_each_decision_from_the_metadata_the_capabilities_set():
    assert counted() == Counted("passed", "http", ())
    assert counted({"action": "pass"}) == Counted("passed", "http", ())
    assert counted({"action": "full"}) == Counted("full", "http", ())
    assert counted({"action": "continue"}) == Counted("continued", "http", ())
    assert counted({"action": "continue", "retried_after": 400}) == Counted("full", "http", ("continuation_refused",))
    assert counted({"action": "continue", "retried_after": 200, "retry_reason": "unread"}).fallbacks == \
        ("continuation_unverified",)
    assert counted(bridged={"transport": "websocket", "action": "continue"}) == Counted("continued", "websocket", ())
    assert counted(bridged={"transport": "websocket", "action": "full", "retries": ["closed"]}) == \
        Counted("full", "websocket", ("socket_retried",))
    assert counted(bridged={"transport": "http", "action": "http"}) == Counted("full", "http", ("socket_gave_up",))
    assert counted({"action": "continue"}, overflow=True) == Counted("continued", "http", ("sockets_full",))
    assert counted({"action": "continue"}, routed={"failed_over_to": "https://b"}) == \
        Counted("full", "http", ("failed_over",))
    assert counted(bridged={"transport": "websocket", "action": "continue"},
                   routed={"failed_over_to": "https://b"}).transport == "http"
    # Expansion wins over what forward mode then did with the expanded body.
    assert counted({"action": "continue"}, emulated={"expanded": True}).decision == "expanded"
    assert counted(emulated={"expanded": True, "retried_after": 400}) == \
        Counted("expanded", "http", ("previous_id_refused",))
    assert counted(emulated={"expanded": False, "retried_after": 400}) == \
        Counted("passed", "http", ("expansion_refused",))
    assert counted(emulated={"references_expanded": True}).decision == "expanded"
    assert counted(conversation={"id": "conv_1", "items": 3}).decision == "expanded"
    assert counted(answered=True).decision == "answered"
    assert counted(emulated={"deleted": "resp_1"}).decision == "answered"
    assert counted(emulated={"error": "previous_response_not_found"}).decision == "answered"
    assert counted(conversation={"endpoint": "create", "status": 200}).decision == "answered"
    assert counted(conversation={"taken_over_after": 500}) == Counted("answered", "http", ("conversation_taken_over",))
    assert {r for r in FALLBACKS} >= {"internal_error", "upstream_unsupported", "ambiguous_body"}


def test_the_responses_api_paths_under_any_base():
    for path in ("/v1/responses", "/responses", "/openai/v1/responses/resp_1", "/v1/responses/resp_1/input_items",
                 "/v1/responses/resp_1/cancel", "/v1/conversations", "/v1/conversations/conv_1/items/msg_1"):
        assert is_responses_api(path), path
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses/a/b/c", "/v1/models", "/v1/responsesx"):
        assert not is_responses_api(path), path


def test_hosts_fold_into_other_past_their_bound():
    hosts = Hosts(limit=3)
    assert [hosts.label(h) for h in ("API.openai.com", "a", "b", "c", "api.openai.com", "")] == \
        ["api.openai.com", "a", "b", "other", "api.openai.com", "other"]


def test_the_families_and_their_series_stay_bounded():
    metrics = Metrics(lambda: (3, {"opened": 4, "closed": 1}))
    for n in range(200):
        upstream = metrics.upstream(f"host-{n}.example")
        metrics.request(Counted("continued", "http", ("socket_retried",)), upstream, 1000)
        metrics.sent(upstream, 100)
    metrics.store_operation("redis", "get", 0.002, False)
    metrics.store_operation("redis", "write", 0.5, True)
    metrics.added.observe(0.00003)
    found = samples(generate_latest(metrics.registry).decode())
    assert value(found, "stateful_requests_total") == 200
    assert value(found, "stateful_requests_total", upstream="other") == 200 - 32
    assert len({dict(ls).get("upstream") for (n, ls) in found if n == "stateful_requests_total"}) == 33
    assert value(found, "stateful_client_request_bytes_total") - value(found, "stateful_upstream_request_bytes_total") \
        == 200 * 900
    assert value(found, "stateful_fallbacks_total", reason="socket_retried") == 200
    assert value(found, "stateful_upstream_sockets") == 3
    assert value(found, "stateful_upstream_socket_events_total", event="opened") == 4
    assert value(found, "stateful_store_errors_total") == 1
    assert value(found, "stateful_store_operation_seconds_count", backend="redis") == 2
    assert value(found, "stateful_request_added_seconds_bucket", le="5e-05") == 1


class _Call:
    protocol, model, chain_id, response_id, status, status_code = "gemini-chat", "g", "chain1", "r1", "completed", 200
    input_tokens, output_tokens, client_transport, upstream_transport, started, ended = 5, None, "http", "http", 1, 2


def test_span_attributes_follow_the_genai_conventions():
    found = attributes(_Call(), None, "example.com")
    assert found == {"gen_ai.operation.name": "generate_content", "gen_ai.provider.name": "gcp.gemini",
                     "gen_ai.conversation.id": "chain1", "server.address": "example.com",
                     "stateful.protocol": "gemini-chat", "stateful.client_transport": "http",
                     "stateful.decision": "passed", "stateful.transport": "http", "gen_ai.request.model": "g",
                     "gen_ai.response.id": "r1", "gen_ai.usage.input_tokens": 5, "http.response.status_code": 200,
                     "stateful.response_status": "completed"}
    refused = _Call()
    refused.status_code = 429
    with_fallback = attributes(refused, Counted("full", "http", ("continuation_refused",)), "h")
    assert with_fallback["error.type"] == "429" and with_fallback["stateful.fallbacks"] == ["continuation_refused"]


def _lifted(protocol: str, events: list[dict] | None = None, body: dict | None = None):
    lifter = AnswerLifter(protocol)
    if body is not None:
        lifter.body(json.dumps(body))
    for event in events or ():
        lifter.event(event.get("type", ""), json.dumps(event))
    return lifter.finish()


def test_the_lifters_read_usage_json_and_streamed():
    response = {"id": "resp_1", "status": "completed", "output": [], "usage": {"input_tokens": 7, "output_tokens": 3}}
    assert _lifted("openai-responses", body=response).usage.input_tokens == 7
    assert _lifted("openai-responses", [{"type": "response.completed", "response": response}]).usage.output_tokens == 3
    chat = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                    "finish_reason": "stop"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    assert _lifted("openai-chat", body=chat).usage.output_tokens == 2
    chunks = [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"},
                                                                          "finish_reason": "stop"}]},
              {"id": "c", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 4, "completion_tokens": 2}}]
    usage = _lifted("openai-chat", chunks).usage
    assert (usage.input_tokens, usage.output_tokens) == (4, 2)
    anthropic = [{"type": "message_start", "message": {"id": "m", "role": "assistant", "content": [],
                                                       "usage": {"input_tokens": 9, "output_tokens": 1}}},
                 {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                 {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
                 {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 6}},
                 {"type": "message_stop"}]
    usage = _lifted("anthropic-messages", anthropic).usage
    assert (usage.input_tokens, usage.output_tokens) == (9, 6)
    gemini = {"candidates": [{"index": 0, "content": {"role": "model", "parts": [{"text": "x"}]},
                              "finishReason": "STOP"}],
              "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 5}, "responseId": "g1"}
    usage = _lifted("gemini-chat", body=gemini).usage
    assert (usage.input_tokens, usage.output_tokens) == (11, 5)
    assert _lifted("openai-chat", body={**chat, "usage": {"prompt_tokens": "many", "completion_tokens": True}}
                   ).usage.input_tokens is None


class _Connection:
    open = True


def test_the_pool_counts_what_befalls_its_sockets():
    from stateful_responses.websocket.pool import EVENTS, Declined, Pool

    now = [0.0]
    pool = Pool(lambda: now[0], max_per_scope=1, idle_s=10)
    assert pool.events == dict.fromkeys(EVENTS, 0)
    first = pool.choose("scope", b"root", [b"a"], {})
    pool.opened(first.held, _Connection())
    assert isinstance(pool.choose("scope", b"root", [b"b"], {}), Declined)  # its one socket is busy
    pool.release(first.held, None)
    pool.opened(first.held, _Connection())  # a broken connection replaced
    now[0] = 60.0
    pool.sweep()  # idle past idle_s: closed
    assert (pool.events["opened"], pool.events["closed"], pool.events["declined_busy"]) == (2, 2, 1)
    assert len(pool) == 0


async def test_an_observed_store_times_each_call_and_reports_its_failures():
    from stateful_responses.state.storage import StorageError
    from stateful_responses.state.storage.memory import MemoryStorage
    from stateful_responses.state.storage.observed import Observed

    told = []
    storage = Observed(MemoryStorage({}), "memory", lambda *call: told.append(call))
    await storage.open()
    assert await storage.get("turns", [b"k"]) == {}
    assert storage.name == storage.storage.name  # anything else passes as it is

    async def broken(*args):
        raise StorageError("down")

    storage.storage.get = broken
    try:
        await storage.get("turns", [b"k"])
    except StorageError:
        pass
    assert [(kind, operation, failed) for kind, operation, _, failed in told] == \
        [("memory", "open", False), ("memory", "get", False), ("memory", "get", True)]
    assert all(seconds >= 0 for _, _, seconds, _ in told)
