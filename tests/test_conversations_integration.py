"""OpenAI's Conversations API kept by the proxy, through real mitmdump with
the real openai SDK and openai-agents, in front of the emulator playing an
upstream without the API (``absent``: it refuses the field; ``ignore``: it
drops it) or with it (``auto`` passes through). On every request the context
the model saw is compared with what the client meant: the conversation's
items, as the API lists them, then the request's input."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from driver import TOOLS, httpx, meaning, without_comparisons

KEY = "sk-test-key"
WITHOUT_THE_API = ["absent", "ignore"]


def log(emulator) -> list[dict]:
    """The upstream's log, less the proxy's comparisons (see driver.without_comparisons)."""
    return without_comparisons(emulator.model.snapshot_log())


def sdk(proxy, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=30))


def call(proxy, method: str, path: str, body=None, key: str = KEY) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=30) as client:
        return client.request(method, proxy.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def listed(client: openai.OpenAI, conversation_id: str) -> list[dict]:
    """Every item of the conversation, oldest first, as the API lists them."""
    return [item.model_dump(exclude_unset=True)
            for item in client.conversations.items.list(conversation_id, order="asc", limit=100)]


def respond(client: openai.OpenAI, stream: bool, **kwargs):
    """One response, JSON or streamed: the final response either way."""
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_response()


def converse(client: openai.OpenAI, emulator, conversation_id: str, texts: list[str], stream: bool) -> int:
    """User turns in a conversation, tool loops included, each request checked:
    the model saw the conversation's items then the input (item for item, in
    ``meaning``), and both joined the conversation. Returns the requests made."""
    requests = 0
    for text in texts:
        new = [{"role": "user", "content": text}]
        while True:
            before = listed(client, conversation_id)
            response = respond(client, stream, model="gpt-test", input=new, tools=TOOLS, conversation=conversation_id)
            requests += 1
            assert response.conversation.id == conversation_id  # named as the API's answers name it
            seen = log(emulator)[-1]
            # In meaning: forward mode may send the request as a delta on what the upstream stored, in its spelling.
            assert meaning(seen["context"]) == meaning(before + new), f"request {requests}: the model saw otherwise"
            after = listed(client, conversation_id)
            assert after[:len(before)] == before and len(after) == len(before) + len(new) + len(response.output)
            assert [item["type"] for item in after[len(before):len(before) + len(new)]] == \
                [item.get("type", "message") for item in new]
            assert after[len(before) + len(new):] == seen["output"]  # as the upstream answered them
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                break
            new = [{"type": "function_call_output", "call_id": c.call_id, "output": "21C"} for c in calls]
    return requests


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_the_openai_sdk_keeps_its_conversation_where_the_upstream_lacks_the_api(emulator, start_proxy, mode,
                                                                              upstream, stream):
    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_debug=true")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"}],
                                               metadata={"topic": "weather"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "weather"}
    texts = ["turn 0: hello", 'turn 1: call:get_weather({"city": "Oslo"})', "turn 2: thanks"]
    assert converse(client, emulator, conversation.id, texts, stream) == 4
    assert all(record["conversation"] is None for record in log(emulator))  # never sent upstream
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "a note"}])
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id) == added.data[0]
    client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
    assert added.data[0].id not in [item["id"] for item in listed(client, conversation.id)]
    assert client.conversations.retrieve(conversation.id) == conversation
    client.close()
    output = proxy.output()
    assert "internal error" not in output and "Traceback" not in output
    assert "Oslo" not in output and "be brief" not in output and KEY not in output  # no prompt text, no key


def test_auto_passes_through_while_the_upstream_has_the_api(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    both = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": "conv_theirs",
                                                 "previous_response_id": "resp_theirs"})
    assert both.json()["error"]["code"] == "mutually_exclusive_parameters" and log(emulator) == []
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    assert converse(client, emulator, conversation.id, ["turn 0: more", "turn 1: again"], stream=True) == 2
    assert [r["conversation"] for r in log(emulator)] == [conversation.id] * 2  # the upstream keeps it
    unknown = call(proxy, "GET", "/v1/conversations/conv_never_made")
    assert unknown.json()["error"]["message"] == "Conversation with id 'conv_never_made' not found."
    client.close()
    assert "lacks the Conversations API" not in proxy.output()


def not_found(conversation_id: str) -> dict:
    return {"error": {"message": f"Conversation with id '{conversation_id}' not found.",
                      "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_the_apis_errors_and_nothing_of_them_upstream(emulator, start_proxy, mode):
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}")
    created = call(proxy, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "secret plan"}]})
    conversation_id = created.json()["id"]
    first = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x"}).json()
    before = len(log(emulator))
    for method, path in (("GET", "/v1/conversations/{id}"), ("GET", "/v1/conversations/{id}/items"),
                         ("POST", "/v1/conversations/{id}/items"), ("DELETE", "/v1/conversations/{id}")):
        for key, named in (("sk-mallory", conversation_id), (KEY, "conv_never_made")):
            answer = call(proxy, method, path.format(id=named), {"items": [{"role": "user", "content": "y"}]},
                          key=key)
            assert (answer.status_code, answer.json()) == (404, not_found(named))
    for key, named in (("sk-mallory", conversation_id), (KEY, "conv_never_made")):
        answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": named}, key=key)
        assert (answer.status_code, answer.json()) == (404, not_found(named))
    both = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": conversation_id,
                                                 "previous_response_id": first["id"]})
    assert (both.status_code, both.json()) == (400, {"error": {
        "message": "Mutually exclusive parameters: ''. Ensure you are only providing one of: 'pre..._id' or"
                   " 'conversation'.", "type": "invalid_request_error", "param": None,
        "code": "mutually_exclusive_parameters"}})
    odd = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": 5})
    assert odd.status_code == 400 and odd.json()["error"]["code"] == "invalid_type"
    later = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "y", "conversation": conversation_id,
                                                  "background": True})
    assert later.status_code == 400 and later.json()["error"]["param"] == "background"
    assert len(log(emulator)) == before  # every one answered by the proxy
    texts = [i["content"][0]["text"] for i in call(proxy, "GET", f"/v1/conversations/{conversation_id}/items"
                                                   ).json()["data"]]
    assert texts == ["secret plan"]  # nothing added by any refused request


def duplicate(item_id: str) -> dict:
    return {"message": f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try"
                       " again.", "type": "invalid_request_error", "param": "input", "code": None}


def walked(client: openai.OpenAI, conversation_id: str, order: str, limit: int) -> list[str]:
    """The ids the SDK's auto-paging lists, ``limit`` a page, following
    ``after``; cut at 50, so that paging that never ends fails the test
    instead of hanging it."""
    pager = client.conversations.items.list(conversation_id, order=order, limit=limit)
    return [item.id for item in itertools.islice(pager, 50)]


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_an_item_sent_back_into_its_conversation_is_refused_as_the_api_refuses_and_nothing_goes_upstream(
        emulator, start_proxy, mode):
    """A client that sends back the output it got (as openai-agents did in a
    tool loop) gets the API's 400 from the proxy, and the item is not in the
    conversation twice: the SDK's auto-paging by ``after`` ends, listing
    every item once (it restarted from the first copy forever)."""
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])  # auto: taken over
    answered = client.responses.create(model="gpt-test", input="hi", conversation=conversation.id)
    before = listed(client, conversation.id)
    assert len(before) == 3 and before[-1]["id"] == answered.output[0].id
    upstream_requests = len(log(emulator))
    sent_back = answered.output[0].model_dump(exclude_unset=True)
    own = {"type": "message", "role": "user", "id": "msg_own", "content": "again"}
    for item_input, named in (([{"role": "user", "content": "more"}, sent_back], sent_back["id"]),
                              ([{"type": "item_reference", "id": before[0]["id"]}], before[0]["id"]),
                              ([own, own], "msg_own")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model="gpt-test", input=item_input, conversation=conversation.id,
                                        stream=stream)
            assert refused.value.body == duplicate(named)
    assert len(log(emulator)) == upstream_requests  # every one answered by the proxy
    assert listed(client, conversation.id) == before
    ids = [item["id"] for item in before]
    assert walked(client, conversation.id, "asc", 1) == ids and walked(client, conversation.id, "desc", 1) == ids[::-1]
    client.close()
    assert "internal error" not in proxy.output()


def test_paging_over_an_item_given_twice_in_one_request_ends(emulator, start_proxy):
    """The API keeps an item given twice in one request twice; the proxy does
    too, and paging by ``after`` over the copies advances and ends."""
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "first"}])
    copy = {"type": "message", "role": "user", "id": "msg_twice", "content": "twice"}
    added = client.conversations.items.create(conversation.id, items=[copy, {"role": "user", "content": "between"},
                                                                       copy])
    assert [item.id for item in added.data] == ["msg_twice", added.data[1].id, "msg_twice"]
    first, between = listed(client, conversation.id)[0]["id"], added.data[1].id
    assert walked(client, conversation.id, "asc", 20) == [first, "msg_twice", between, "msg_twice"]
    assert walked(client, conversation.id, "asc", 2) == [first, "msg_twice", between, "msg_twice"]
    assert walked(client, conversation.id, "asc", 1) == [first, between, "msg_twice"]  # never ending on a first copy
    assert walked(client, conversation.id, "desc", 1) == [between, "msg_twice", first]  # newest first: the same
    page = client.conversations.items.list(conversation.id, order="asc", limit=1, after="msg_twice")
    assert (page.data, page.has_more) == ([], False)  # past the last copy: the end, never the start again
    client.close()


def test_a_credential_at_its_limit_is_refused_as_the_api_refuses_and_another_credential_goes_on(emulator,
                                                                                                start_proxy):
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always",
                        "--set", "stateful_conversations_per_credential=2")
    alice, mallory = sdk(proxy), sdk(proxy, key="sk-mallory")
    kept = alice.conversations.create(items=[{"role": "user", "content": "hello"}])
    made = [mallory.conversations.create() for _ in range(2)]
    refused = call(proxy, "POST", "/v1/conversations", {}, key="sk-mallory")
    assert (refused.status_code, refused.json()) == (400, {"error": {
        "message": "This credential's conversations are at this proxy's limit (2 conversations, 400000 records). "
                   "Delete conversations you no longer need.", "type": "invalid_request_error", "param": None,
        "code": "conversation_limit_exceeded"}})
    with pytest.raises(openai.BadRequestError):
        mallory.conversations.create()
    respond(alice, False, model="gpt-test", input="turn 0", conversation=kept.id)  # Alice's share is her own
    assert [item["role"] for item in listed(alice, kept.id)] == ["user", "user", "assistant"]
    mallory.conversations.delete(made[0].id)
    assert mallory.conversations.create().id.startswith("conv_")  # a deleted conversation frees its place
    assert [record["conversation"] for record in log(emulator)] == [None]  # nothing of it went upstream
    alice.close()
    mallory.close()


def test_two_responses_at_once_both_join_in_completion_order(emulator, start_proxy):
    emulator.model.control({"conversations": "absent", "think_ms": 400})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    start = listed(client, conversation.id)
    answers: dict[str, object] = {}

    def ask(text: str, delay: float) -> None:
        time.sleep(delay)
        answers[text] = client.responses.create(model="m", input=[{"role": "user", "content": text}],
                                                conversation=conversation.id)

    threads = [threading.Thread(target=ask, args=("first", 0)), threading.Thread(target=ask, args=("second", 0.2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    items = listed(client, conversation.id)
    assert len(items) == 5 and len({item["id"] for item in items}) == 5  # nothing lost, nothing twice
    assert [item["content"][0]["text"] for item in items[1::2]] == ["first", "second"]  # in completion order
    assert [items[2], items[4]] == [answers[t].output[0].model_dump(exclude_unset=True) for t in ("first", "second")]
    for record in log(emulator)[-2:]:  # both were in flight before either completed: each saw the start only
        assert meaning(record["context"]) == meaning(start + [record["context"][-1]])
    client.close()


def test_two_replicas_on_one_redis_continue_every_conversation_and_share_its_deletion(emulator, start_proxy,
                                                                                      redis_server):
    emulator.model.control({"conversations": "ignore"})
    proxies = [start_proxy(emulator.url, "--set", "stateful_emulate=always",
                           "--set", f"stateful_store={redis_server.url}") for _ in range(2)]
    clients = [sdk(proxy) for proxy in proxies]
    conversation = clients[0].conversations.create(items=[{"role": "user", "content": "hello"}])
    for n in range(6):  # every turn on the other replica
        client = clients[n % 2]
        before = listed(clients[(n + 1) % 2], conversation.id)
        new = [{"role": "user", "content": f"turn {n}"}]
        respond(client, n % 3 == 0, model="gpt-test", input=new, conversation=conversation.id)
        assert meaning(log(emulator)[-1]["context"]) == meaning(before + new)
    assert len(listed(clients[1], conversation.id)) == 13
    at_once = [threading.Thread(target=client.responses.create,
                                kwargs={"model": "m", "input": f"at once {n}", "conversation": conversation.id})
               for n, client in enumerate(clients)]
    emulator.model.control({"think_ms": 300})
    for thread in at_once:
        thread.start()
    for thread in at_once:
        thread.join(timeout=30)
    items = listed(clients[0], conversation.id)
    assert len(items) == 17 and len({item["id"] for item in items}) == 17  # both joined, nothing lost or twice
    assert {items[13]["content"][0]["text"], items[15]["content"][0]["text"]} == {"at once 0", "at once 1"}
    clients[1].conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        clients[0].conversations.items.list(conversation.id)
    for client in clients:
        client.close()


@pytest.mark.parametrize("how", ["restart", "kill -9 after each answer"])
def test_a_conversation_survives_the_proxy_on_sqlite(emulator, start_proxy, tmp_path, how):
    emulator.model.control({"conversations": "absent"})
    confdir = str(tmp_path)
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir)
    conversation_id = call(proxy, "POST", "/v1/conversations", {}).json()["id"]
    said = []
    for n in range(4):
        said.append(f"turn {n}")
        answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": said[-1], "stream": n % 2 == 1,
                                                       "conversation": conversation_id})
        assert answer.status_code == 200
        if how == "restart" and n == 1:
            proxy.stop()
        elif how != "restart":
            proxy.kill()  # the client holds the whole answer: nothing of it may be lost now
        if proxy.process.poll() is not None:
            proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", confdir=confdir, port=proxy.port)
        seen = [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"]
                for i in log(emulator)[-1]["context"] if i.get("role") == "user"]
        assert seen == said
    items = call(proxy, "GET", f"/v1/conversations/{conversation_id}/items?order=asc").json()["data"]
    assert [i["content"][0]["text"] for i in items if i["role"] == "user"] == said


AGENT_TURNS = ["hello", 'call:get_weather({"city": "Oslo"})', "thanks", 'call:get_weather({"city": "Lima"})']


def weather_agent(agents, proxy) -> tuple[object, openai.AsyncOpenAI]:
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0,
                                http_client=httpx.AsyncClient(trust_env=False, timeout=30))
    return agents.Agent(name="assistant", instructions="terse", tools=[get_weather],
                        model=agents.OpenAIResponsesModel(model="gpt-test", openai_client=client)), client


async def items_of(client: openai.AsyncOpenAI, conversation_id: str) -> list[dict]:
    return [item.model_dump(exclude_unset=True)
            async for item in client.conversations.items.list(conversation_id, order="asc")]


@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
async def test_openai_agents_conversations_session_over_a_tool_using_conversation(emulator, start_proxy, upstream):
    """The session keeps history in a conversation the proxy keeps, reads it
    back and sends it whole: every model call sees the conversation's items,
    then what its turn added; the conversation ends up holding all of it."""
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIConversationsSession

    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    agent, client = weather_agent(agents, proxy)
    session = OpenAIConversationsSession(openai_client=client)
    for number, turn in enumerate(AGENT_TURNS):
        seen = len(log(emulator))
        stored_before = await items_of(client, session.session_id) if number else []
        result = await agents.Runner.run(agent, turn, session=session)
        calls = log(emulator)[seen:]
        assert len(calls) == (2 if "call:" in turn else 1)
        assert meaning(calls[0]["context"]) == meaning(stored_before + [{"role": "user", "content": turn}])
        if len(calls) == 2:  # the tool loop resends what came before, the call and its output
            assert meaning(calls[1]["context"]) == meaning(calls[0]["context"] + calls[0]["output"] + [
                {"type": "function_call_output", "call_id": calls[0]["output"][0]["call_id"],
                 "output": "sunny in " + ("Oslo" if "Oslo" in turn else "Lima")}])
        kept = await items_of(client, session.session_id)
        assert meaning(kept) == meaning(calls[-1]["context"] + calls[-1]["output"])
        assert result.final_output == calls[-1]["output"][-1]["content"][0]["text"]
    await client.close()


async def test_openai_agents_conversations_session_passes_through_to_an_upstream_with_the_api(emulator, start_proxy):
    """``auto`` in front of an upstream that has the API: the session's
    conversation is the upstream's (created, read and added to there, read
    back from it directly), and every model call saw its items, then the turn."""
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIConversationsSession

    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    agent, client = weather_agent(agents, proxy)
    upstream = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key=KEY, max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=30))
    session = OpenAIConversationsSession(openai_client=client)
    for number, turn in enumerate(AGENT_TURNS):
        seen = len(log(emulator))
        stored_before = await items_of(upstream, session.session_id) if number else []
        await agents.Runner.run(agent, turn, session=session)
        calls = log(emulator)[seen:]
        assert len(calls) == (2 if "call:" in turn else 1)
        assert meaning(calls[0]["context"]) == meaning(stored_before + [{"role": "user", "content": turn}])
        kept = await items_of(upstream, session.session_id)  # the upstream's own conversation
        assert meaning(kept) == meaning(calls[-1]["context"] + calls[-1]["output"])
        assert await items_of(client, session.session_id) == kept  # through the proxy: the upstream's answer
    assert (await upstream.conversations.retrieve(session.session_id)).id == session.session_id
    await upstream.close()
    await client.close()
    assert "lacks the Conversations API" not in proxy.output()


@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
async def test_openai_agents_with_a_conversation_id_sends_only_new_items(emulator, start_proxy, upstream):
    """``Runner.run(conversation_id=…)``: each call sends what is new, and the
    model sees the conversation's items first (the proxy expands them)."""
    agents = pytest.importorskip("agents")
    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    agent, client = weather_agent(agents, proxy)
    conversation = await client.conversations.create()
    for turn in AGENT_TURNS:
        seen = len(log(emulator))
        before = await items_of(client, conversation.id)
        result = await agents.Runner.run(agent, turn, conversation_id=conversation.id)
        calls = log(emulator)[seen:]
        after = await items_of(client, conversation.id)
        joined = len(before)
        for n, record in enumerate(calls):  # each: the conversation so far, then the one item it sent
            assert meaning(record["context"][:-1]) == meaning(after[:joined])
            sent = record["context"][-1]
            assert sent["type"] == ("function_call_output" if n else "message")
            assert meaning(after[joined]) == meaning(sent) and after[joined + 1:joined + 1 + len(record["output"])] \
                == record["output"]
            joined += 1 + len(record["output"])
        assert joined == len(after)
        assert result.final_output == calls[-1]["output"][-1]["content"][0]["text"]
    await client.close()


