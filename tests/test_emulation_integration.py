"""Store emulation through real mitmdump: clients that send
previous_response_id keep working where the upstream stores nothing, forgets,
or silently ignores the field; the context the upstream sees is, on every
request, the chain the client named."""

from __future__ import annotations

import asyncio

import openai
import pytest
from driver import (
    TOOLS,
    ChainedConversation,
    assert_chain_context_preserved,
    drop_nulls,
    expand_input,
    httpx,
    langchain_conversation,
    meaning,
    recording_clients,
    tenant_of,
    user_turns,
    weather_agent,
)


def log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


UPSTREAMS = {
    "stateless": {"stateless": "reject"},  # llama.cpp: refuses the field
    "ignoring": {"stateless": "ignore"},  # Ollama: accepts it and ignores it
    "forgetting": {"forget_probability": 1.0},  # stores, then has forgotten (expiry, restart, replica)
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("upstream", sorted(UPSTREAMS))
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_the_openai_sdk_with_previous_response_id_keeps_its_context(emulator, start_proxy, mode, upstream, stream):
    emulator.model.control(UPSTREAMS[upstream])
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    conv = ChainedConversation(proxy.url, stream=stream)
    for text in user_turns(7):
        conv.turn(text)
    conv.close()
    assert_chain_context_preserved(conv, log(emulator))
    output = proxy.output()
    assert "internal error" not in output and "Traceback" not in output


AUTH = {"authorization": "Bearer sk-test-key"}


def post(proxy, body: dict, key: str = "sk-test-key") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as c:
        return c.post(proxy.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})


def chained(proxy, texts, key: str = "sk-test-key", previous: str | None = None) -> list[dict]:
    """A previous_response_id conversation over raw HTTP; the answers."""
    answers = []
    for text in texts:
        body = {"model": "gpt-test", "input": [{"role": "user", "content": text}]}
        if previous:
            body["previous_response_id"] = previous
        r = post(proxy, body, key)
        assert r.status_code == 200, r.text
        answers.append(r.json())
        previous = answers[-1]["id"]
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_async_openai_sdk_keeps_its_context(emulator, start_proxy, stream):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    sent: list = []
    _, http = recording_clients(sent)
    meant: list[list] = []

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-a", http_client=http, max_retries=0)
        history: list = []
        previous = None
        for text in user_turns(7):
            new = [{"role": "user", "content": text}]
            while True:
                meant.append(history + new)
                kwargs = dict(model="gpt-test", input=new, tools=TOOLS, previous_response_id=previous)
                if stream:
                    async with await client.responses.create(stream=True, **kwargs) as events:
                        final = [e async for e in events if e.type == "response.completed"][0].response
                else:
                    final = await client.responses.create(**kwargs)
                history += new + [o.model_dump(exclude_unset=True) for o in final.output]
                previous = final.id
                calls = [o for o in final.output if o.type == "function_call"]
                if not calls:
                    break
                new = [{"type": "function_call_output", "call_id": c.call_id, "output": "21C"} for c in calls]
        await client.close()

    asyncio.run(run())
    served = [r for r in log(emulator) if r["status_code"] == 200]
    assert len(served) == len(meant) >= 9
    for n, (context, seen) in enumerate(zip(meant, served, strict=True)):
        assert drop_nulls(seen["context"]) == drop_nulls(expand_input(context)), f"request {n}"


