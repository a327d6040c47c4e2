"""Compaction through real mitmdump (docs/compaction.md), against the
emulator taught both behaviours: native compaction with opaque items, and
none (404/405 on /responses/compact, compaction items and the trigger refused
as unknown, or the trigger ignored). Clients: the openai SDK's
``responses.compact()``, openai-agents' ``OpenAIResponsesCompactionSession``,
and Codex's remote compaction v2 (a streamed request whose last input item is
``compaction_trigger``, read as codex-rs reads it)."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from driver import httpx, without_comparisons

KEY = "sk-test-key"
MODEL = "gpt-test"
TRIGGER = {"type": "compaction_trigger"}


def log(emulator) -> list[dict]:
    return emulator.model.snapshot_log()


def creates(emulator) -> list[dict]:
    """The upstream's Responses requests, less /responses/compact and the proxy's comparisons (the first
    continuation holding an item kind the upstream has not shown it keeps is sent whole too, right after)."""
    return without_comparisons([r for r in log(emulator) if r.get("endpoint") != "compact"])


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def client_of(proxy, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def post(proxy, body: dict, key: str = KEY, path: str = "/v1/responses") -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=60) as c:
        return c.post(proxy.url + path, json=body, headers={"authorization": f"Bearer {key}"})


def events_of(text: str) -> list[dict]:
    """An SSE body's events, as codex-rs reads them (the data lines)."""
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def codex_compaction(proxy, history: list[dict], key: str = KEY) -> dict:
    """Codex's remote compaction v2 over HTTP: store false, streamed, the
    trigger last; like ``collect_compaction_output`` it needs
    response.completed and exactly one compaction output item."""
    body = {"model": MODEL, "instructions": "base instructions", "input": [*history, TRIGGER],
            "tools": [], "parallel_tool_calls": False, "store": False, "stream": True,
            "prompt_cache_key": "codex-session"}
    with httpx.Client(trust_env=False, timeout=60) as c:
        r = c.post(proxy.url + "/v1/responses", json=body,
                   headers={"authorization": f"Bearer {key}", "accept": "text/event-stream",
                            "x-codex-beta-features": "remote_compaction_v2"})
    assert r.status_code == 200, r.text
    events = events_of(r.text)
    assert events[-1]["type"] == "response.completed", [e["type"] for e in events]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    compactions = [i for i in done if i["type"] == "compaction"]
    assert len(compactions) == 1, done
    assert "response.output_item.added" in {e["type"] for e in events}
    return compactions[0]


def conversation(proxy, turns: int, key: str = KEY) -> list[dict]:
    """A full-history conversation (store false, as Codex's): its history."""
    history: list[dict] = []
    for n in range(turns):
        history.append(user(f"turn {n}: tell me about {n}"))
        r = post(proxy, {"model": MODEL, "input": history, "store": False}, key)
        assert r.status_code == 200, r.text
        history += [{k: v for k, v in i.items() if k != "id"} for i in r.json()["output"]]
    return history


def no_trigger_but_last(record: dict) -> None:
    assert TRIGGER not in record["context"][:-1]


# -- native compaction: passed through, and exact --------------------------------------------