@pytest.fixture
def upstreams():
    from stateful_responses.emulator import Emulator

    emulators = [Emulator().start() for _ in range(3)]
    for emulator in emulators:
        emulator.model.control({"conversations": "absent"})
    yield emulators
    for emulator in emulators:
        emulator.stop()


def test_the_router_keeps_each_conversation_on_one_upstream_and_the_record_names_its_chain(upstreams, start_proxy,
                                                                                          tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams),
                        "--set", "stateful_emulate=always", "--set", f"stateful_record_file={record_file}")
    clients = [sdk(proxy, key=f"sk-{n}") for n in range(3)]
    conversations = [client.conversations.create().id for client in clients]
    served: dict[str, list[tuple[int, dict]]] = {c: [] for c in conversations}
    for turn in range(4):
        if turn == 3:
            upstreams[served[conversations[0]][0][0]].stop()  # the first conversation's home goes away
            time.sleep(1.2)  # the router probes an upstream it has not heard from for a second
        for client, conversation_id in zip(clients, conversations, strict=True):
            before = listed(client, conversation_id)
            counts = [len(u.model.snapshot_log()) for u in upstreams]
            client.responses.create(model="m", input=f"turn {turn}", conversation=conversation_id)
            [(where, record)] = [(n, u.model.snapshot_log()[-1]) for n, u in enumerate(upstreams)
                                 if len(u.model.snapshot_log()) > counts[n]]
            assert meaning(record["context"]) == meaning(before + [{"role": "user", "content": f"turn {turn}"}])
            served[conversation_id].append((where, record))
    for conversation_id in conversations[1:]:  # each stayed where it started (their homes did not stop)
        assert len({where for where, _ in served[conversation_id]}) == 1
    homes = [served[c][0][0] for c in conversations]
    assert len(set(homes)) == 3  # new conversations spread
    moved = served[conversations[0]]
    assert len({where for where, _ in moved[:3]}) == 1 and moved[3][0] != moved[0][0]  # its home stopped: it moved
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(record_file.read_text().splitlines()) < 12:
        time.sleep(0.05)
    lines = [json.loads(line)["continuation"] for line in record_file.read_text().splitlines()]
    assert len(lines) == 12 and {line["stickyScope"] for line in lines} == {"conversation"}
    by_conversation = {}
    for line in lines:
        by_conversation.setdefault(line["resumeFrom"]["conversationId"], set()).add(line["chainId"])
    assert sorted(by_conversation) == sorted(conversations) and all(len(c) == 1 for c in by_conversation.values())
    for client in clients:
        client.close()


