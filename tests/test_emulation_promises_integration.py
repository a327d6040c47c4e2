"""Store emulation's promises, through real mitmdump: an id handed to a client
stays good whatever happens to the proxy after the answer (kill -9, another
replica, the store restarting empty); what a user deleted, or sent with
``store: false``, is gone on every replica and never reaches a model again;
deleting one response never breaks another; the proxy answers only for what
it recorded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import openai
import pytest
import redis
from driver import httpx, without_comparisons
from stateful_responses.request_reader import Request
from stateful_responses.settings import Config
from stateful_responses.state.storage import open_storage
from stateful_responses.state.storage.redis import RedisStorage
from stateful_responses.state.storage.sqlite import SQLiteStorage
from stateful_responses.store_emulation.history import History
from stateful_responses.store_emulation.turns import ITEM_IDS, ITEMS, TURNS, Tenant, header_of
from stateful_responses.tenancy import credential_material

KEY = "sk-test-key"
SECRET_KEY, SECRETS_KEY = b"{stateful-responses}:secret", b"{stateful-responses}:secrets"  # where Redis keeps them


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def post(url: str, body: dict, key: str = KEY, **options) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30, **options) as c:
        return c.post(url + "/v1/responses", json={"model": "gpt-test", **body},
                      headers={"authorization": f"Bearer {key}"})


def call(method: str, url: str, key: str = KEY) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as c:
        return c.request(method, url, headers={"authorization": f"Bearer {key}"})


def credential(key: str = KEY) -> bytes:
    return credential_material(Request("POST", "http://x/v1/responses", {"authorization": f"Bearer {key}"}, b""))


def post_http10(url: str, body: dict) -> dict:
    """POST as an HTTP/1.0 client (no chunked framing): the answer, read to the connection's close."""
    data = json.dumps({"model": "gpt-test", **body}).encode()
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(b"POST /v1/responses HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"200", received
    return json.loads(payload)


def said(record: dict) -> list[str]:
    """The user texts of what the model saw, in order."""
    texts = []
    for item in record.get("context", []):
        if item.get("role") == "user":
            content = item["content"]
            texts.append(content if isinstance(content, str) else content[0]["text"])
    return texts


def chain(url: str, texts: list[str], previous: str | None = None, **body) -> list[dict]:
    answers = []
    for text in texts:
        r = post(url, {"input": text, **({"previous_response_id": previous} if previous else {}), **body})
        assert r.status_code == 200, r.text
        answers.append(r.json())
        previous = answers[-1]["id"]
    return answers


@pytest.mark.parametrize("client", ["json", "sse", "json-http1.0"])
def test_an_answer_the_client_holds_survives_kill_9_at_once(emulator, start_proxy, tmp_path, client):
    emulator.model.control({"stateless": "reject"})
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir)
    stream = client == "sse"
    previous = None
    for attempt in range(5):
        body = {"model": "gpt-test", "input": f"turn {attempt}", "stream": stream}
        if previous:
            body["previous_response_id"] = previous
        if client == "json-http1.0":
            previous = post_http10(proxy.url, body)["id"]
        else:
            with httpx.Client(trust_env=False, timeout=30) as c:
                r = c.post(proxy.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, r.text
            previous = r.json()["id"] if not stream else json.loads(
                [line for line in r.text.splitlines() if '"response.completed"' in line][0][6:])["response"]["id"]
        proxy.kill()  # the client has the whole answer: nothing may be lost now
        proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir, port=proxy.port)
    last = post(proxy.url, {"input": "after five crashes", "previous_response_id": previous})
    assert last.status_code == 200, last.text
    assert said(log(emulator)[-1]) == [f"turn {n}" for n in range(5)] + ["after five crashes"]


