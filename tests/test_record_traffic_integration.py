"""The continuation record through real mitmdump when traffic is untidy, with
the real SDKs: retried failures, a stream that stopped before its end and was
sent again, a refused continuation retried invisibly, a failover, tool outputs
between their calls, Gemini's automatic function calling, identical openings
in all four protocols, a paused server tool loop (JSON and streamed), and
tool-result digests keyed with the store's secret. Each conversation keeps one
chain."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from driver import TOOLS, ChainedConversation, Conversation, httpx
from google import genai
from google.genai import types as genai_types
from mitmproxy import io
from protocols_support import Stub
from stateful_responses.emulator import Emulator
from test_emulator_protocols import anthropic_turn, chat_turn, gemini_turn
from test_record_integration import wait_for_lines


def records(path) -> list[dict]:
    return [json.loads(line)["continuation"] for line in path.read_text().splitlines()]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def saved(path) -> list:
    """Every recorded flow saved with -w: its record, and whether the client got an answer."""
    with open(path, "rb") as f:
        return [flow for flow in io.FlowReader(f).stream() if flow.metadata.get("continuation")]


def answered(flow) -> bool:
    return flow.response is not None and flow.response.status_code == 200


def assert_one_linked_chain(turns: list[dict]) -> None:
    """One chain, each turn continuing the one before, none a fork."""
    assert len({t["chainId"] for t in turns}) == 1, [t["chainId"] for t in turns]
    for before, after in zip(turns, turns[1:], strict=False):
        assert after["previousTurnId"] == before["turnId"]
        assert after["stickyScope"] != "request"


@pytest.fixture
def stub():
    with Stub() as server:
        yield server


# -- retries: the SDK's own, the addon's own, the router's ---------------------------

def test_a_conversation_keeps_its_chain_across_the_sdks_retries_of_5xx_429_and_a_reset(emulator, start_proxy,
                                                                                      tmp_path):
    flows_file = tmp_path / "flows"
    proxy = start_proxy(emulator.url, "-w", str(flows_file))
    conv = Conversation(proxy.url)
    conv.client = conv.client.with_options(max_retries=2)  # the SDK's default retries, made quick below
    faults = [{"kind": "status", "status": 503}, {"kind": "status", "status": 429}, {"kind": "reset"}, None]
    for n, fault in enumerate(faults):
        if fault:
            emulator.model.control({"fail_next": [fault]})  # the turn's first attempt fails, the SDK retries it
        conv.turn(f"turn {n}: tell me about {n}.")
    conv.close()
    proxy.stop()
    flows = saved(flows_file)
    failed = [f for f in flows if not answered(f)]
    assert len(failed) == 3 and len(flows) == len(conv.sent)
    every = [f.metadata["continuation"] for f in flows]
    assert len({r["chainId"] for r in every}) == 1, "a failed attempt is a dead end, not a branch"
    assert_one_linked_chain([f.metadata["continuation"] for f in flows if answered(f)])
    for flow in failed:  # each continues the turn its retry continues
        retry = flows[flows.index(flow) + 1].metadata["continuation"]
        assert flow.metadata["continuation"]["previousTurnId"] == retry["previousTurnId"]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_a_chat_conversation_keeps_its_chain_across_retried_5xx(emulator, start_proxy, tmp_path, streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-chat", max_retries=2,
                           http_client=httpx.Client(trust_env=False))
    messages: list = [{"role": "user", "content": "hello"}]
    for text in ("more", "and more"):
        emulator.model.control({"fail_next": [{"kind": "status", "status": 503}]})
        messages += [chat_turn(client, messages, streamed).message, {"role": "user", "content": text}]
    client.close()
    wait_for_lines(record_file, 4)
    turns = records(record_file)
    assert len({t["chainId"] for t in turns}) == 1
    assert_one_linked_chain(turns[1::2])  # the answered ones; each failed one before them is a dead end


def _stopped_early_then_sent_again(protocol: str, base_url: str, emulator) -> None:
    """Three streamed turns through the protocol's own SDK; the second's stream
    ends before its stop reason, and the client sends that request again."""
    if protocol == "openai-chat":
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-chat", max_retries=0,
                               http_client=httpx.Client(trust_env=False))

        def turn(history: list) -> tuple[object, bool]:
            choice = chat_turn(client, history, streamed=True)
            return choice.message, choice.finish_reason is not None

        def user_says(text: str) -> dict:
            return {"role": "user", "content": text}
    elif protocol == "anthropic-messages":
        client = anthropic.Anthropic(base_url=base_url, api_key="sk-ant", max_retries=0,
                                     http_client=httpx.Client(trust_env=False))

        def turn(history: list) -> tuple[object, bool]:
            message = anthropic_turn(client, history, streamed=True)
            return {"role": "assistant", "content": message.content}, message.stop_reason is not None

        def user_says(text: str) -> dict:
            return {"role": "user", "content": text}
    else:
        client = genai.Client(api_key="g-key", http_options=genai_types.HttpOptions(
            base_url=base_url, retry_options=genai_types.HttpRetryOptions(attempts=1)))

        def turn(history: list) -> tuple[object, bool]:
            chunks = list(client.models.generate_content_stream(model="gemini-x", contents=history))
            text = "".join(chunk.text or "" for chunk in chunks)
            content = genai_types.Content(role="model", parts=[genai_types.Part(text=text)])
            return content, chunks[-1].candidates[0].finish_reason is not None

        def user_says(text: str) -> genai_types.Content:
            return genai_types.Content(role="user", parts=[genai_types.Part(text=text)])
    history: list = [user_says("hello")]
    for n in range(3):
        if n == 1:
            emulator.model.control({"fail_next": [{"kind": "end", "after_events": 2, "protocol": protocol}]})
        answer, ended = turn(history)
        if n == 1:
            assert not ended  # the SDK hands over what came; the client sees no stop reason and asks again
            answer, ended = turn(history)
        assert ended
        history += [answer, user_says(f"turn {n + 1}")]
    client.close()


@pytest.mark.parametrize("protocol", ["openai-chat", "anthropic-messages", "gemini-chat"])
def test_a_stream_that_stopped_before_its_end_and_was_sent_again_keeps_the_chain(emulator, start_proxy, tmp_path,
                                                                                 protocol):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    _stopped_early_then_sent_again(protocol, proxy.url, emulator)
    log = emulator.model.snapshot_log()
    assert [r["fault"] for r in log] == [None, "end", None, None] and log[1]["context"] == log[2]["context"]
    wait_for_lines(record_file, 4)
    first, stopped, retry, last = records(record_file)
    assert len({t["chainId"] for t in (first, stopped, retry, last)}) == 1, "a stopped stream is a dead end"
    assert_one_linked_chain([first, retry, last])
    assert stopped["previousTurnId"] == retry["previousTurnId"] == first["turnId"]

def test_a_continuation_the_upstream_refused_and_the_addon_retried_keeps_its_answer_and_chain(emulator,
                                                                                              start_proxy, tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    conv = Conversation(proxy.url)
    conv.turn("turn 0: hello")
    conv.turn("turn 1: more")
    emulator.model.control({"fail_next": [{"kind": "reject", "when": "continued"}]})
    conv.turn("turn 2: refused once, then answered")
    conv.turn("turn 3: and on")
    conv.close()
    assert [r["fault"] for r in emulator.model.snapshot_log()].count("reject") == 1
    wait_for_lines(record_file, 4)
    entries = lines(record_file)
    turns = [line["continuation"] for line in entries]
    assert_one_linked_chain(turns)
    retried, audit = turns[2], entries[2]["audit"]["protocolMapping"]
    assert (retried["restored"], retried["stickyScope"]) == (False, "conversation")  # the client's own body answered
    reasons = [e["reason"] for e in audit["preserved"] if e["source"] == "proxy"]
    assert any("answered 400" in r and "own body was sent again" in r for r in reasons), reasons
    assert not any("by reference to what the upstream stored" in r for r in reasons)
    assert turns[3]["restored"] is True  # continued again: it relies on the upstream's state
    assert "turn 2" not in record_file.read_text()


def test_a_forgotten_previous_response_id_retried_expanded_keeps_its_answer_and_chain(emulator, start_proxy,
                                                                                       tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", "stateful_emulate=auto", "--set", f"stateful_record_file={record_file}")
    conv = ChainedConversation(proxy.url)
    conv.turn("turn 0: hello")
    conv.turn("turn 1: more")
    emulator.model.control({"forget": [conv.previous]})  # the upstream refuses to continue it
    conv.turn("turn 2: expanded by the proxy")
    conv.turn("turn 3: and on")
    conv.close()
    wait_for_lines(record_file, 4)
    entries = lines(record_file)
    turns = [line["continuation"] for line in entries]
    assert_one_linked_chain(turns)
    assert turns[2]["restored"] is True  # the proxy expanded the chain: that is what was answered
    assert any(e["field"] == "previous_response_id" for e in entries[2]["audit"]["protocolMapping"]["dropped"])


def test_a_turn_that_failed_over_to_another_upstream_is_recorded_as_the_client_got_it(start_proxy, tmp_path):
    upstreams = [Emulator().start() for _ in range(2)]
    try:
        record_file = tmp_path / "records.jsonl"
        proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams),
                            "--set", f"stateful_record_file={record_file}")
        conv = Conversation(proxy.url)
        conv.turn("turn 0: hello")
        conv.turn("turn 1: more")
        home = next(u for u in upstreams if u.model.snapshot_log())
        home.model.control({"fail_next": [{"kind": "status", "status": 503}]})  # a 500 is retried at home
        conv.turn("turn 2: the home upstream answers 503, the other one answers")
        conv.turn("turn 3: and on")
        conv.close()
    finally:
        for upstream in upstreams:
            upstream.stop()
    wait_for_lines(record_file, 4)
    entries = lines(record_file)
    turns = [line["continuation"] for line in entries]
    assert_one_linked_chain(turns)
    moved = entries[2]["audit"]["protocolMapping"]
    assert [e["field"] for e in moved["lossy"] if e["source"] == "proxy"] == ["upstream"]
    assert turns[2]["restored"] is False  # the failover sent the client's own body


# -- tool loops ---------------------------------------------------------------------

def responses_answer(response_id: str, output: list) -> dict:
    return {"id": response_id, "object": "response", "created_at": 1, "model": "gpt-x", "status": "completed",
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


def function_call(n: int, city: str) -> dict:
    return {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "get_weather",
            "arguments": json.dumps({"city": city}), "status": "completed"}


def said(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def responses_events(answer: dict) -> list[tuple[str, dict]]:
    """A Responses answer as the API streams it: created, each item done, completed."""
    events = [("response.created", {"response": {**answer, "status": "in_progress", "output": []}})]
    events += [("response.output_item.done", {"output_index": n, "item": item})
               for n, item in enumerate(answer["output"])]
    events.append(("response.completed", {"response": answer}))
    return [(name, {"type": name, "sequence_number": n, **data}) for n, (name, data) in enumerate(events)]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_tool_outputs_put_right_after_their_calls_answer_them_all_on_one_chain(stub, start_proxy, tmp_path, streamed):
    """The loop of OpenAI's function-calling guide, appending each call and
    then its output, over an answer with two parallel calls."""
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(stub.url, "--set", f"stateful_record_file={record_file}")
    for answer in (responses_answer("resp_1", [function_call(1, "Paris"), function_call(2, "Oslo")]),
                   responses_answer("resp_2", [said("msg_2", "20 in both.")]),
                   responses_answer("resp_3", [said("msg_3", "Welcome.")])):
        if streamed:
            stub.answer_sse(responses_events(answer))
        else:
            stub.answer_json(answer)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-a", max_retries=0,
                           http_client=httpx.Client(trust_env=False))

    def create(history: list):
        if not streamed:
            return client.responses.create(model="gpt-x", input=history, tools=TOOLS)
        with client.responses.create(model="gpt-x", input=history, tools=TOOLS, stream=True) as events:
            return [event.response for event in events if event.type == "response.completed"][0]

    history: list = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    response = create(history)
    for item in response.output:
        history.append(item)
        if item.type == "function_call":
            history.append({"type": "function_call_output", "call_id": item.call_id, "output": '{"temp": 20}'})
    response = create(history)
    history += [*response.output, {"role": "user", "content": "thanks"}]
    create(history)
    client.close()
    assert [json.loads(body).get("stream", False) for _, body in stub.requests] == [streamed] * 3
    wait_for_lines(record_file, 3)
    calls, outputs, thanks = records(record_file)
    assert_one_linked_chain([calls, outputs, thanks])
    assert calls["toolContinuation"]["pendingToolCallIds"] == ["call_1", "call_2"]
    assert outputs["toolContinuation"]["submittedToolCallIds"] == ["call_1", "call_2"]
    assert (outputs["toolContinuation"]["mode"], outputs["stateOrigin"]) == ("tool_outputs", "tool-loop")


def gemini_answer(parts: list, response_id: str) -> dict:
    return {"candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
            "responseId": response_id}


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_geminis_automatic_function_calling_answers_the_calls_it_made_by_their_ids(stub, start_proxy, tmp_path,
                                                                                    streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(stub.url, "--set", f"stateful_record_file={record_file}")
    parts = [{"functionCall": {"id": f"fc_{city.lower()}", "name": "get_weather", "args": {"city": city}}}
             for city in ("Paris", "Oslo")]
    for answer in (gemini_answer(parts, "r1"), gemini_answer([{"text": "20 in both."}], "r2"),
                   gemini_answer([{"text": "Welcome."}], "r3")):
        if not streamed:
            stub.answer_json(answer)
            continue
        # streamed as Gemini does: the content in chunks, the finish reason on the last
        candidate = answer["candidates"][0]
        chunks = [{"candidates": [{"content": {"role": "model", "parts": [part]}, "index": 0}],
                   "responseId": answer["responseId"]} for part in candidate["content"]["parts"]]
        chunks[-1]["candidates"][0]["finishReason"] = candidate["finishReason"]
        stub.answer_sse(chunks)

    def get_weather(city: str) -> dict:
        """Weather for a city."""
        return {"temp": 20}

    client = genai.Client(api_key="g-key", http_options=genai_types.HttpOptions(
        base_url=proxy.url, retry_options=genai_types.HttpRetryOptions(attempts=1)))
    chat = client.chats.create(model="gemini-x", config=genai_types.GenerateContentConfig(tools=[get_weather]))
    for text in ("Weather in Paris and Oslo?", "thanks"):  # the SDK calls get_weather twice and sends the results
        if streamed:
            assert list(chat.send_message_stream(text))
        else:
            chat.send_message(text)
    client.close()
    assert [path.partition("?")[0].rsplit(":", 1)[1] for path, _ in stub.requests] == \
        ["streamGenerateContent" if streamed else "generateContent"] * 3
    wait_for_lines(record_file, 3)
    calls, results, thanks = records(record_file)
    assert_one_linked_chain([calls, results, thanks])
    assert calls["toolContinuation"]["pendingToolCallIds"] == ["fc_paris", "fc_oslo"]
    assert results["toolContinuation"]["submittedToolCallIds"] == ["fc_paris", "fc_oslo"]
    assert "toolCallIds" not in results["protocolHints"]  # no id made up


def anthropic_events(message: dict) -> list[tuple[str, dict]]:
    """An Anthropic message as the API streams it: each block started empty
    and filled by its delta, the stop reason in message_delta."""
    events = [("message_start", {"message": {**message, "content": [], "stop_reason": None}})]
    for n, block in enumerate(message["content"]):
        if block["type"] == "text":
            events += [("content_block_start", {"index": n, "content_block": {"type": "text", "text": ""}}),
                       ("content_block_delta", {"index": n, "delta": {"type": "text_delta", "text": block["text"]}})]
        elif "input" in block:
            events += [("content_block_start", {"index": n, "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"index": n, "delta": {"type": "input_json_delta",
                                                                      "partial_json": json.dumps(block["input"])}})]
        else:
            events.append(("content_block_start", {"index": n, "content_block": block}))
        events.append(("content_block_stop", {"index": n}))
    events += [("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                  "usage": {"output_tokens": 1}}), ("message_stop", {})]
    return [(name, {"type": name, **data}) for name, data in events]


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_a_paused_server_tool_turn_resent_to_go_on_is_its_server_tool_followup(stub, start_proxy, tmp_path, streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(stub.url, "--set", f"stateful_record_file={record_file}")
    usage = {"input_tokens": 1, "output_tokens": 1}
    search = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "weather"}}
    for answer in ({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                    "content": [search], "stop_reason": "pause_turn", "stop_sequence": None, "usage": usage},
                   {"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-x", "content": [
                       {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                       {"type": "text", "text": "Sunny."}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": usage}):
        if streamed:
            stub.answer_sse(anthropic_events(answer))
        else:
            stub.answer_json(answer)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0,
                                 http_client=httpx.Client(trust_env=False))
    tools = [{"type": "web_search_20250305", "name": "web_search"}]

    def create(messages: list):
        if not streamed:
            return client.messages.create(model="claude-x", max_tokens=200, tools=tools, messages=messages)
        with client.messages.stream(model="claude-x", max_tokens=200, tools=tools, messages=messages) as stream:
            return stream.get_final_message()

    messages: list = [{"role": "user", "content": "Weather?"}]
    paused = create(messages)
    assert paused.stop_reason == "pause_turn" and paused.content[0].input == {"query": "weather"}
    messages.append({"role": "assistant", "content": paused.content})  # resent as it stands, as the docs show
    assert create(messages).stop_reason == "end_turn"
    client.close()
    assert [json.loads(body).get("stream", False) for _, body in stub.requests] == [streamed] * 2
    wait_for_lines(record_file, 2)
    first, followup = records(record_file)
    assert_one_linked_chain([first, followup])
    assert (followup["toolContinuation"]["mode"], followup["stateOrigin"]) == \
        ("servertool_followup", "servertool-followup")


# -- identical openings ---------------------------------------------------------------

def test_identical_responses_openings_are_told_apart_by_the_ids_their_clients_echo(emulator, start_proxy, tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    one, two = Conversation(proxy.url), Conversation(proxy.url)
    one.turn("hello")
    two.turn("hello")  # the same opening, the same answer text
    two.turn("the second goes on first")  # out of turn: only the echoed ids tell them apart
    one.turn("the first goes on")
    one.close()
    two.close()
    wait_for_lines(record_file, 4)
    one_1, two_1, two_2, one_2 = records(record_file)
    assert one_1["chainId"] != two_1["chainId"]
    assert_one_linked_chain([one_1, one_2])
    assert_one_linked_chain([two_1, two_2])


def interleave_identical_openings(record_file, opening, answered, said) -> None:
    """Two conversations open alike ("hello", the same answer) and go on in
    turn: each keeps its own chain. ``answered(history)`` is the model's turn
    as the client appends it, ``said(text)`` the user's."""
    histories = [[opening()], [opening()]]
    for n, text in ((0, "one"), (1, "two"), (0, "one again"), (1, "two again")):
        history = histories[n]
        history += [answered(history), said(text)]
    wait_for_lines(record_file, 4)
    one_1, two_1, one_2, two_2 = records(record_file)
    assert one_1["chainId"] != two_1["chainId"]
    assert_one_linked_chain([one_1, one_2])
    assert_one_linked_chain([two_1, two_2])