@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
def test_auto_takes_over_invisibly_once_the_upstream_refuses_or_ignores_a_conversation(emulator, start_proxy,
                                                                                       upstream):
    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    first = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": "conv_theirs"})
    if upstream == "ignore":  # an answer that succeeded stands, as without the proxy: it showed the API is lacking
        assert first.status_code == 200 and "conversation" not in first.json()
    else:
        assert (first.status_code, first.json()) == (404, not_found("conv_theirs"))  # not the upstream's answer
    assert len(log(emulator)) == 1  # it went upstream once: that answer showed the upstream lacks the API
    again = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": "conv_other"})
    assert (again.status_code, again.json()) == (404, not_found("conv_other")) and len(log(emulator)) == 1
    created = call(proxy, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]})
    answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": created.json()["id"]})
    assert answer.json()["conversation"] == {"id": created.json()["id"]} and log(emulator)[-1]["conversation"] is None
    assert proxy.output().count("lacks the Conversations API") == 1


def test_auto_takes_over_when_the_upstream_answers_a_conversations_endpoint_405(emulator, start_proxy):
    """The first create goes upstream and is answered 405: the proxy answers
    it itself, creating the conversation, and is the API from then on."""
    emulator.model.control({"conversations": "not_allowed"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    assert conversation.id.startswith("conv_") and listed(client, conversation.id)[0]["content"] == [
        {"type": "input_text", "text": "hello"}]
    assert converse(client, emulator, conversation.id, ["turn 0: more", 'turn 1: call:get_weather({"city": "Oslo"})'],
                    stream=False) == 3
    assert all(record["conversation"] is None for record in log(emulator))  # never sent upstream once it lacked it
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve("conv_never_made")  # answered by the proxy, not the upstream's 405
    client.close()
    output = proxy.output()
    assert output.count("lacks the Conversations API (405)") == 1 and "internal error" not in output


def test_while_the_store_is_out_of_reach_a_conversation_request_goes_as_the_client_sent_it(emulator, start_proxy,
                                                                                           redis_server):
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set",
                        f"stateful_store={redis_server.url}")
    conversation_id = call(proxy, "POST", "/v1/conversations", {}).json()["id"]
    redis_server.stop()
    answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x", "conversation": conversation_id})
    assert answer.json()["error"]["message"] == "Unknown parameter: 'conversation'."  # as without the addon
    assert log(emulator)[-1]["conversation"] == conversation_id
    listing = call(proxy, "GET", f"/v1/conversations/{conversation_id}/items")
    assert listing.json()["error"]["message"].startswith("Invalid URL")  # the upstream's own answer
    created = call(proxy, "POST", "/v1/conversations", {})  # waits for the store, as long as a DELETE would
    assert created.status_code == 503 and created.json()["error"]["type"] == "server_error"  # "try again"
    assert "id" not in created.json()  # no id the store does not hold, nor the upstream's 404
    assert "Traceback" not in proxy.output() and "internal error" not in proxy.output()


@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
def test_a_response_without_input_answers_from_the_conversations_items_alone(emulator, start_proxy, upstream):
    """``input`` is optional: a response on a conversation without it (or
    with it null) has the conversation's items for its whole context, as the
    API makes it, instead of going upstream as sent, refused or answered from
    nothing."""
    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "a note"}])
    for body in ({"model": "m", "conversation": conversation.id}, {"model": "m", "conversation": conversation.id,
                                                                    "input": None}):
        before = listed(client, conversation.id)
        answer = call(proxy, "POST", "/v1/responses", body)
        assert answer.status_code == 200 and answer.json()["conversation"] == {"id": conversation.id}
        seen = log(emulator)[-1]
        assert seen["conversation"] is None and meaning(seen["context"]) == meaning(before)
        assert listed(client, conversation.id) == before + seen["output"]  # only its output joins: it had no input
    client.close()