def test_an_answer_held_whole_reaches_the_client_only_once_its_turn_is_written(emulator, start_proxy, tmp_path):
    """A checked continuation's answer (the upstream stores, but has not yet
    shown it continues from an id) is held whole and goes to the client after
    the response hooks: its turn must be written by then, as a streamed one's
    is, though it carries a Content-Length. The store's writes are held back
    while the answer is made (another process holds SQLite's write lock): when
    the client has the answer, the turn is in the store all the same."""
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true",
                        confdir=confdir)
    first = post(proxy.url, {"input": "turn 0"})
    assert first.status_code == 200, first.text
    store = sqlite3.connect(os.path.join(confdir, "stateful-responses.sqlite3"), isolation_level=None,
                            check_same_thread=False)

    def turns() -> int:
        return store.execute("SELECT n FROM counts WHERE tbl = ?", (TURNS,)).fetchone()[0]

    try:
        deadline = time.monotonic() + 5
        while turns() < 1 and time.monotonic() < deadline:  # the first turn's proof settles after its answer
            time.sleep(0.02)
        store.execute("BEGIN IMMEDIATE")  # every write of the proxy's waits until the commit
        released = threading.Timer(0.5, store.execute, ("COMMIT",))
        released.start()
        try:
            second = post(proxy.url, {"input": "turn 1", "previous_response_id": first.json()["id"]})
            had_it = turns()
        finally:
            released.join()
    finally:
        store.close()
    assert second.status_code == 200, second.text
    assert "expanded" in proxy.output() and had_it == 2


def recorded_under(url: str, secrets: list[bytes], response_ids: list[str]) -> dict[str, bytes]:
    """Which of ``secrets`` each response's turn is recorded under in the Redis at ``url``."""

    async def read() -> dict[str, bytes]:
        storage = RedisStorage(url)
        await storage.open()
        try:
            found = {}
            for secret in secrets:
                keys = {Tenant.of(secret, credential()).turn_key(i): i for i in response_ids}
                found.update((keys[k], secret) for k in await storage.get(TURNS, list(keys)))
            return found
        finally:
            await storage.close()

    return asyncio.run(read())


def one_secret_everywhere(url: str, replicas: list, timeout: float = 30) -> list[str]:
    """Until every replica records under the store's secret; the turns made
    meanwhile that the store holds (under any secret it has used)."""
    raw = redis.Redis.from_url(url)
    made: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        ids = [r.json()["id"] for r in (post(p.url, {"input": f"meanwhile {len(made)}"}) for p in replicas)]
        secret = raw.get(SECRET_KEY)
        under = recorded_under(url, sorted(raw.smembers(SECRETS_KEY)), made + ids)
        made = [i for i in made + ids if i in under]
        if secret is not None and all(under.get(i) == secret for i in ids):
            return made
        assert time.monotonic() < deadline, "the replicas never came to share the store's secret"
        time.sleep(0.5)


def test_replicas_keep_one_secret_when_redis_restarts_empty(emulator, start_proxy, redis_server):
    emulator.model.control({"stateless": "reject"})
    store = ("--set", f"stateful_store={redis_server.url}", "--set", "stateful_emulate=always")
    a, b = start_proxy(emulator.url, *store), start_proxy(emulator.url, *store)
    [lost] = chain(a.url, ["before the restart"])
    redis_server.stop()
    redis_server.start()  # on the same port, without persistence: it comes back empty
    c = start_proxy(emulator.url, *store)  # a replica that starts while the store is empty
    made = one_secret_everywhere(redis_server.url, [a, b, c])
    made += [r.json()["id"] for r in (post(p.url, {"input": "after"}) for p in (a, b, c))]
    for proxy in (a, b, c):
        for previous in made:
            r = post(proxy.url, {"input": "go on", "previous_response_id": previous})
            assert r.status_code == 200, (proxy.url, previous, r.text)
    gone = post(c.url, {"input": "go on", "previous_response_id": lost})  # what the store itself lost
    assert gone.status_code == 400 and "previous_response_id" in gone.text  # refused, never answered without it


