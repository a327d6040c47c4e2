"""Compressed request bodies through a real mitmdump: the openai SDK over a
transport that compresses every request body (as Codex does with zstd when
signed in with a ChatGPT account), in each coding mitmproxy knows. Every
capability reads them decoded; what goes upstream is the client's own bytes
when nothing changed, the changed body encoded as the client encoded it
otherwise; a bomb passes untouched while the proxy goes on answering."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import threading
import time
import zlib
from dataclasses import dataclass, field

import brotli
import openai
import pytest
import zstandard
from stateful_responses.emulator import Emulator
from driver import (
    ChainedConversation,
    Conversation,
    assert_chain_context_preserved,
    assert_context_preserved,
    httpx,
    meaning,
    user_turns,
    without_comparisons,
)

AUTH = {"authorization": "Bearer sk-test-key"}
MiB = 1024 * 1024


def compress(body: bytes, coding: str) -> bytes:
    if coding == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(body)
    if coding == "gzip":
        return gzip.compress(body)
    if coding == "deflate":
        return zlib.compress(body)
    return brotli.compress(body)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Compressing(httpx.BaseTransport):
    """Sends every request body compressed, with its Content-Encoding; keeps
    the bytes it sent."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.inner = httpx.HTTPTransport()
        self.sent: list[bytes] = []

    def handle_request(self, request):
        body = request.read()
        if body:
            data = compress(body, self.coding)
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers={**headers, "content-encoding": self.coding},
                                    content=data, extensions=request.extensions)
            self.sent.append(data)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _compressing_client(conv, coding: str) -> Compressing:
    """``conv``'s openai client, its recording hook kept, over a compressing transport."""
    hooks = conv.client._client.event_hooks
    conv.client.close()
    transport = Compressing(coding)
    conv.client = openai.OpenAI(base_url=conv.base_url + "/v1", api_key=conv.api_key, max_retries=conv.max_retries,
                                http_client=httpx.Client(event_hooks=hooks, transport=transport, trust_env=False,
                                                         timeout=60))
    return transport


@dataclass
class CompressedConversation(Conversation):
    coding: str = "zstd"
    transport: Compressing | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.transport = _compressing_client(self, self.coding)


@dataclass
class CompressedChainedConversation(ChainedConversation):
    coding: str = "zstd"

    def __post_init__(self) -> None:
        super().__post_init__()
        _compressing_client(self, self.coding)


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def converse(conv: Conversation, texts: list[str]) -> None:
    try:
        for text in texts:
            conv.turn(text)
    finally:
        conv.close()


def clean(output: str) -> bool:
    return "internal error" not in output and "Traceback" not in output


@pytest.mark.parametrize("coding,stream", [("zstd", False), ("zstd", True), ("gzip", False), ("gzip", True),
                                           ("deflate", False), ("br", False)],
                         ids=["zstd-json", "zstd-sse", "gzip-json", "gzip-sse", "deflate-json", "br-json"])
def test_a_compressed_full_history_conversation_is_continued(emulator, start_proxy, tmp_path, coding, stream):
    record = tmp_path / "record.jsonl"
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true", "--set", f"stateful_record_file={record}")
    conv = CompressedConversation(proxy.url, stream=stream, coding=coding)
    converse(conv, user_turns(6))
    records = log(emulator)
    assert len(records) == len(conv.sent) >= 6
    assert [r["continued"] for r in records] == [False] + [True] * (len(records) - 1)
    assert all(r.get("body_encoding") == coding for r in records)  # rewritten, and sent as the client encoded it
    assert all(r["input_items"] <= 2 for r in records[1:])
    assert_context_preserved(conv.sent, records)
    for _ in range(100):  # the record's lines are written as the answers end
        lines = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        if len(lines) >= len(conv.sent):
            break
        time.sleep(0.05)
    assert len(lines) == len(conv.sent) and len({line["continuation"]["chainId"] for line in lines}) == 1
    assert clean(proxy.output())


@pytest.mark.parametrize("coding", ["zstd", "gzip"])
def test_an_untouched_compressed_body_goes_as_the_clients_own_bytes(proxy, emulator, coding):
    body = compress(json.dumps({"model": "gpt-test", "input": "hello", "store": True}).encode(), coding)
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", content=body,
                   headers={**AUTH, "content-type": "application/json", "content-encoding": coding})
    assert r.status_code == 200
    assert log(emulator)[-1]["body_sha256"] == sha(body) and log(emulator)[-1]["body_encoding"] == coding


def test_a_refused_continuation_is_retried_with_the_clients_own_compressed_bytes(proxy, emulator):
    conv = CompressedConversation(proxy.url, as_dicts=True)
    conv.turn("first")
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}]})
    converse(conv, ["second"])
    records = log(emulator)
    assert [r["status_code"] for r in records] == [200, 400, 200]
    assert records[1]["previous_response_id"] is not None and records[1]["body_encoding"] == "zstd"
    assert records[2]["body_sha256"] == sha(conv.transport.sent[1])  # byte for byte what the client sent
    assert_context_preserved(conv.sent, [r for r in records if r["status_code"] == 200])