def test_metadata_is_refused_as_the_api_refuses_it(emulator, start_proxy):
    """At most 16 pairs, keys of at most 64 characters, values strings of at
    most 512: the proxy's refusals are the API's (the emulator's, asked
    directly), on create and on update, and a refused update changes nothing."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    own = call(proxy, "POST", "/v1/conversations", {"metadata": {"k" * 64: "v" * 512}}).json()
    api = call(emulator, "POST", "/v1/conversations", {"metadata": {"k" * 64: "v" * 512}}).json()
    assert own["metadata"] == api["metadata"] == {"k" * 64: "v" * 512}
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"k": None}, {"k": {"v": "w"}},
                     {f"k{n}": "v" for n in range(17)}):
        for path in ("/v1/conversations", "/v1/conversations/{id}"):
            refused = call(proxy, "POST", path.format(id=own["id"]), {"metadata": metadata})
            expected = call(emulator, "POST", path.format(id=api["id"]), {"metadata": metadata})
            assert (refused.status_code, refused.json()) == (expected.status_code, expected.json()) and \
                expected.status_code == 400
    assert call(proxy, "GET", f"/v1/conversations/{own['id']}").json() == own
    assert [record for record in log(emulator)] == []  # nothing of it went upstream


@pytest.mark.parametrize("request_", ["delete item", "retrieve item", "list after", "add by id", "respond by id"])
def test_auto_takes_the_apis_own_item_not_found_for_the_api(emulator, start_proxy, request_):
    """An upstream with the API answers 404 for an item it does not hold: the
    client gets that answer, and the upstream keeps its conversations, never
    taken for one without the API (which would answer its conversations
    "not found" from then on)."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    theirs = call(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]}).json()
    method, path, body = {
        "delete item": ("DELETE", f"/v1/conversations/{theirs['id']}/items/msg_unknown", None),
        "retrieve item": ("GET", f"/v1/conversations/{theirs['id']}/items/msg_unknown", None),
        "list after": ("GET", f"/v1/conversations/{theirs['id']}/items?after=msg_unknown", None),
        "add by id": ("POST", f"/v1/conversations/{theirs['id']}/items", {"items": [{"type": "item_reference",
                                                                                     "id": "msg_unknown"}]}),
        "respond by id": ("POST", "/v1/responses", {"model": "m", "conversation": theirs["id"],
                                                    "input": [{"type": "item_reference", "id": "msg_unknown"}]}),
    }[request_]
    refused = call(proxy, method, path, body)
    expected = call(emulator, method, path, body)
    assert (refused.status_code, refused.json()) == (expected.status_code, expected.json()) and \
        expected.status_code == 404
    answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "more", "conversation": theirs["id"]})
    assert answer.status_code == 200 and log(emulator)[-1]["conversation"] == theirs["id"]  # the upstream's own
    assert call(proxy, "GET", f"/v1/conversations/{theirs['id']}/items").json() == \
        call(emulator, "GET", f"/v1/conversations/{theirs['id']}/items").json()
    assert "lacks the Conversations API" not in proxy.output()