def test_records_sealed_under_a_secret_the_store_lost_stay_readable_on_every_replica(emulator, start_proxy,
                                                                                     redis_server):
    emulator.model.control({"stateless": "reject"})
    store = ("--set", f"stateful_store={redis_server.url}", "--set", "stateful_emulate=always")
    a, b = start_proxy(emulator.url, *store), start_proxy(emulator.url, *store)
    before = chain(a.url, ["sealed under the first secret", "and continued"])
    raw = redis.Redis.from_url(redis_server.url)
    first_secret = raw.get(SECRET_KEY)
    for proxy in (a, b):
        os.kill(proxy.process.pid, signal.SIGSTOP)  # neither can give its secret back meanwhile
    try:
        raw.delete(SECRET_KEY, SECRETS_KEY)  # evicted (an allkeys-* policy): the records stay
        c = start_proxy(emulator.url, *store)
        deadline = time.monotonic() + 10
        while raw.get(SECRET_KEY) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proxy in (a, b):
            os.kill(proxy.process.pid, signal.SIGCONT)
    assert raw.get(SECRET_KEY) not in (None, first_secret)  # c made another one
    one_secret_everywhere(redis_server.url, [a, b, c])
    assert first_secret in raw.smembers(SECRETS_KEY)  # given back by a and b, among the older ones
    for proxy in (a, b, c):
        r = post(proxy.url, {"input": "still there?", "previous_response_id": before[-1]["id"]})
        assert r.status_code == 200, (proxy.url, r.text)
        assert said(log(emulator)[-1]) == ["sealed under the first secret", "and continued", "still there?"]
    assert "has another secret than this proxy had" in a.output()


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_delete_on_one_replica_holds_on_the_other_at_once(emulator, start_proxy, tmp_path, request, store):
    emulator.model.control({"stateless": "reject"})
    spec = request.getfixturevalue("redis_server").url if store == "redis" else f"sqlite:{tmp_path / 'shared.db'}"
    a, b = (start_proxy(emulator.url, "--set", f"stateful_store={spec}", "--set", "stateful_emulate=always")
            for _ in range(2))
    first, second = chain(a.url, ["keep this", "delete this secret text"])
    assert call("GET", f"{a.url}/v1/responses/{second['id']}").status_code == 200  # in a's memory now
    deleted = call("DELETE", f"{b.url}/v1/responses/{second['id']}")
    assert deleted.json() == {"id": second["id"], "object": "response", "deleted": True}
    assert call("GET", f"{a.url}/v1/responses/{second['id']}").status_code == 404
    refused = post(a.url, {"input": "go on", "previous_response_id": second["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_response_not_found"
    assert all("delete this secret text" not in said(r) for r in log(emulator)[2:])
    assert post(a.url, {"input": "from the first", "previous_response_id": first["id"]}).status_code == 200


def test_deleting_a_full_history_clients_turn_keeps_the_turns_that_extend_it(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    history: list = []
    answers = []
    for text in ("one", "two", "three"):
        history.append({"role": "user", "content": text})
        answers.append(post(proxy.url, {"input": history}).json())
        history += answers[-1]["output"]
    f1, f2, _ = answers
    assert call("DELETE", f"{proxy.url}/v1/responses/{f1['id']}").status_code == 200
    listed = call("GET", f"{proxy.url}/v1/responses/{f2['id']}/input_items?order=asc")
    assert listed.status_code == 200
    assert [i["content"][0]["text"] for i in listed.json()["data"] if i.get("role") == "user"] == ["one", "two"]
    got = call("GET", f"{proxy.url}/v1/responses/{f2['id']}").json()
    assert got["id"] == f2["id"] and got["previous_response_id"] is None
    go_on = post(proxy.url, {"input": "four", "previous_response_id": f2["id"]})
    assert go_on.status_code == 200 and said(log(emulator)[-1]) == ["one", "two", "four"]


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_store_false_turn_is_never_recorded(emulator, start_proxy, mode):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_force_store=false")
    secret = post(proxy.url, {"input": "do not keep this", "store": False}).json()
    refused = post(proxy.url, {"input": "go on", "previous_response_id": secret["id"]})
    assert refused.status_code == 400 and "previous_response" in refused.text
    assert call("GET", f"{proxy.url}/v1/responses/{secret['id']}").status_code == 404
    assert all("do not keep this" not in said(r) for r in log(emulator)[1:])
    kept = post(proxy.url, {"input": "keep this"}).json()  # the client's choice, per request
    assert post(proxy.url, {"input": "go on", "previous_response_id": kept["id"]}).status_code == 200


def test_always_mode_answers_only_for_what_it_recorded(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    made_elsewhere = post(emulator.url, {"input": "made without the proxy"}).json()  # the upstream stores it
    got = call("GET", f"{proxy.url}/v1/responses/{made_elsewhere['id']}")
    assert got.status_code == 200 and got.json()["id"] == made_elsewhere["id"]
    assert call("DELETE", f"{proxy.url}/v1/responses/{made_elsewhere['id']}").status_code == 200
    assert call("GET", f"{emulator.url}/v1/responses/{made_elsewhere['id']}").status_code == 404  # really deleted
    # a turn the proxy recorded and the upstream stored too: a DELETE removes both
    ours = post(proxy.url, {"input": "made through the proxy"}).json()
    assert call("GET", f"{emulator.url}/v1/responses/{ours['id']}").status_code == 200
    assert call("DELETE", f"{proxy.url}/v1/responses/{ours['id']}").json()["deleted"] is True
    assert call("GET", f"{emulator.url}/v1/responses/{ours['id']}").status_code == 404
    assert call("GET", f"{proxy.url}/v1/responses/{ours['id']}").status_code == 404


@pytest.mark.parametrize("store", ["sqlite", "redis"], ids=["writes-locked", "unreachable"])
def test_a_delete_the_store_did_not_take_is_never_answered_as_done(emulator, start_proxy, tmp_path, request, store):
    if store == "redis":
        server = request.getfixturevalue("redis_server")
        spec = server.url
    else:
        path = tmp_path / "state.db"
        spec = f"sqlite:{path}"
    proxy = start_proxy(emulator.url, "--set", f"stateful_store={spec}", "--set", "stateful_emulate=always")
    [turn] = chain(proxy.url, ["a text the user deletes"])
    url = f"{proxy.url}/v1/responses/{turn['id']}"
    if store == "redis":
        server.pause()  # the proxy cannot even read it
        try:
            refused = call("DELETE", url)
        finally:
            server.resume()
    else:
        lock = sqlite3.connect(path, timeout=10, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # reads go on, the deletion cannot be written
        try:
            refused = call("DELETE", url)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error", refused.text
    assert call("GET", f"{emulator.url}/v1/responses/{turn['id']}").status_code == 404  # the upstream's copy went
    deadline = time.monotonic() + 15
    if store == "redis":  # the record could not be read: nothing was deleted, the client's retry deletes it
        while (kept := call("GET", url)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)  # until the store is back: then the record answers
        assert kept.status_code == 200 and kept.json()["id"] == turn["id"]  # not deleted, as the client was told
        while (deleted := call("DELETE", url)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)  # the SDK's retries: the upstream has forgotten it, the record answers
        assert deleted.json() == {"id": turn["id"], "object": "response", "deleted": True}
    else:  # the deletion waits for the store with every write it failed, and is written once it is back
        while call("GET", url).status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert call("GET", url).status_code == 404
    again = post(proxy.url, {"input": "go on", "previous_response_id": turn["id"]})
    assert again.status_code == 400 and again.json()["error"]["code"] == "previous_response_not_found"



@pytest.mark.parametrize("store", ["sqlite", "redis"], ids=["writes-locked", "writes-paused"])
def test_the_sdks_retry_of_a_delete_the_store_took_late_is_answered_as_done_on_every_replica(
        emulator, start_proxy, tmp_path, request, store):
    """The proxy's 503 for a deletion the store did not take in time is
    retried by the SDK; once the deletion lands (it waited with every failed
    write), that retry, and a DELETE through another replica, are answered
    "deleted", never the 404 of a response already gone."""
    emulator.model.control({"stateless": "reject"})
    if store == "redis":
        server = request.getfixturevalue("redis_server")
        spec, admin = server.url, redis.Redis.from_url(server.url)

        def refuse_writes() -> None:
            admin.client_pause(60_000, all=False)  # writes wait (and time out), reads go on

        def allow_writes() -> None:
            admin.client_unpause()
    else:
        path = tmp_path / "state.db"
        spec, lock = f"sqlite:{path}", sqlite3.connect(path, timeout=10, isolation_level=None)

        def refuse_writes() -> None:
            lock.execute("BEGIN EXCLUSIVE")  # reads go on, writes wait and fail

        def allow_writes() -> None:
            if lock.in_transaction:
                lock.execute("ROLLBACK")
    a, b = (start_proxy(emulator.url, "--set", f"stateful_store={spec}", "--set", "stateful_emulate=always")
            for _ in range(2))
    first, second = chain(a.url, ["keep this", "a text the user deletes"])
    assert post(b.url, {"input": "through b", "previous_response_id": first["id"]}).status_code == 200  # b reads it
    answers: list[tuple[int, dict]] = []

    def answered(response: httpx.Response) -> None:
        response.read()
        answers.append((response.status_code, response.json()))
        if response.status_code == 503:
            allow_writes()  # the store is back before the SDK tries again

    refuse_writes()
    try:
        with httpx.Client(trust_env=False, timeout=60, event_hooks={"response": [answered]}) as http:
            sdk = openai.OpenAI(base_url=f"{a.url}/v1", api_key=KEY, http_client=http, max_retries=2)
            assert sdk.responses.delete(second["id"]) is None  # the SDK raised nothing
    finally:
        allow_writes()
    assert [status for status, _ in answers] == [503, 200], answers
    assert answers[0][1]["error"]["type"] == "server_error"
    assert answers[1][1] == {"id": second["id"], "object": "response", "deleted": True}
    for proxy in (a, b):
        deleted = call("DELETE", f"{proxy.url}/v1/responses/{second['id']}")  # another retry, on either replica
        assert deleted.status_code == 200, ("ab"[proxy is b], deleted.text)
        assert deleted.json() == {"id": second["id"], "object": "response", "deleted": True}
        assert call("GET", f"{proxy.url}/v1/responses/{second['id']}").status_code == 404
        refused = post(proxy.url, {"input": "go on", "previous_response_id": second["id"]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_response_not_found"
        assert post(proxy.url, {"input": "from the first", "previous_response_id": first["id"]}).status_code == 200
    assert all("a text the user deletes" not in said(r) for r in log(emulator)[2:])


def test_auto_mode_deletes_the_record_whatever_the_upstream_answers(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    first, second = chain(proxy.url, ["keep this", "a text the upstream forgot"])
    emulator.model.control({"forget": [second["id"]]})  # expired there
    deleted = call("DELETE", f"{proxy.url}/v1/responses/{second['id']}")
    assert deleted.json() == {"id": second["id"], "object": "response", "deleted": True}  # the record's copy went
    refused = post(proxy.url, {"input": "go on", "previous_response_id": second["id"]})
    assert refused.status_code == 400 and "previous_response" in refused.text  # nothing to bring it back from
    assert all("a text the upstream forgot" not in said(r) for r in log(emulator)[2:])
    go_on = post(proxy.url, {"input": "from the first", "previous_response_id": first["id"]})
    assert go_on.status_code == 200 and said(log(emulator)[-1]) == ["keep this", "from the first"]


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_delete_reaches_an_upstream_that_stores_without_saying_so(emulator, start_proxy, mode):
    emulator.model.control({"echo_store": False})  # it stores, and its answers omit `store`
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}")
    [turn] = chain(proxy.url, ["kept upstream silently"])
    assert "store" not in turn and call("GET", f"{emulator.url}/v1/responses/{turn['id']}").status_code == 200
    deleted = call("DELETE", f"{proxy.url}/v1/responses/{turn['id']}")
    assert deleted.json() == {"id": turn["id"], "object": "response", "deleted": True}
    assert call("GET", f"{emulator.url}/v1/responses/{turn['id']}").status_code == 404  # gone there too
    assert call("GET", f"{proxy.url}/v1/responses/{turn['id']}").status_code == 404


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_deleted_turn_leaves_no_sealed_item_of_its_own_in_the_store(emulator, start_proxy, tmp_path, request,
                                                                      store):
    emulator.model.control({"stateless": "reject"})
    spec = request.getfixturevalue("redis_server").url if store == "redis" else f"sqlite:{tmp_path / 'state.db'}"
    proxy = start_proxy(emulator.url, "--set", f"stateful_store={spec}", "--set", "stateful_emulate=always")
    [first] = chain(proxy.url, ["keep this"])
    own = {"type": "message", "id": "msg_client_deleted", "role": "user",
           "content": [{"type": "input_text", "text": "delete this secret text"}]}
    second = post(proxy.url, {"input": [own], "previous_response_id": first["id"]}).json()
    answer_text = second["output"][0]["content"][0]["text"]
    assert call("DELETE", f"{proxy.url}/v1/responses/{second['id']}").json()["deleted"] is True
    proxy.stop()  # the last writes are drained

    async def read() -> tuple[Tenant, dict[str, dict[bytes, bytes]]]:
        storage = open_storage(spec, str(tmp_path), {})
        await storage.open()
        try:
            secret, _ = await storage.keyring()
            return Tenant.of(secret, credential()), {t: await storage.scan(t) for t in (TURNS, ITEMS, ITEM_IDS)}
        finally:
            await storage.close()

    tenant, tables = asyncio.run(read())
    opened = [tenant.open(sealed, key) for key, sealed in tables[ITEMS].items()]
    assert None not in opened and any(b"keep this" in raw for raw in opened)  # the living turn's items stay
    assert not any(b"delete this secret text" in raw or answer_text.encode() in raw for raw in opened)
    gone = tenant.turn_key(second["id"])
    assert gone not in tables[TURNS] and tenant.turn_key(first["id"]) in tables[TURNS]
    assert not any(where.startswith(gone) for where in tables[ITEM_IDS].values())
    assert tenant.item_id_key("msg_client_deleted") not in tables[ITEM_IDS]


def test_always_mode_retrieves_a_chained_turn_naming_its_parent(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    first, second = chain(proxy.url, ["one", "two"])
    assert second["previous_response_id"] is None  # the live answer: the upstream's own, to full history
    got = call("GET", f"{proxy.url}/v1/responses/{second['id']}")
    assert got.status_code == 200
    assert got.json()["previous_response_id"] == first["id"] and got.json()["output"] == second["output"]
    assert call("GET", f"{proxy.url}/v1/responses/{first['id']}").json()["previous_response_id"] is None


def test_always_mode_expands_references_to_input_items_the_client_named(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})  # stores nothing: a reference is 404 there
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    own = {"type": "message", "id": "msg_client_0001", "role": "user",
           "content": [{"type": "input_text", "text": "the client's own item"}]}
    assert post(proxy.url, {"input": [own]}).status_code == 200
    reference = {"type": "item_reference", "id": own["id"]}
    r = post(proxy.url, {"input": [reference, {"role": "user", "content": "and now?"}]})
    assert r.status_code == 200, r.text
    assert log(emulator)[-1]["context"][0] == own
    chained = post(proxy.url, {"input": [reference], "previous_response_id": r.json()["id"]})
    assert chained.status_code == 200 and log(emulator)[-1]["context"][-1] == own
    other = post(proxy.url, {"input": [reference]}, key="sk-another-tenant")  # never across tenants
    assert other.status_code == 404 and own["id"] in other.text


def test_always_mode_expands_references_to_recorded_items(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})  # stores nothing: a reference is 404 there
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    first = post(proxy.url, {"input": [{"role": "user", "content": "hello"}]}).json()
    [message] = first["output"]
    by_reference = [{"role": "user", "content": "hello"}, {"type": "item_reference", "id": message["id"]},
                    {"role": "user", "content": "and now?"}]
    r = post(proxy.url, {"input": by_reference})
    assert r.status_code == 200, r.text
    assert log(emulator)[-1]["context"][1]["content"] == message["content"]
    chained = post(proxy.url, {"input": [{"type": "item_reference", "id": message["id"]}],
                               "previous_response_id": r.json()["id"]})
    assert chained.status_code == 200 and log(emulator)[-1]["context"][-1]["content"] == message["content"]


def test_reasoning_named_by_id_is_dropped_from_an_expansion_and_encrypted_reasoning_travels(emulator, start_proxy,
                                                                                              tmp_path):
    emulator.model.control({"stateless": "reject"})
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always",
                        "--set", f"stateful_record_file={record_file}")
    by_id = chain(proxy.url, ["think", "again"], reasoning={"summary": "auto"})
    assert by_id[0]["output"][0]["type"] == "reasoning"
    assert all(i.get("type") != "reasoning" for i in log(emulator)[-1]["context"])  # dropped, not refused
    encrypted = chain(proxy.url, ["think", "again"], reasoning={}, include=["reasoning.encrypted_content"])
    assert encrypted[-1]["status"] == "completed"
    assert any(i.get("type") == "reasoning" and i.get("encrypted_content") for i in log(emulator)[-1]["context"])
    deadline = time.monotonic() + 10
    while len(lines := record_file.read_text().splitlines() if record_file.exists() else []) < 4:
        assert time.monotonic() < deadline, "the record file has not got a line per turn"
        time.sleep(0.05)
    dropped = [[e for e in json.loads(line)["audit"]["protocolMapping"].get("dropped", []) if e["field"] == "reasoning"]
               for line in lines]
    assert [len(d) for d in dropped] == [0, 1, 0, 0]  # the expansion that dropped one, and only it
    assert dropped[1][0]["source"] == "proxy" and dropped[1][0]["reason"].startswith("1 recorded reasoning items")


def read_turn(confdir: Path, key: str, response_id: str, seal_key: bytes) -> object:
    """The turn as the store alone opens it, with ``seal_key`` (None: it does not open)."""

    async def read() -> object:
        storage = SQLiteStorage(str(confdir / "stateful-responses.sqlite3"))
        await storage.open()
        try:
            secret, _ = await storage.keyring()
            return await History(Config()).turn(Tenant.of(secret, credential(key), seal_key=seal_key), response_id,
                                                storage.get)
        finally:
            await storage.close()

    return asyncio.run(read())


def test_a_seal_key_outside_the_store_protects_tenants_without_a_credential(emulator, start_proxy, tmp_path):
    key_file = tmp_path / "seal.key"
    key_file.write_bytes(b"k" * 32)
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", f"stateful_seal_key_file={key_file}",
                        confdir=str(confdir))
    placeholder = "ollama"  # the key local servers' docs show: everyone knows it
    [answer] = chain_with_key(proxy.url, placeholder, ["a secret of the keyless tenant"])
    assert "not protected at rest" not in proxy.stop()

    assert read_turn(confdir, placeholder, answer["id"], b"") is None  # the store and the key alone open nothing
    assert read_turn(confdir, placeholder, answer["id"], b"k" * 32) is not None
    unprotected = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    deadline = time.monotonic() + 10  # the log may come a moment after the proxy listens
    while "not protected at rest" not in unprotected.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "not protected at rest" in unprotected.output()


def test_a_seal_key_from_the_environment_protects_tenants_without_a_credential(emulator, start_proxy, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("STATEFUL_RESPONSES_SEAL_KEY", "e" * 32)  # mitmdump inherits it
    confdir = tmp_path / "confdir"
    confdir.mkdir()
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=str(confdir))
    [answer] = chain_with_key(proxy.url, "EMPTY", ["a secret of the keyless tenant"])
    assert "not protected at rest" not in proxy.stop()

    assert read_turn(confdir, "EMPTY", answer["id"], b"") is None  # the store and the placeholder alone open nothing
    assert read_turn(confdir, "EMPTY", answer["id"], b"e" * 32) is not None


def test_a_seal_key_too_short_to_protect_anything_stops_mitmdump(emulator, tmp_path):
    from harness import Proxy, free_port, mitmdump_args

    key_file = tmp_path / "seal.key"
    key_file.write_bytes(b"short")
    port = free_port()
    proxy = Proxy(mitmdump_args(f"reverse:{emulator.url}", port, str(tmp_path), "--set", "stateful_emulate=always",
                                "--set", f"stateful_seal_key_file={key_file}"), port, str(tmp_path))
    assert proxy.process.wait(30) != 0
    assert "stateful_seal_key_file" in proxy.stop()


def chain_with_key(url: str, key: str, texts: list[str]) -> list[dict]:
    answers, previous = [], None
    for text in texts:
        r = post(url, {"input": text, **({"previous_response_id": previous} if previous else {})}, key=key)
        assert r.status_code == 200, r.text
        answers.append(r.json())
        previous = answers[-1]["id"]
    return answers


def test_every_record_of_a_conversation_is_sealed_under_the_secret_the_store_holds(emulator, start_proxy, tmp_path):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=str(tmp_path))
    chain(proxy.url, ["one", "two"])
    proxy.stop()
    db = sqlite3.connect(Path(tmp_path) / "stateful-responses.sqlite3")
    headers = [header_of(value) for (value,) in db.execute("SELECT value FROM records WHERE tbl = ?", (TURNS,))]
    assert len(headers) == 2 and all(h.status == "completed" for h in headers)


def test_a_chain_is_read_from_a_slow_store_that_a_shorter_read_took_for_down(emulator, start_proxy, redis_server):
    """A loaded machine: the store answers late. Forward mode gives a read up
    after 250 ms, plans from memory and takes the store for down; a chain
    store emulation must read is asked for all the same, and waited for, so
    the id another replica handed out still continues."""
    import threading

    emulator.model.control({"stateless": "reject"})
    store = ("--set", f"stateful_store={redis_server.url}", "--set", "stateful_emulate=always")
    here, there = start_proxy(emulator.url, *store), start_proxy(emulator.url, *store)
    [turn] = chain(there.url, ["made through the other replica"])
    full = [{"role": "user", "content": "a full-history client"}]
    opened = post(there.url, {"input": full})
    assert opened.status_code == 200
    full += opened.json()["output"] + [{"role": "user", "content": "its next turn"}]
    redis_server.pause()
    resume = threading.Timer(1.0, redis_server.resume)
    resume.start()
    try:
        assert post(here.url, {"input": full}).status_code == 200  # its prefix read gave up: the store is down
        went_on = post(here.url, {"input": "go on", "previous_response_id": turn["id"]})
    finally:
        resume.join()
    assert went_on.status_code == 200, went_on.text
    assert said(log(emulator)[-1]) == ["made through the other replica", "go on"]
    assert "unavailable" in here.output()


def test_a_full_history_turn_never_extends_a_turn_deleted_through_another_replica(emulator, start_proxy, tmp_path):
    """A full-history turn stores only what it adds to the turn whose input
    its own extends; one replica's memory may still name a turn another
    replica deleted since. The new turn then keeps its whole input itself:
    its id works from birth, on every replica."""
    emulator.model.control({"stateless": "reject"})
    spec = f"sqlite:{tmp_path / 'shared.db'}"
    a, b = (start_proxy(emulator.url, "--set", f"stateful_store={spec}", "--set", "stateful_emulate=always")
            for _ in range(2))
    history: list = [{"role": "user", "content": "one"}]
    f1 = post(b.url, {"input": history}).json()
    history += f1["output"]
    assert call("DELETE", f"{a.url}/v1/responses/{f1['id']}").json()["deleted"] is True
    history.append({"role": "user", "content": "two"})
    f2 = post(b.url, {"input": history}).json()  # b's memory: it extends f1's input
    for proxy in (a, b):
        listed = call("GET", f"{proxy.url}/v1/responses/{f2['id']}/input_items?order=asc")
        assert listed.status_code == 200, listed.text
        assert [i["content"][0]["text"] for i in listed.json()["data"] if i.get("role") == "user"] == ["one", "two"]
        go_on = post(proxy.url, {"input": "three", "previous_response_id": f2["id"]})
        assert go_on.status_code == 200, go_on.text
        assert said(log(emulator)[-1]) == ["one", "two", "three"]
    assert call("GET", f"{a.url}/v1/responses/{f1['id']}").status_code == 404  # the deleted one stays deleted


def test_a_conversation_continued_while_its_last_append_waits_for_the_store_keeps_that_turn(
        emulator, start_proxy, tmp_path):
    """A turn joins its conversation before its answer's end, a second at
    most: past that the append waits for the store. The conversation's next
    turn on the same proxy, while the store still takes nothing, is sent with
    every item its client was answered with, the waiting append's included;
    once the store is back each item is there once."""
    emulator.model.control({"stateless": "reject"})
    path = tmp_path / "state.db"
    proxy = start_proxy(emulator.url, "--set", f"stateful_store=sqlite:{path}", "--set", "stateful_emulate=always")
    with httpx.Client(trust_env=False, timeout=30) as c:
        made = c.post(f"{proxy.url}/v1/conversations", json={}, headers={"authorization": f"Bearer {KEY}"})
    assert made.status_code == 200, made.text
    conversation = made.json()["id"]
    assert post(proxy.url, {"input": "the first turn", "conversation": conversation}).status_code == 200
    lock = sqlite3.connect(path, timeout=10, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # reads go on, writes wait and fail
    try:
        assert post(proxy.url, {"input": "the second turn", "conversation": conversation}).status_code == 200
        third = post(proxy.url, {"input": "the third turn", "conversation": conversation})
        assert third.status_code == 200, third.text
        assert said(log(emulator)[-1]) == ["the first turn", "the second turn", "the third turn"]
    finally:
        lock.execute("ROLLBACK")
        lock.close()

    def listed() -> list[str]:
        items = call("GET", f"{proxy.url}/v1/conversations/{conversation}/items?order=asc").json()["data"]
        return [i["content"][0]["text"] for i in items if i.get("role") == "user"]
    deadline = time.monotonic() + 30
    while listed() != ["the first turn", "the second turn", "the third turn"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert listed() == ["the first turn", "the second turn", "the third turn"]
    fourth = post(proxy.url, {"input": "the fourth turn", "conversation": conversation})
    assert fourth.status_code == 200, fourth.text
    assert said(log(emulator)[-1]) == ["the first turn", "the second turn", "the third turn", "the fourth turn"]