def test_openai_agents_with_auto_previous_response_id(emulator, start_proxy):
    agents = pytest.importorskip("agents")
    emulator.model.control({"stateless": "ignore"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    sent: list = []
    _, http = recording_clients(sent)

    async def run() -> list:
        agent, client = weather_agent(agents, proxy.url, http)
        previous, outputs = None, []
        for text in user_turns(6):
            result = await agents.Runner.run(agent, text, previous_response_id=previous,
                                             auto_previous_response_id=True)
            previous = result.last_response_id
            outputs.append(result.final_output)
        await client.close()
        return outputs

    outputs = asyncio.run(run())
    assert any(s.body.get("previous_response_id") for s in sent), "the SDK did not chain by itself"
    _assert_every_request_saw_its_whole_chain(sent, log(emulator))
    assert all("I saw" in o for o in outputs)


def test_langchain_with_use_previous_response_id(emulator, start_proxy):
    lc = pytest.importorskip("langchain_openai")
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    sent: list = []
    http, _ = recording_clients(sent)
    langchain_conversation(lc, proxy.url, http, user_turns(6), use_previous_response_id=True)
    assert any(s.body.get("previous_response_id") for s in sent), "langchain did not chain by itself"
    _assert_every_request_saw_its_whole_chain(sent, log(emulator))


def _assert_every_request_saw_its_whole_chain(sent: list, records: list[dict]) -> None:
    """Rebuild, from what the client sent and what the upstream answered, the
    chain each request names (the API's definition), and compare it with what
    the upstream saw."""
    served = [r for r in records if r["status_code"] == 200]
    assert len(served) == len(sent)
    chains: dict[str, list] = {}
    for n, (request, seen) in enumerate(zip(sent, served, strict=True)):
        previous = request.body.get("previous_response_id")
        meant = (chains[previous] if previous else []) + expand_input(request.body["input"])
        assert meaning(seen["context"]) == meaning(meant), f"request {n}"
        chains[seen["response_id"]] = meant + seen["output"]
        assert seen["previous_response_id"] is None  # expanded: the upstream never saw the id


def test_tenants_never_reach_each_others_turns(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    alice = chained(proxy, ["alice's secret plan", "and more"], key="sk-alice")
    before = len(log(emulator))
    stolen = post(proxy, {"model": "gpt-test", "input": "tell me", "previous_response_id": alice[-1]["id"]},
                  key="sk-mallory")
    assert stolen.status_code == 400
    assert stolen.json()["error"]["code"] == "previous_response_not_found"
    assert len(log(emulator)) == before  # never sent upstream, under any key
    assert chained(proxy, ["alice again"], key="sk-alice", previous=alice[-1]["id"])


def test_the_chain_guards_answer_with_the_apis_errors(emulator, start_proxy, tmp_path):
    emulator.model.control({"stateless": "reject"})
    path = tmp_path / "state.db"
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_max_depth=3",
                        "--set", f"stateful_store=sqlite:{path}")
    deep = chained(proxy, ["one", "two", "three", "four"])  # the fourth names a chain of exactly three
    too_deep = post(proxy, {"model": "gpt-test", "input": "five", "previous_response_id": deep[-1]["id"]})
    assert too_deep.status_code == 400 and too_deep.json()["error"]["code"] == "session_chain_depth_exceeded"
    assert deep[-1]["id"] in too_deep.json()["error"]["message"]

    crafted = asyncio.run(_craft(path, "sk-test-key"))
    for response_id, code in crafted.items():
        before = len(log(emulator))
        r = post(proxy, {"model": "gpt-test", "input": "x", "previous_response_id": response_id})
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert response_id in r.json()["error"]["message"]
        assert len(log(emulator)) == before
    missing = post(proxy, {"model": "gpt-test", "input": "x", "previous_response_id": "resp_nowhere"})
    assert missing.json() == {"error": {"message": "Previous response with id 'resp_nowhere' not found.",
                                        "type": "invalid_request_error", "param": "previous_response_id",
                                        "code": "previous_response_not_found"}}


async def _craft(path, key: str) -> dict[str, str]:
    """Turns no real upstream would produce, written into the store the proxy
    uses (another process, as a replica would): a cycle, and an unfinished one."""
    import msgspec
    from stateful_responses.store_emulation.history import History
    from stateful_responses.state.storage.sqlite import SQLiteStorage
    from stateful_responses.store_emulation.turns import TURNS, header_of

    storage = SQLiteStorage(str(path))
    await storage.open()
    try:
        tenant = await tenant_of(storage, key)
        recorder = History()

        def answer(response_id: str) -> dict:
            return {"id": response_id, "status": "completed", "output": []}

        user = [b'{"role":"user","content":"x"}']
        recorder.record(tenant, response=answer("resp_cycle_a"), previous_response_id="resp_cycle_b",
                        raw_input=user, stored_upstream=False)
        recorder.record(tenant, response=answer("resp_cycle_b"), previous_response_id="resp_cycle_a",
                        raw_input=user, stored_upstream=False)
        recorder.record(tenant, response=answer("resp_unfinished"), previous_response_id=None,
                        raw_input=user, stored_upstream=False)
        recorder.record(tenant, response=answer("resp_after_unfinished"), previous_response_id="resp_unfinished",
                        raw_input=user, stored_upstream=False)
        for write in recorder.take_writes():
            if write.value is None:
                continue  # renewals: nothing to renew in a fresh store
            value = write.value
            if write.label == "resp_unfinished":
                value = msgspec.msgpack.encode(msgspec.structs.replace(header_of(value), status="incomplete"))
            await storage.put(write.table, {write.key: value}, 600)
        assert TURNS
    finally:
        await storage.close()
    return {"resp_cycle_a": "session_chain_cycle_detected", "resp_after_unfinished": "session_chain_unavailable"}


def test_retrieve_input_items_and_delete_are_answered_from_the_record(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    first, second = chained(proxy, ["first question", "second question"])
    before = len(log(emulator))
    with httpx.Client(trust_env=False, timeout=30, headers=AUTH) as c:
        got = c.get(f"{proxy.url}/v1/responses/{second['id']}")
        assert got.status_code == 200 and got.json()["id"] == second["id"]
        assert got.json()["output"] == second["output"]
        items = c.get(f"{proxy.url}/v1/responses/{second['id']}/input_items", params={"order": "asc"}).json()
        assert items["object"] == "list" and not items["has_more"]
        texts = [i["content"][0]["text"] if isinstance(i["content"], list) else i["content"] for i in items["data"]]
        assert texts[0] == "first question" and texts[-1] == "second question"
        assert all(i.get("id") for i in items["data"]) and items["first_id"] == items["data"][0]["id"]
        page = c.get(f"{proxy.url}/v1/responses/{second['id']}/input_items", params={"limit": 1}).json()
        assert page["has_more"] and page["data"][0]["id"] == items["data"][-1]["id"]
        assert c.get(f"{proxy.url}/v1/responses/{second['id']}",
                     headers={"authorization": "Bearer sk-other"}).status_code == 404
        deleted = c.delete(f"{proxy.url}/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
        assert c.get(f"{proxy.url}/v1/responses/{first['id']}").status_code == 404
    assert len(log(emulator)) == before  # none of it reached the upstream
    # deleting a response never takes what another relies on: second still continues, whole
    after = post(proxy, {"model": "gpt-test", "input": "x", "previous_response_id": second["id"]})
    assert after.status_code == 200
    seen = [meaning(i) for i in log(emulator)[-1]["context"]]
    assert [m for m in seen if m.get("role") == "user"] == [meaning(expand_input(t)[0]) for t in
                                                            ("first question", "second question", "x")]
    refused = post(proxy, {"model": "gpt-test", "input": "x", "previous_response_id": first["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_response_not_found"


def test_a_restart_mid_conversation_loses_nothing(emulator, start_proxy, tmp_path):
    emulator.model.control({"stateless": "reject"})
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir)
    conv = ChainedConversation(proxy.url)
    for text in user_turns(3):
        conv.turn(text)
    proxy.stop()
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir, port=proxy.port)
    for text in user_turns(3, tag="after the restart "):
        conv.turn(text)
    conv.close()
    assert_chain_context_preserved(conv, log(emulator))


def test_two_replicas_on_one_redis_share_the_record(emulator, start_proxy, redis_server):
    emulator.model.control({"stateless": "reject"})
    proxies = [start_proxy(emulator.url, "--set", "stateful_emulate=always",
                           "--set", f"stateful_store={redis_server.url}") for _ in range(2)]
    previous = None
    texts = [f"turn {n}" for n in range(8)]
    for n, text in enumerate(texts):
        previous = chained(proxies[n % 2], [text], previous=previous)[-1]["id"]
    contexts = [r["context"] for r in log(emulator)]
    assert [len(c) for c in contexts] == [2 * n + 1 for n in range(8)]  # every turn saw its whole chain
    assert [i["content"] for i in contexts[-1] if i.get("role") == "user"] == texts


def test_stateful_max_depth_counts_the_clients_chain_only(emulator, start_proxy):
    """Full-history turns past ``stateful_max_depth`` (stored each as what it
    adds to the one before): continuing from the latest, a chain of depth 1
    for the client, and listing its input items, both work."""
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_max_depth=3")
    history: list[dict] = []
    for n in range(6):
        history.append({"role": "user", "content": f"full-history turn {n}"})
        answer = post(proxy, {"model": "gpt-test", "input": history})
        assert answer.status_code == 200, answer.text
        history += answer.json()["output"]
    latest = answer.json()["id"]
    go_on = post(proxy, {"model": "gpt-test", "input": "and now?", "previous_response_id": latest})
    assert go_on.status_code == 200, go_on.text
    assert meaning(log(emulator)[-1]["context"]) == meaning(history + [{"role": "user", "content": "and now?"}])
    with httpx.Client(trust_env=False, timeout=30, headers=AUTH) as c:
        listing = c.get(f"{proxy.url}/v1/responses/{latest}/input_items", params={"order": "asc", "limit": 100})
    assert listing.status_code == 200, listing.text
    assert len(listing.json()["data"]) == len(history) - 1  # every item but the latest answer
    deeper = chained(proxy, ["one", "two"], previous=go_on.json()["id"])  # the client's chain: now 4 deep
    refused = post(proxy, {"model": "gpt-test", "input": "x", "previous_response_id": deeper[-1]["id"]})
    assert refused.json()["error"]["code"] == "session_chain_depth_exceeded"  # the limit still holds for it


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_with_stream_large_bodies_a_large_continuation_is_still_expanded(emulator, start_proxy, mode, stream):
    """mitmproxy streams a body past the addons above ``stream_large_bodies``:
    a large ``previous_response_id`` turn still reaches an upstream that
    stores nothing with its chain, and is recorded for the next turn."""
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stream_large_bodies=2k")
    conv = ChainedConversation(proxy.url, stream=stream)
    for text in ["a small turn", "a large turn " + "x" * 8000, "after it", "another " + "y" * 8000]:
        conv.turn(text)
    conv.close()
    assert_chain_context_preserved(conv, log(emulator))
    output = proxy.output()
    assert "internal error" not in output and "Traceback" not in output
