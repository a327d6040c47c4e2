"""Through real mitmdump: conversations at rest are sealed per tenant.
After a conversation whose prompts and answers carry a marker, in ``always``
mode, nothing in the store (every file in the confdir, WAL included, or every
key and value in Redis) holds the marker or any answer text; a sealed turn
moved under another id, or read with another credential, fails closed."""

from __future__ import annotations

import asyncio

import pytest
from driver import ChainedConversation, assert_chain_context_preserved, httpx, tenant_of
from stateful_responses.store_emulation.turns import TURNS

MARKER = "Zebra-7f3a-Marker"


def log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


def converse(proxy) -> tuple[ChainedConversation, list[str]]:
    conv = ChainedConversation(proxy.url, api_key="sk-sealed")
    for n in range(4):
        conv.turn(f"{MARKER} secret {n}: tell me about it")
    conv.close()
    return conv, [c["content"][0]["text"] for m in conv.meant for c in m if c.get("role") == "assistant"]


def all_bytes_in(directory) -> bytes:
    return b"".join(path.read_bytes() for path in directory.rglob("*") if path.is_file())


def redis_dump(url: str) -> bytes:
    import redis

    client = redis.Redis.from_url(url)
    try:
        dump = b""
        for key in client.scan_iter(count=1000):
            dump += key
            kind = client.type(key)
            if kind == b"string":
                dump += client.get(key) or b""
            elif kind == b"zset":
                dump += b"".join(client.zrange(key, 0, -1))
            elif kind == b"set":
                dump += b"".join(client.smembers(key))
            elif kind == b"hash":
                dump += b"".join(k + v for k, v in client.hgetall(key).items())
        return dump
    finally:
        client.close()


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_nothing_of_a_conversation_is_in_the_store_in_clear(emulator, start_proxy, tmp_path, request, store):
    emulator.model.control({"stateless": "reject"})
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    extra = []
    if store == "redis":
        redis_url = request.getfixturevalue("redis_server").url
        extra = ["--set", f"stateful_store={redis_url}"]
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", *extra, confdir=str(confdir))
    conv, answers = converse(proxy)
    assert_chain_context_preserved(conv, log(emulator))  # the record really was used
    assert answers and all(MARKER not in a for a in answers)
    proxy.stop()  # the last writes are drained, the WAL is on disk
    dump = redis_dump(redis_url) if store == "redis" else all_bytes_in(confdir)
    if store == "sqlite":
        assert (confdir / "stateful-responses.sqlite3").stat().st_size > 0
    assert MARKER.encode() not in dump
    for text in answers:
        assert text.encode() not in dump
    assert b"sk-sealed" not in dump


def test_a_sealed_turn_moved_under_another_id_or_read_by_another_tenant_fails_closed(emulator, start_proxy,
                                                                                      tmp_path):
    emulator.model.control({"stateless": "reject"})
    path = tmp_path / "state.db"
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", f"stateful_store=sqlite:{path}")
    converse(proxy)
    ids = [r["response_id"] for r in log(emulator) if r["status_code"] == 200]
    last = ids[-1]
    asyncio.run(_plant(path, "sk-sealed", ids[0], "resp_planted"))
    with httpx.Client(trust_env=False, timeout=30) as c:
        moved = c.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-sealed"},
                       json={"model": "gpt-test", "input": "x", "previous_response_id": "resp_planted"})
        assert moved.status_code == 400 and moved.json()["error"]["code"] == "previous_response_not_found"
        other = c.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-other"},
                       json={"model": "gpt-test", "input": "x", "previous_response_id": last})
        assert other.status_code == 400 and other.json()["error"]["code"] == "previous_response_not_found"
        own = c.post(proxy.url + "/v1/responses", headers={"authorization": "Bearer sk-sealed"},
                     json={"model": "gpt-test", "input": "x", "previous_response_id": last})
        assert own.status_code == 200


async def _plant(path, key: str, source: str, target: str) -> None:
    """Copy the sealed record of ``source`` under the key of ``target``, as
    someone holding the file (and its secret) might."""
    from stateful_responses.state.storage.sqlite import SQLiteStorage

    storage = SQLiteStorage(str(path))
    await storage.open()
    try:
        tenant = await tenant_of(storage, key)
        record = (await storage.get(TURNS, [tenant.turn_key(source)]))[tenant.turn_key(source)]
        await storage.put(TURNS, {tenant.turn_key(target): record}, 600)
    finally:
        await storage.close()