def test_identical_chat_openings_go_on_from_the_turns_still_at_their_tips(emulator, start_proxy, tmp_path):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-chat", max_retries=0,
                           http_client=httpx.Client(trust_env=False))
    with client:
        interleave_identical_openings(record_file, lambda: {"role": "user", "content": "hello"},
                                      lambda history: chat_turn(client, history, streamed=False).message,
                                      lambda text: {"role": "user", "content": text})


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_identical_anthropic_openings_go_on_from_the_turns_still_at_their_tips(emulator, start_proxy, tmp_path,
                                                                               streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0,
                                 http_client=httpx.Client(trust_env=False))
    with client:
        interleave_identical_openings(
            record_file, lambda: {"role": "user", "content": "hello"},
            lambda history: {"role": "assistant", "content": anthropic_turn(client, history, streamed).content},
            lambda text: {"role": "user", "content": text})


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_identical_gemini_openings_go_on_from_the_turns_still_at_their_tips(emulator, start_proxy, tmp_path,
                                                                            streamed):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record_file}")
    client = genai.Client(api_key="g-key", http_options=genai_types.HttpOptions(
        base_url=proxy.url, retry_options=genai_types.HttpRetryOptions(attempts=1)))

    def said(text: str) -> genai_types.Content:
        return genai_types.Content(role="user", parts=[genai_types.Part(text=text)])

    try:
        interleave_identical_openings(record_file, lambda: said("hello"),
                                      lambda history: gemini_turn(client, history, streamed), said)
    finally:
        client.close()


# -- keyed digests --------------------------------------------------------------------

def test_tool_result_digests_agree_across_proxies_of_one_store_and_no_other(emulator, start_proxy, tmp_path):
    shared, fresh = tmp_path / "shared.db", tmp_path / "fresh.db"
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'}]
    digests = []
    for n, store in enumerate((shared, shared, fresh)):
        record_file = tmp_path / f"records-{n}.jsonl"
        proxy = start_proxy(emulator.url, "--set", f"stateful_store=sqlite:{store}",
                            "--set", f"stateful_record_file={record_file}")
        with openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-chat", max_retries=0,
                           http_client=httpx.Client(trust_env=False)) as client:
            client.chat.completions.create(model="gpt-x", messages=messages)
        wait_for_lines(record_file, 1)
        [outputs] = [r["toolContinuation"]["resumeOutputs"] for r in records(record_file)]
        digests.append(outputs[0]["digest"])
        assert '"temp"' not in record_file.read_text()
    assert digests[0] == digests[1] != digests[2]