def test_auto_takes_the_apis_conversation_locked_for_the_api(emulator, start_proxy):
    """OpenAI refuses a response while another is being made in the same
    conversation (400 ``conversation_locked``, its message naming the
    conversation): the client gets that refusal to retry, and the upstream is
    never taken for one without the API."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    theirs = call(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]}).json()
    locked = {"kind": "reject", "status": 400, "code": "conversation_locked",
              "message": "Another process is currently operating on this conversation. Please retry in a few seconds."}
    emulator.model.control({"fail_next": [locked]})
    refused = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "more", "conversation": theirs["id"]})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "conversation_locked")
    answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "again", "conversation": theirs["id"]})
    assert answer.status_code == 200 and [r["conversation"] for r in log(emulator)] == [theirs["id"]] * 2
    assert "lacks the Conversations API" not in proxy.output()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_auto_learns_nothing_from_an_answer_that_is_no_response(emulator, start_proxy, stream):
    """A 200 that holds no response (a gateway's HTML page) says nothing of
    the API: the client gets it as it came, and the upstream's conversations
    stay the upstream's."""
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    theirs = call(emulator, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hello"}]}).json()
    emulator.model.control({"fail_next": [{"kind": "html"}]})
    page = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "x", "stream": stream,
                                                 "conversation": theirs["id"]})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    answer = call(proxy, "POST", "/v1/responses", {"model": "m", "input": "again", "conversation": theirs["id"]})
    assert answer.status_code == 200 and log(emulator)[-1]["conversation"] == theirs["id"]
    assert "lacks the Conversations API" not in proxy.output()