def test_store_emulation_expands_a_compressed_previous_response_id_request(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    conv = CompressedChainedConversation(proxy.url, coding="zstd")
    converse(conv, user_turns(4))
    records = log(emulator)
    assert_chain_context_preserved(conv, records)
    assert all(r["previous_response_id"] is None and r["body_encoding"] == "zstd" for r in records)
    assert "expanded" in proxy.output() and clean(proxy.output())


def test_conversation_emulation_reads_compressed_requests(emulator, start_proxy):
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    transport = Compressing("zstd")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test-key", max_retries=0,
                           http_client=httpx.Client(transport=transport, trust_env=False, timeout=30))
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"}])
    for text in ["turn 0: hello", "turn 1: and more"]:
        before = [item.model_dump(exclude_unset=True)
                  for item in client.conversations.items.list(conversation.id, order="asc")]
        new = [{"role": "user", "content": text}]
        assert client.responses.create(model="gpt-test", input=new, conversation=conversation.id).conversation.id \
            == conversation.id
        seen = log(emulator)[-1]
        assert meaning(seen["context"]) == meaning(before + new)  # the conversation expanded into the request
        assert seen["conversation"] is None and seen["body_encoding"] == "zstd"
    client.close()
    assert len(transport.sent) == 3 and clean(proxy.output())


def test_the_router_keeps_compressed_chains_where_their_state_lives(start_proxy):
    upstreams = [Emulator().start() for _ in range(2)]
    try:
        proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams))
        clients = [CompressedChainedConversation(proxy.url, api_key=f"sk-chained-{n}") for n in range(3)]
        for n in range(3):
            for client in clients:
                client.turn(f"turn {n}")
        for client in clients:
            client.close()
        served = [[r for r in u.model.snapshot_log() if r["status_code"] == 200] for u in upstreams]
        assert all(len(s) >= 3 for s in served)  # new chains spread over both
        assert all(r["body_encoding"] == "zstd" for s in served for r in s)
        chains = [{r["credential"] for r in s} for s in served]
        assert not chains[0] & chains[1]  # and every chain stayed where it started
        assert clean(proxy.output())
    finally:
        for upstream in upstreams:
            upstream.stop()


def test_the_bridge_continues_a_compressed_conversation_over_the_upstream_socket(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true", upstream_websocket="auto")
    conv = CompressedConversation(proxy.url, coding="zstd", options={"store": False})
    converse(conv, user_turns(4))
    records = log(emulator)
    assert [r["transport"] for r in records] == ["websocket"] * len(records)
    assert [r["continued"] for r in records] == [False] + [True] * (len(records) - 1)
    assert_context_preserved(conv.sent, records)
    assert clean(proxy.output())


def bomb(coding: str) -> bytes:
    """A valid request whose body decodes to 70 MiB: a few kB in zstd, about 70 kB in gzip (gzip's ratio
    is at most about 1000, so it meets the 64 MiB bound rather than the ratio)."""
    body = b'{"model":"gpt-test","store":true,"input":"' + b"x" * (70 * MiB) + b'"}'
    return compress(body, coding)


@pytest.mark.parametrize("coding", ["zstd", "gzip"])
def test_a_bomb_passes_untouched_while_the_proxy_answers_another_client(proxy, emulator, coding):
    data = bomb(coding)
    assert len(data) < 128 * 1024
    answered: list[int] = []

    def send_bomb() -> None:
        with httpx.Client(trust_env=False, timeout=120) as c:
            answered.append(c.post(proxy.url + "/v1/responses", content=data,
                                   headers={**AUTH, "content-type": "application/json",
                                            "content-encoding": coding}).status_code)

    sender = threading.Thread(target=send_bomb)
    sender.start()
    conv = CompressedConversation(proxy.url, coding="zstd")
    converse(conv, user_turns(3))
    sender.join(120)
    assert answered == [200]
    bombs = [r for r in log(emulator) if r["body_sha256"] == sha(data)]
    assert len(bombs) == 1  # passed byte for byte
    others = [r for r in log(emulator) if r["body_sha256"] != sha(data)]
    assert [r["continued"] for r in others] == [False] + [True] * (len(others) - 1)
    assert clean(proxy.output())


def test_an_undecodable_body_passes_untouched(proxy, emulator):
    body = b"\x28\xb5\x2f\xfd not a zstd frame"
    with httpx.Client(trust_env=False) as c:
        r = c.post(proxy.url + "/v1/responses", content=body,
                   headers={**AUTH, "content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 400  # the upstream's own refusal, as without the addon
    assert log(emulator)[-1]["body_sha256"] == sha(body)
    assert clean(proxy.output())


def test_streamed_request_bodies_are_decoded_as_they_arrive(emulator, start_proxy):
    """With stream_large_bodies, forward mode collects the body as it streams:
    it is decoded on the way in, and goes upstream re-encoded, or as the
    client's own bytes past the bound."""
    proxy = start_proxy(emulator.url, "--set", "stream_large_bodies=2k", "--set", "stateful_debug=true")
    noise = os.urandom(4096).hex()  # hardly compressible: every body streams
    conv = CompressedConversation(proxy.url, coding="zstd")
    converse(conv, user_turns(6, tag=noise))
    records = log(emulator)
    assert all(len(sent) > 2048 for sent in conv.transport.sent)
    assert [r["continued"] for r in records] == [False] + [True] * (len(records) - 1)
    assert all(r["body_encoding"] == "zstd" for r in records)
    assert_context_preserved(conv.sent, records)
    data = compress(b'{"model":"gpt-test","store":true,"instructions":"' + noise.encode() + b'","input":"'
                    + b"x" * (70 * MiB) + b'"}', "zstd")
    assert 2048 < len(data) < 128 * 1024
    with httpx.Client(trust_env=False, timeout=120) as c:
        r = c.post(proxy.url + "/v1/responses", content=data,
                   headers={**AUTH, "content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 200 and log(emulator)[-1]["body_sha256"] == sha(data)
    assert clean(proxy.output())
