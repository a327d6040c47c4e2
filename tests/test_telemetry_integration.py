"""Telemetry through a real mitmdump: /metrics after a known mix of traffic,
every counter against what the emulator saw, and the same figures from a
real Prometheus server scraping the proxy; cardinality under 1,000 tenants;
a marker credential and prompt in neither /metrics nor spans; spans received
by an OTLP receiver, one per call, one conversation id per conversation."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import httpx
import openai
import pytest
import websockets
from driver import ChainedConversation, Conversation
from harness import free_port
from telemetry_support import OtlpReceiver, PrometheusServer, samples, scrape, value

DECISIONS = ("continued", "full", "passed", "expanded", "answered")


async def own_socket_turns(proxy_url: str, turns: int) -> int:
    """A client's own WebSocket (as Codex, or the SDK's responses.connect()):
    ``turns`` chained response.create messages; the bytes it sent."""
    sent = 0
    async with websockets.connect(proxy_url.replace("http://", "ws://") + "/v1/responses", proxy=None,
                                  additional_headers={"authorization": "Bearer sk-own"}, open_timeout=60) as socket:
        previous = None
        for n in range(turns):
            message = json.dumps({"type": "response.create", "model": "m-own", "input": f"own socket turn {n}",
                                  **({"previous_response_id": previous} if previous else {})})
            sent += len(message.encode())
            await socket.send(message)
            while (event := json.loads(await socket.recv()))["type"] != "response.completed":
                pass
            previous = event["response"]["id"]
    return sent


def mixed_traffic(emulator, proxy_url: str) -> tuple[int, int]:
    """Continued and whole over HTTP (a credential whose upgrade was refused),
    one continuation refused and retried; over the bridge, one socket closing
    on a turn; chains expanded by store emulation; a retrieve the proxy
    answers; a request passed; two turns on a client's own socket. Returns
    the requests made and the request body bytes the clients sent."""
    emulator.model.control({"websocket": "refuse"})
    http_part = Conversation(proxy_url, api_key="sk-http", model="m-http")
    for i in range(4):
        http_part.turn(f"http turn {i}")
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}]})
    http_part.turn("http turn refused")
    emulator.model.control({"websocket": None})
    ws_part = Conversation(proxy_url, api_key="sk-ws", model="m-ws")
    for i in range(3):
        ws_part.turn(f"ws turn {i}")
    emulator.model.control({"fail_next": [{"kind": "ws_close", "after_events": 0}]})
    ws_part.turn("ws turn closed")
    chained = ChainedConversation(proxy_url, api_key="sk-chain", model="m-chain")
    for i in range(3):
        chained.turn(f"chained turn {i}")
    chained.client.responses.retrieve(chained.previous)
    passed = Conversation(proxy_url, api_key="sk-http", model="other-model")
    passed.turn("passed")
    parts = (http_part, ws_part, chained, passed)
    for part in parts:
        part.close()
    own_bytes = asyncio.run(own_socket_turns(proxy_url, 2))
    return sum(len(p.sent) for p in parts) + 1 + 2, sum(s.size for p in parts for s in p.sent) + own_bytes


def test_every_counter_matches_what_the_emulator_saw_and_prometheus_scrapes_it(emulator, start_proxy, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(emulator.url, "--set", f"stateful_metrics={address}", "--set", "stateful_emulate=always",
                        "--set", "stateful_models=m-*", upstream_websocket="auto")
    requests, client_bytes = mixed_traffic(emulator, proxy.url)
    found = samples(scrape(address))
    log = emulator.model.snapshot_log()

    def logged(**match) -> list[dict]:
        return [r for r in log if all(r.get(k) == v for k, v in match.items())]

    def requests_of(decision: str, transport: str | None = None) -> float:
        labels = {"decision": decision} | ({"transport": transport} if transport else {})
        return value(found, "stateful_requests_total", **labels)

    assert sum(requests_of(d) for d in DECISIONS) == requests == 16
    assert requests_of("continued", "http") == len(logged(model="m-http", transport="http", continued=True)) == 3
    assert requests_of("full", "http") == len(logged(model="m-http", status_code=200, continued=False)) == 2
    bridged = [r for r in log if r["transport"] == "websocket" and r["model"] != "m-own"]
    assert requests_of("continued", "websocket") == len([r for r in bridged if r["continued"] and not r["fault"]]) \
        == 3
    assert requests_of("full", "websocket") == len([r for r in bridged if not r["continued"]]) == 2
    assert requests_of("expanded") == requests_of("expanded", "http") == \
        len(logged(model="m-chain", transport="http")) == 2  # chains the proxy expanded (then continued upstream)
    assert requests_of("passed", "http") == len(logged(model="other-model")) == 1
    assert requests_of("passed", "websocket") == len(logged(model="m-own", transport="websocket")) == 2
    assert requests_of("answered") == 1  # the retrieve: the emulator never had it (its log has no GET either)
    # Upload saved: what the clients sent, and every byte the upstream received, retries and socket messages too.
    assert value(found, "stateful_client_request_bytes_total", upstream="127.0.0.1") == client_bytes
    assert value(found, "stateful_upstream_request_bytes_total", upstream="127.0.0.1") == \
        sum(r["body_bytes"] for r in log)
    assert sum(r["body_bytes"] for r in log) < client_bytes
    fallbacks = {dict(ls)["reason"]: v for (n, ls), v in found.items() if n == "stateful_fallbacks_total"}
    assert fallbacks["continuation_refused"] == len(logged(fault="reject")) == 1
    assert fallbacks["socket_retried"] == len(logged(fault="ws_close")) == 1
    assert sum(fallbacks.values()) == 2 and len(fallbacks) == 12  # every reason shows, at 0 until it happens
    assert value(found, "stateful_upstream_sockets") == 2  # the bridged conversations' sockets, still held
    events = {dict(ls)["event"]: v for (n, ls), v in found.items() if n == "stateful_upstream_socket_events_total"}
    assert events["refused"] == 1 and events["opened"] == 3 and events["closed"] == 1
    assert events["continued"] == requests_of("continued", "websocket")
    assert value(found, "stateful_store_operation_seconds_count", backend="sqlite", operation="get") > 0
    assert value(found, "stateful_store_operation_seconds_count", backend="sqlite", operation="write") > 0
    assert value(found, "stateful_store_errors_total") == 0
    # Every client HTTP request once: the own socket's upgrade is one, its messages have no request hooks.
    assert value(found, "stateful_request_added_seconds_count") == requests - 2 + 1

    # A real Prometheus server scrapes the proxy and reads the same figures.
    if shutil.which("prometheus") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Debian's prometheus is required in CI (.ci/run installs it)")
        pytest.skip("no prometheus here (apt-get install prometheus): every figure above was checked, not its scrape")
    prometheus = PrometheusServer(tmp_path / "prometheus", [address])
    try:
        prometheus.scraped_up()
        by_decision = {r["metric"]["decision"]: float(r["value"][1])
                       for r in prometheus.query("sum by (decision) (stateful_requests_total)")}
        assert by_decision == {d: requests_of(d) for d in DECISIONS}
        saved = prometheus.query('sum(stateful_client_request_bytes_total) - sum(stateful_upstream_request_bytes_total)')
        assert float(saved[0]["value"][1]) == client_bytes - sum(r["body_bytes"] for r in log)
        refused = prometheus.query('stateful_fallbacks_total{reason="continuation_refused"}')
        assert float(refused[0]["value"][1]) == 1
        assert float(prometheus.query("stateful_upstream_sockets")[0]["value"][1]) == 2
        assert float(prometheus.query("sum(stateful_request_added_seconds_count)")[0]["value"][1]) == requests - 1
    finally:
        prometheus.stop()


def _series(address: str) -> set:
    return set(samples(scrape(address)))


def test_cardinality_stays_flat_while_1000_credentials_and_conversations_pass(emulator, start_proxy):
    address = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(emulator.url, "--set", f"stateful_metrics={address}", "--set", "stateful_emulate=auto")
    with httpx.Client(base_url=proxy.url + "/v1", trust_env=False, timeout=60) as client:
        def conversation(n: int) -> None:
            first = client.post("/responses", headers={"authorization": f"Bearer sk-tenant-{n:04d}"},
                                json={"model": "gpt-test", "input": f"hello from conversation {n}"})
            assert first.status_code == 200
            followed = client.post("/responses", headers={"authorization": f"Bearer sk-tenant-{n:04d}"},
                                   json={"model": "gpt-test", "input": "and then", "previous_response_id":
                                         first.json()["id"]})
            assert followed.status_code == 200

        for n in range(10):
            conversation(n)
        before = _series(address)
        for n in range(10, 1000):
            conversation(n)
    after = _series(address)
    assert after == before, sorted(after ^ before)
    assert len(after) < 300
    found = samples(scrape(address))
    assert sum(value(found, "stateful_requests_total", decision=d) for d in DECISIONS) == 2000
    text = scrape(address)
    assert "sk-tenant" not in text and "resp_" not in text and "hello from" not in text


def test_traces_one_span_per_call_one_conversation_id_per_conversation_no_secrets(emulator, start_proxy,
                                                                                     monkeypatch, tmp_path):
    anthropic = pytest.importorskip("anthropic")
    genai = pytest.importorskip("google.genai")
    receiver = OtlpReceiver()
    marker_key, marker_prompt = "sk-MARKER-credential-5f3a", "MARKER-prompt-9c1e"
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    try:
        options = ("--set", "stateful_traces=otlp", "--set", f"stateful_metrics={address}")
        proxy = start_proxy(emulator.url, *options, upstream_websocket="auto", confdir=str(tmp_path))
        calls = 0
        responses = [Conversation(proxy.url, api_key=marker_key, model="gpt-test") for _ in range(2)]
        for conversation in responses:
            for i in range(3):
                calls += conversation.turn(f"{marker_prompt} responses turn {i}")
        chat = openai.OpenAI(base_url=proxy.url + "/v1", api_key=marker_key, max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=60))
        messages = []
        for i in range(3):
            messages.append({"role": "user", "content": f"{marker_prompt} chat turn {i}"})
            answer = chat.chat.completions.create(model="gpt-chat", messages=messages)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            calls += 1
        claude = anthropic.Anthropic(base_url=proxy.url, api_key=marker_key, max_retries=0)
        said = []
        for i in range(2):
            said.append({"role": "user", "content": f"{marker_prompt} anthropic turn {i}"})
            message = claude.messages.create(model="claude-test", max_tokens=64, messages=said)
            said.append({"role": "assistant", "content": message.content[0].text})
            calls += 1
        gemini = genai.Client(api_key=marker_key, http_options=genai.types.HttpOptions(
            base_url=proxy.url, retry_options=genai.types.HttpRetryOptions(attempts=1)))
        contents = []
        for i in range(2):
            contents.append({"role": "user", "parts": [{"text": f"{marker_prompt} gemini turn {i}"}]})
            reply = gemini.models.generate_content(model="gemini-test", contents=contents)
            contents.append({"role": "model", "parts": [{"text": reply.text}]})
            calls += 1
        metrics_text = scrape(address)
        spans = receiver.wait_for(calls)
        time.sleep(1)  # nothing more comes: one span per call, not more
        spans = receiver.wait_for(calls + 1, timeout=1)
        proxy.stop()
        # Restarted on the same store: the first conversation's next turn keeps its conversation id.
        start_proxy(emulator.url, *options, upstream_websocket="auto", confdir=str(tmp_path), port=proxy.port)
        again = Conversation(proxy.url, api_key=marker_key, model="gpt-test", history=responses[0].history)
        calls += again.turn(f"{marker_prompt} after the restart")
        after = receiver.wait_for(calls)[len(spans):]
    finally:
        receiver.stop()
    assert len(after) == 1
    assert len(spans) == calls - 1 == 3 + 3 + 3 + 2 + 2
    by_protocol: dict[str, list[dict]] = {}
    for span in spans:
        by_protocol.setdefault(span["attributes"]["stateful.protocol"], []).append(span)
    assert {p: len(s) for p, s in by_protocol.items()} == {"openai-responses": 6, "openai-chat": 3,
                                                           "anthropic-messages": 2, "gemini-chat": 2}
    responses_spans = sorted(by_protocol["openai-responses"], key=lambda s: s["start"])
    conversation_ids = [s["attributes"]["gen_ai.conversation.id"] for s in responses_spans]
    assert len(set(conversation_ids[:3])) == 1 and len(set(conversation_ids[3:])) == 1
    assert conversation_ids[0] != conversation_ids[3]
    assert after[0]["attributes"]["gen_ai.conversation.id"] == conversation_ids[0]
    for protocol in ("openai-chat", "anthropic-messages", "gemini-chat"):
        assert len({s["attributes"]["gen_ai.conversation.id"] for s in by_protocol[protocol]}) == 1
    assert len({s["attributes"]["gen_ai.conversation.id"] for s in spans}) == 5
    provider = {"openai-responses": "openai", "openai-chat": "openai", "anthropic-messages": "anthropic",
                "gemini-chat": "gcp.gemini"}
    for span in spans:
        a = span["attributes"]
        assert a["gen_ai.provider.name"] == provider[a["stateful.protocol"]]
        assert a["gen_ai.operation.name"] == ("generate_content" if a["stateful.protocol"] == "gemini-chat"
                                              else "chat")
        assert a["gen_ai.request.model"] and a["gen_ai.response.id"]
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert a["stateful.decision"] in DECISIONS
        assert span["end"] >= span["start"] and span["resource"]["service.name"] == "stateful-responses"
    decisions = [s["attributes"]["stateful.decision"] for s in responses_spans]
    assert decisions[0] == "full" and set(decisions[1:3]) == {"continued"}
    assert {s["attributes"]["stateful.transport"] for s in responses_spans} == {"websocket"}
    assert {s["attributes"]["stateful.decision"] for s in spans if s not in responses_spans} == {"passed"}
    # No content and no credential: neither in a span (the raw protobuf bodies) nor in /metrics.
    metrics_text += scrape(address)
    raw = b"".join(receiver.bodies)
    for marker in (marker_key, marker_prompt, "MARKER"):
        assert marker.encode() not in raw
        assert marker not in metrics_text