def test_a_streamed_answer_names_its_conversation_where_the_upstream_would_compress_it(emulator, start_proxy):
    """An upstream that gzips what the client accepts gzipped: a stream the
    proxy names its conversation in, event by event, is asked for plain (the
    client always accepts that), so that the SDK's response names it too."""
    emulator.model.control({"conversations": "absent", "gzip": True})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "hello"}])
    for stream in (True, False):
        response = respond(client, stream, model="m", input="x", conversation=conversation.id)
        assert response.conversation is not None and response.conversation.id == conversation.id
    assert len(listed(client, conversation.id)) == 5
    client.close()


class _Helpdesk(BaseHTTPRequestHandler):
    """A host with a ``/conversations`` API of its own, not the Responses API's."""

    def _answer(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(201, {"id": 7, "subject": "printer"})

    def do_GET(self):  # noqa: N802
        found = self.path == "/api/conversations/7"
        self._answer(200 if found else 404, {"id": 7, "subject": "printer"} if found else {"detail": "Not Found"})

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_in_regular_mode_only_a_responses_api_hosts_conversations_are_answered(emulator, start_proxy, mode):
    emulator.model.control({"conversations": "absent"})
    helpdesk = ThreadingHTTPServer(("127.0.0.1", 0), _Helpdesk)
    threading.Thread(target=helpdesk.serve_forever, daemon=True).start()
    desk = f"http://127.0.0.1:{helpdesk.server_address[1]}/api/conversations"
    try:
        proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", mode="regular")
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(proxy=proxy.url, trust_env=False, timeout=30, headers=headers) as client:
            assert client.get(desk + "/unknown").json() == {"detail": "Not Found"}  # its own 404 marks nothing
            assert client.post(desk, json={"subject": "printer"}).json() == {"id": 7, "subject": "printer"}
            assert client.get(desk + "/7").json() == {"id": 7, "subject": "printer"}
            # A host that served /responses is the Responses API's: its conversations are the proxy's to keep.
            turn = client.post(emulator.url + "/v1/responses", json={"model": "m", "input": "hello"})
            assert turn.status_code == 200
            created = client.post(emulator.url + "/v1/conversations", json={})
            assert created.status_code == 200 and created.json()["id"].startswith("conv_")
            answer = client.post(emulator.url + "/v1/responses",
                                 json={"model": "m", "input": "again", "conversation": created.json()["id"]})
            assert answer.json()["conversation"] == {"id": created.json()["id"]}
            assert client.post(desk, json={}).json() == {"id": 7, "subject": "printer"}
    finally:
        helpdesk.shutdown()
        helpdesk.server_close()


@pytest.mark.parametrize("upstream", WITHOUT_THE_API)
async def test_in_regular_mode_a_session_whose_first_call_is_conversations_works(emulator, start_proxy, upstream):
    """openai-agents' ``OpenAIConversationsSession`` through a regular proxy, its first call
    ``conversations.create`` to a host nothing has shown to be a Responses API host yet: the host's
    ``GET /v1/models`` shows it is an OpenAI-compatible API, so its conversations are the proxy's to keep."""
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIConversationsSession

    emulator.model.control({"conversations": upstream})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto", mode="regular")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key=KEY, max_retries=0,
                                http_client=httpx.AsyncClient(proxy=proxy.url, trust_env=False, timeout=30))
    agent = agents.Agent(name="assistant", instructions="terse",
                         model=agents.OpenAIResponsesModel(model="gpt-test", openai_client=client))
    session = OpenAIConversationsSession(openai_client=client)
    for number, turn in enumerate(["hello", "and again", "once more"]):
        stored_before = await items_of(client, session.session_id) if number else []
        seen = len(log(emulator))
        result = await agents.Runner.run(agent, turn, session=session)
        (call_,) = log(emulator)[seen:]
        assert call_["conversation"] is None  # the proxy's conversation: expanded, never sent upstream
        assert meaning(call_["context"]) == meaning(stored_before + [{"role": "user", "content": turn}])
        assert result.final_output == call_["output"][-1]["content"][0]["text"]
    assert len(await items_of(client, session.session_id)) == 6
    await client.close()


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_deleted_conversations_items_resolve_nowhere(emulator, start_proxy, mode):
    emulator.model.control({"conversations": "absent", "stateless": "ignore"})  # Ollama: it keeps nothing
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "the secret plan"}])
    client.responses.create(model="gpt-test", input="go on", conversation=conversation.id)
    ids = [item["id"] for item in listed(client, conversation.id)]
    assert len(ids) == 3
    other = client.conversations.create()
    copied = client.conversations.items.create(other.id, items=[{"type": "item_reference", "id": ids[0]}])
    assert "the secret plan" in json.dumps(copied.model_dump())  # while it lives, a reference resolves
    client.conversations.delete(conversation.id)
    third = client.conversations.create()
    seen = len(log(emulator))
    for item_id in ids:
        refused = call(proxy, "POST", f"/v1/conversations/{third.id}/items",
                       {"items": [{"type": "item_reference", "id": item_id}]})
        assert refused.status_code == 404 and refused.json()["error"]["message"] == \
            f"Item with id '{item_id}' not found."
        turn = call(proxy, "POST", "/v1/responses",
                    {"model": "gpt-test", "input": [{"type": "item_reference", "id": item_id}]})
        assert turn.status_code == 404 and item_id in turn.json()["error"]["message"]  # left to the upstream
    assert "the secret plan" not in json.dumps(log(emulator)[seen:])
    client.close()