def test_native_compaction_passes_through_untouched(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    client = client_of(proxy)
    compacted = client.responses.compact(model=MODEL, input=[user("a"), user("b")])
    assert compacted.object == "response.compaction"
    item = compacted.output[-1]
    assert item.type == "compaction" and item.encrypted_content.startswith("gAAAAA")  # the upstream's own
    window = [o.model_dump(exclude_none=True) for o in compacted.output]
    answer = client.responses.create(model=MODEL, input=[*window, user("c")])
    assert answer.status == "completed"
    assert creates(emulator)[-1]["context"][-2]["encrypted_content"] == item.encrypted_content
    # Codex's trigger on an upstream that has compaction: untouched, last, its store kept
    history = conversation(proxy, 3)
    own = codex_compaction(proxy, history)
    assert own["encrypted_content"].startswith("gAAAAA")
    record = creates(emulator)[-1]
    assert record["previous_response_id"] is None and record["store"] is False
    assert record["input_items"] == len(history) + 1
    output = proxy.output()
    assert "compaction: made by the proxy" not in output and "Traceback" not in output


def test_forward_mode_starts_a_new_chain_at_a_compaction(emulator, start_proxy):
    """A full-history client continued by forward mode, then compacted: the
    compacted window goes whole (never continued across by a stale id), and
    is continued from itself after."""
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    client = client_of(proxy)
    history: list = []
    for n in range(4):
        history.append(user(f"turn {n}"))
        history += [o.model_dump(exclude_none=True) for o in client.responses.create(model=MODEL, input=history).output]
    assert creates(emulator)[-1]["previous_response_id"] is not None  # forward mode continued the chain
    window = [o.model_dump(exclude_none=True) for o in client.responses.compact(model=MODEL, input=history).output]
    sent = [*window, user("after")]
    reply = client.responses.create(model=MODEL, input=sent)
    record = creates(emulator)[-1]
    assert record["previous_response_id"] is None and len(record["context"]) == len(sent)
    sent += [o.model_dump(exclude_none=True) for o in reply.output] + [user("after again")]
    client.responses.create(model=MODEL, input=sent)
    record = creates(emulator)[-1]
    assert record["previous_response_id"] is not None and len(record["context"]) == len(sent)
    assert [i.get("type") for i in record["context"]].count("compaction") == 1


def test_the_websocket_bridge_passes_a_trigger_and_starts_a_new_chain_at_a_compaction(emulator, start_proxy):
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true", upstream_websocket="auto")
    history = conversation(proxy, 3)
    assert creates(emulator)[-1]["transport"] == "websocket"  # the bridge continues the conversation
    item = codex_compaction(proxy, history)
    trigger_record = creates(emulator)[-1]
    assert trigger_record["transport"] == "http" and trigger_record["previous_response_id"] is None
    assert trigger_record["store"] is False and trigger_record["input_items"] == len(history) + 1
    window = [i for i in history if i.get("role") == "user"] + [item, user("go on")]
    assert post(proxy, {"model": MODEL, "input": window, "store": False}).status_code == 200
    record = creates(emulator)[-1]
    assert record["previous_response_id"] is None and len(record["context"]) == len(window)


def test_the_record_takes_no_trigger_as_content_and_a_compacted_window_as_a_new_chain(emulator, start_proxy,
                                                                                      tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    history = conversation(proxy, 2)
    item = codex_compaction(proxy, history)
    window = [i for i in history if i.get("role") == "user"] + [item, user("go on")]
    assert post(proxy, {"model": MODEL, "input": window, "store": False}).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(record_file.read_text().splitlines() if record_file.exists() else ()) < 4:
        time.sleep(0.05)
    first, second, trigger, after = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert second["continuation"]["chainId"] == first["continuation"]["chainId"]
    dropped = trigger["audit"]["protocolMapping"]["dropped"]
    assert [e["field"] for e in dropped] == ["compaction_trigger"]
    assert trigger["continuation"]["previousTurnId"] == second["continuation"]["turnId"]  # the history it compacts
    assert after["continuation"]["chainId"] != first["continuation"]["chainId"]  # a new chain
    assert after["continuation"]["previousTurnId"] is None


def test_the_trigger_stays_last_and_is_never_replayed(emulator, start_proxy):
    """The measured bug: store emulation on a stateless upstream replayed an
    earlier trigger mid-input, and the upstream answered 400."""
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always", "--set", "stateful_debug=true")
    first = post(proxy, {"model": MODEL, "input": [user("one")]}).json()
    second = post(proxy, {"model": MODEL, "input": [user("two")], "previous_response_id": first["id"]}).json()
    r = post(proxy, {"model": MODEL, "input": [TRIGGER], "previous_response_id": second["id"], "stream": True})
    assert r.status_code == 200, r.text
    trigger_record = creates(emulator)[-1]
    assert trigger_record["context"][-1] == TRIGGER or trigger_record["input_items"] == 5
    completed = [e for e in events_of(r.text) if e["type"] == "response.completed"][0]["response"]
    compaction = completed["output"][0]
    assert compaction["type"] == "compaction"
    after = post(proxy, {"model": MODEL, "input": [user("three")], "previous_response_id": completed["id"]})
    assert after.status_code == 200, after.text
    record = creates(emulator)[-1]
    assert TRIGGER not in record["context"]
    # a new chain, starting at the compaction: never the history it replaced
    assert [i.get("type") for i in record["context"]] == ["compaction", "message"]
    assert record["context"][0]["encrypted_content"] == compaction["encrypted_content"]
    further = post(proxy, {"model": MODEL, "input": [user("four")], "previous_response_id": after.json()["id"]})
    assert further.status_code == 200, further.text
    assert len(creates(emulator)[-1]["context"]) == 4


def test_server_side_compaction_passes_and_its_chain_starts_at_the_compaction(emulator, start_proxy):
    """``context_management`` goes to the upstream that honours it; the
    chain store emulation keeps continues from the compaction item it made."""
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    first = post(proxy, {"model": MODEL, "input": [user("one " * 50)]}).json()
    managed = {"model": MODEL, "input": [user("two")], "previous_response_id": first["id"],
               "context_management": [{"type": "compaction", "compact_threshold": 10}]}
    second = post(proxy, managed).json()
    assert [o["type"] for o in second["output"]] == ["compaction", "message"]
    third = post(proxy, {"model": MODEL, "input": [user("three")], "previous_response_id": second["id"]})
    assert third.status_code == 200, third.text
    assert [i.get("type") for i in creates(emulator)[-1]["context"]] == ["compaction", "message", "message"]


def test_compact_with_previous_response_id_expands_the_chain_the_proxy_keeps(emulator, start_proxy):
    emulator.model.control({"stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=always")
    client = client_of(proxy)
    first = client.responses.create(model=MODEL, input="one")
    second = client.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    compacted = client.responses.compact(model=MODEL, previous_response_id=second.id)
    record = log(emulator)[-1]
    assert record["endpoint"] == "compact" and record["previous_response_id"] is None
    assert len(record["context"]) == 4  # one, its answer, two, its answer
    assert [o.type for o in compacted.output] == ["message", "message", "compaction"]
    # its output starts a new chain: sent as input, with no previous_response_id
    window = [o.model_dump(exclude_none=True) for o in compacted.output]
    client.responses.create(model=MODEL, input=[*window, user("three")])
    assert len(creates(emulator)[-1]["context"]) == 4


# -- where the upstream lacks compaction: the proxy provides it ---------------------------


def summaries_in(record: dict) -> list[str]:
    return [part["text"] for item in record["context"] if item.get("role") == "user"
            for part in (item["content"] if isinstance(item["content"], list) else [])
            if part.get("text", "").startswith("A summary of the conversation so far")]


@pytest.mark.parametrize("lacking", ["absent", "not_allowed"])
def test_the_sdk_compacts_where_the_upstream_lacks_it(emulator, start_proxy, lacking):
    emulator.model.control({"compaction": lacking})
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    client = client_of(proxy)
    window_in = [user("first question"), {"role": "assistant", "content": "first answer"}, user("second question")]
    for attempt in range(2):  # the first learns the verdict from the upstream's 404/405; the second knows it
        compacted = client.responses.compact(model=MODEL, input=window_in)
        assert compacted.object == "response.compaction"
        assert [o.type for o in compacted.output] == ["message", "message", "compaction"]
        assert compacted.output[-1].encrypted_content.startswith("srcmp1.")
    summary_request = creates(emulator)[-1]
    assert summary_request["store"] is False and len(summary_request["context"]) == 4  # the window + the ask
    window = [o.model_dump(exclude_none=True) for o in compacted.output]
    answer = client.responses.create(model=MODEL, input=[*window, user("third question")])
    assert answer.status == "completed"
    record = creates(emulator)[-1]
    assert not [i for i in record["context"] if i.get("type") == "compaction"]
    assert len(summaries_in(record)) == 1 and "I saw 4 items" in summaries_in(record)[0]
    assert [i.get("role") for i in record["context"]] == ["user", "user", "user", "user"]
    output = proxy.output()
    assert "lacks compaction" in output and "Traceback" not in output and "internal error" not in output


def test_the_sdk_compacts_an_emulated_chain_where_the_upstream_lacks_it(emulator, start_proxy):
    emulator.model.control({"compaction": "absent", "stateless": "reject"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto")
    client = client_of(proxy)
    first = client.responses.create(model=MODEL, input="one")
    second = client.responses.create(model=MODEL, input="two", previous_response_id=first.id)
    compacted = client.responses.compact(model=MODEL, previous_response_id=second.id)
    assert [o.type for o in compacted.output] == ["message", "message", "compaction"]
    assert len(creates(emulator)[-1]["context"]) == 5  # the chain expanded, and the ask
    window = [o.model_dump(exclude_none=True) for o in compacted.output]
    third = client.responses.create(model=MODEL, input=[*window, user("three")])
    assert len(summaries_in(creates(emulator)[-1])) == 1
    # its proxy-made item, kept in a chain store emulation expands, reaches the upstream as its summary too
    client.responses.create(model=MODEL, input="four", previous_response_id=third.id)
    record = creates(emulator)[-1]
    assert len(summaries_in(record)) == 1 and len(record["context"]) == 6


@pytest.mark.parametrize("lacking", ["absent", "ignore"])
def test_codex_compacts_where_the_upstream_lacks_it(emulator, start_proxy, lacking):
    """Codex's trigger on an upstream that refuses it (answered by the proxy
    at once) or ignores it (its answer holds no compaction item: Codex fails
    once, and the proxy compacts from then on)."""
    emulator.model.control({"compaction": lacking})
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    history = conversation(proxy, 3)
    if lacking == "ignore":
        with pytest.raises(AssertionError):
            codex_compaction(proxy, history)
    item = codex_compaction(proxy, history)
    assert item["encrypted_content"].startswith("srcmp1.")
    summary_request = creates(emulator)[-1]
    assert TRIGGER not in summary_request["context"] and len(summary_request["context"]) == len(history) + 1
    # Codex's next window: the user messages it retains, the compaction item, the new turn
    retained = [i for i in history if i.get("role") == "user"]
    r = post(proxy, {"model": MODEL, "input": [*retained, item, user("go on")], "store": False})
    assert r.status_code == 200, r.text
    record = creates(emulator)[-1]
    assert len(summaries_in(record)) == 1 and len(record["context"]) == len(retained) + 2


def test_a_trigger_on_the_upstreams_own_chain_is_compacted_from_that_chain(emulator, start_proxy):
    """An upstream that stores but lacks compaction: a trigger sent with
    ``previous_response_id`` is summarized from the upstream's own chain, and
    the proxy's answer teaches nothing about how the upstream continues."""
    emulator.model.control({"compaction": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    first = post(proxy, {"model": MODEL, "input": [user("one")]}).json()
    second = post(proxy, {"model": MODEL, "input": [user("two")], "previous_response_id": first["id"]}).json()
    r = post(proxy, {"model": MODEL, "input": [TRIGGER], "previous_response_id": second["id"], "stream": True})
    completed = [e for e in events_of(r.text) if e["type"] == "response.completed"][0]["response"]
    assert [o["type"] for o in completed["output"]] == ["compaction"]
    summary_request = creates(emulator)[-1]
    # the chain's five items, sent by id, or expanded where the chain holds an item kind the upstream has not yet
    # shown it keeps (the usage proof: a stream cannot be held to compare it)
    assert summary_request["previous_response_id"] in (second["id"], None) and len(summary_request["context"]) == 5
    third = post(proxy, {"model": MODEL, "input": [user("three")], "previous_response_id": second["id"]})
    assert third.status_code == 200 and creates(emulator)[-1]["previous_response_id"] == second["id"]
    assert "without its chain" not in proxy.output()


def test_a_compaction_item_stays_with_its_tenant_and_its_proxy(emulator, start_proxy, tmp_path):
    emulator.model.control({"compaction": "absent"})
    proxy = start_proxy(emulator.url)
    window = [o.model_dump(exclude_none=True) for o in
              client_of(proxy, "sk-tenant-a").responses.compact(model=MODEL, input=[user("secret plans")]).output]
    before = len(log(emulator))
    for key in ("sk-tenant-b",):
        r = post(proxy, {"model": MODEL, "input": [*window, user("what were the plans?")]}, key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text
        assert r.json()["error"]["code"] == "invalid_encrypted_content"
    other = start_proxy(emulator.url, confdir=str(tmp_path))  # its own store: another secret
    r = post(other, {"model": MODEL, "input": [*window, user("what were the plans?")]}, "sk-tenant-a")
    assert r.status_code == 400 and "input[1]" in r.json()["error"]["message"], r.text
    assert len(log(emulator)) == before  # nothing reached the upstream
    r = post(proxy, {"model": MODEL, "input": [*window, user("what were the plans?")]}, "sk-tenant-a")
    assert r.status_code == 200 and len(summaries_in(creates(emulator)[-1])) == 1


def test_the_real_apis_item_is_refused_by_name_where_the_upstream_lacks_compaction(emulator, start_proxy):
    proxy = start_proxy(emulator.url)
    native = [o.model_dump(exclude_none=True) for o in
              client_of(proxy).responses.compact(model=MODEL, input=[user("a")]).output]
    emulator.model.control({"compaction": "absent"})  # the upstream changed (or the chain moved)
    r = post(proxy, {"model": MODEL, "input": [*native, user("b")]})
    assert r.status_code == 400 and "compaction" in r.text  # the upstream's own refusal, which teaches the verdict
    before = len(log(emulator))
    r = post(proxy, {"model": MODEL, "input": [*native, user("b")]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_compaction_item", r.text
    assert len(log(emulator)) == before
    # context_management on such an upstream: refused past its threshold, passed below it
    small = {"model": MODEL, "input": [user("hi")], "context_management": [{"type": "compaction",
                                                                             "compact_threshold": 100000}]}
    assert post(proxy, small).status_code == 200
    large = {**small, "context_management": [{"type": "compaction", "compact_threshold": 1}]}
    r = post(proxy, large)
    assert r.status_code == 400 and r.json()["error"]["param"] == "context_management", r.text


def test_openai_agents_compaction_session_where_the_upstream_lacks_compaction(emulator, start_proxy, tmp_path):
    agents = pytest.importorskip("agents")
    from agents.memory import OpenAIResponsesCompactionSession, SQLiteSession

    emulator.model.control({"compaction": "absent"})
    proxy = start_proxy(emulator.url, "--set", "stateful_debug=true")
    agents.set_tracing_disabled(True)

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0,
                                    http_client=httpx.AsyncClient(trust_env=False, timeout=60))
        agent = agents.Agent(name="assistant", instructions="Be terse.",
                             model=agents.OpenAIResponsesModel(model="gpt-4.1", openai_client=client))
        session = OpenAIResponsesCompactionSession(
            "s1", SQLiteSession("s1", str(tmp_path / "s.db")), client=client, model="gpt-4.1",
            should_trigger_compaction=lambda context: len(context["compaction_candidate_items"]) >= 2)
        for n in range(4):
            await agents.Runner.run(agent, f"question {n}", session=session)
        return await session.get_items()

    items = asyncio.run(run())
    assert any(i.get("type") == "compaction" and i["encrypted_content"].startswith("srcmp1.") for i in items)
    records = creates(emulator)
    assert any(summaries_in(r) for r in records)
    assert not [i for r in records for i in r["context"] if i.get("type") == "compaction"]
    output = proxy.output()
    assert "Traceback" not in output and "internal error" not in output