async def test_an_upstream_repeating_item_ids_leaves_every_item_its_own_id(emulator, start_proxy):
    """An upstream whose numbering restarted answers every response with
    ``msg_1``: each joins the conversation under an id of its own, so the
    newest item is the one listed first and deleting it deletes it alone
    (openai-agents' ``pop_item`` takes back the answer, not the question)."""
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIConversationsSession

    emulator.model.control({"conversations": "absent", "numbered_ids": True})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    agent, client = weather_agent(agents, proxy)
    conversation = await client.conversations.create()
    answers = [(await agents.Runner.run(agent, turn, conversation_id=conversation.id)).final_output
               for turn in ["one", "two"]]
    assert [record["output"][0]["id"] for record in log(emulator)] == ["msg_1", "msg_1"]
    kept = await items_of(client, conversation.id)
    assert len(kept) == 4 and len({item["id"] for item in kept}) == 4
    newest = (await client.conversations.items.list(conversation.id, order="desc", limit=1)).data
    assert [item.content[0].text for item in newest] == [answers[1]]
    session = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
    popped = await session.pop_item()
    assert popped is not None and popped["role"] == "assistant" and popped["content"][0]["text"] == answers[1]
    assert await items_of(client, conversation.id) == kept[:3]  # the answer alone is gone
    await client.conversations.items.delete(kept[1]["id"], conversation_id=conversation.id)
    assert await items_of(client, conversation.id) == [kept[0], kept[2]]
    await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_conversation_the_proxy_keeps_is_expanded_whatever_the_model(emulator, start_proxy, mode, stream):
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stateful_models=gpt-test")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"}])
    for model in ["gpt-test", "another-model"]:
        before = listed(client, conversation.id)
        new = [{"role": "user", "content": f"hello from {model}"}]
        response = respond(client, stream, model=model, input=new, conversation=conversation.id)
        seen = log(emulator)[-1]
        assert seen["conversation"] is None and meaning(seen["context"]) == meaning(before + new)
        assert response.conversation.id == conversation.id
        assert meaning(listed(client, conversation.id)) == meaning(before + new + seen["output"])
    # Another model's request in a conversation the proxy does not keep is left alone.
    theirs = call(proxy, "POST", "/v1/responses", {"model": "another-model", "input": "x", "conversation": "conv_x"})
    assert theirs.status_code == 400 and "conversation" in theirs.text  # the upstream's own refusal of the field
    client.close()


@pytest.mark.parametrize("change", ["create", "add_items", "delete_item"])
def test_a_change_waits_through_a_short_store_lock_and_lands_once(emulator, start_proxy, tmp_path, change):
    """The store is locked past its busy timeout (the write fails, and is
    sent again once the lock is gone): the change is answered once it is
    written, as the API answers it, never by the upstream that lacks the API;
    it lands once."""
    emulator.model.control({"conversations": "absent"})
    path = tmp_path / "state.db"
    proxy = start_proxy(emulator.url, "--set", f"stateful_store=sqlite:{path}", "--set", "stateful_emulate=auto")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "user", "content": "first"}])
    before = listed(client, conversation.id)
    requests = {"create": ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "new"}]}),
                "add_items": ("POST", f"/v1/conversations/{conversation.id}/items",
                              {"items": [{"role": "user", "content": "added"}]}),
                "delete_item": ("DELETE", f"/v1/conversations/{conversation.id}/items/{before[0]['id']}", None)}
    lock = sqlite3.connect(path, timeout=10, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # reads go on, writes wait and fail
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call, proxy, *requests[change])
            deadline = time.monotonic() + 20
            while "unavailable" not in proxy.output() and time.monotonic() < deadline and not pending.done():
                time.sleep(0.05)  # until the proxy has seen its write fail
            lock.execute("ROLLBACK")
            answer = pending.result()
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
    assert "unavailable" in proxy.output()
    assert answer.status_code == 200, answer.text  # the proxy's answer, not the upstream's 404
    if change == "create":
        made = answer.json()["id"]
        assert made.startswith("conv_") and [i["content"][0]["text"] for i in listed(client, made)] == ["new"]
    elif change == "add_items":
        assert [i["content"][0]["text"] for i in listed(client, conversation.id)] == ["first", "added"]
    else:
        assert answer.json()["id"] == conversation.id and listed(client, conversation.id) == []
    client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_with_stream_large_bodies_a_large_turn_still_goes_with_its_conversation(emulator, start_proxy, mode, stream):
    """mitmproxy streams a body past the addons above ``stream_large_bodies``:
    a large turn in a conversation the proxy keeps still reaches the upstream
    with the conversation's items, and joins it with its own answer."""
    emulator.model.control({"conversations": "absent"})
    proxy = start_proxy(emulator.url, "--set", f"stateful_emulate={mode}", "--set", "stream_large_bodies=2k")
    client = sdk(proxy)
    conversation = client.conversations.create(items=[{"role": "developer", "content": "be brief"}])
    for text in ["a small turn", "a large turn " + "x" * 8000, "another " + "y" * 8000]:
        before = listed(client, conversation.id)
        new = [{"role": "user", "content": text}]
        response = respond(client, stream, model="gpt-test", input=new, conversation=conversation.id)
        seen = log(emulator)[-1]
        assert seen["conversation"] is None and meaning(seen["context"]) == meaning(before + new)
        after = listed(client, conversation.id)
        assert meaning(after) == meaning(before + new + seen["output"])
        assert response.output_text == seen["output"][-1]["content"][0]["text"]
    calls = len(log(emulator))
    both = call(proxy, "POST", "/v1/responses", {"model": "gpt-test", "input": "z" * 8000,
                                                 "conversation": conversation.id, "previous_response_id": "resp_x"})
    assert both.json()["error"]["code"] == "mutually_exclusive_parameters"  # the proxy's own answer, as the API's
    assert all(record["body_bytes"] == 0 for record in log(emulator)[calls:])  # the held-back body, none of it
    client.close()
    assert "internal error" not in proxy.output() and "Traceback" not in proxy.output()
