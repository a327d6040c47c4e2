"""WebSocket mode on the emulator's HTTP port, driven by openai-python's own
``responses.connect()`` client and by a raw websockets client for the exact
frames: the socket's memory of its latest response, hydration from storage,
eviction, one response at a time per lane, lanes, steering, the lifetime limit,
refusals and faults."""

from __future__ import annotations

import hashlib
import json
import time

import openai
import pytest
import websockets.sync.client
from driver import TOOLS, httpx
from stateful_responses.emulator import Emulator
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidStatus

TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")
# the first turn falls silent after its response.created until the socket's next message
UNTIL_THE_NEXT_MESSAGE = {"kind": "ws_stall", "after_events": 1, "ms": 30_000, "until_message": True}


def sdk(emu, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=emu.url + "/v1", max_retries=0)


def turn(conn, **body) -> list:
    """Send one ``response.create`` and collect its events up to the terminal one."""
    conn.response.create(**{"model": "m", **body})
    events = []
    for event in conn:
        events.append(event)
        if event.type in TERMINAL:
            return events
    raise AssertionError("the socket closed mid-turn")


def completed(conn, **body):
    events = turn(conn, **body)
    assert events[-1].type == "response.completed", events[-1]
    return events[-1].response


def error_of(conn, **body):
    events = turn(conn, **body)
    assert [e.type for e in events] == ["error"], events
    return events[0]


def socket_records(emu) -> list[dict]:
    return [r for r in emu.model.snapshot_log() if r["transport"] == "websocket"]


def http_create(emu, key: str = "sk-a", **body) -> dict:
    with httpx.Client(trust_env=False, timeout=30) as client:
        answer = client.post(emu.url + "/v1/responses", json={"model": "m", **body},
                             headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def raw_socket(emu, key: str | None = "sk-a", **options):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return websockets.sync.client.connect(emu.url.replace("http", "ws", 1) + "/v1/responses",
                                          additional_headers=headers, **options)


def raw_turn(ws, message: str) -> list[str]:
    """Send ``message`` as it is and collect every message answered up to the terminal event."""
    ws.send(message)
    received = []
    while True:
        received.append(ws.recv(timeout=10))
        if json.loads(received[-1])["type"] in TERMINAL:
            return received


# -- the socket's memory, storage and eviction --------------------------------------------------


def test_store_false_turns_continue_from_the_sockets_latest_response(emulator):
    with sdk(emulator).responses.connect() as conn:
        first = completed(conn, input="one", store=False)
        second = completed(conn, input="two", store=False, previous_response_id=first.id)
        third = completed(conn, input=[{"role": "user", "content": "three"}], store=False,
                          previous_response_id=second.id)
    records = socket_records(emulator)
    assert [r["continued"] for r in records] == [False, True, True]
    assert [r["hydrated"] for r in records] == [False, False, False]
    assert [r["stored"] for r in records] == [False, False, False]
    # each context is the parent's context, its output, then this input, as over HTTP
    assert records[1]["context"] == records[0]["context"] + records[0]["output"] + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]}]
    assert records[2]["context"] == records[1]["context"] + records[1]["output"] + [{"role": "user", "content": "three"}]
    assert records[1]["output"] == [o.model_dump(exclude_unset=True) for o in second.output]
    assert third.previous_response_id == second.id and third.store is False
    assert third.output[0].content[0].text.startswith(f"I saw 5 items; context digest {records[2]['context_digest']}")


def test_context_rules_are_the_http_ones(emulator):
    """Instructions and tools are not inherited, item references resolve from what is stored."""
    with sdk(emulator).responses.connect() as conn:
        first = completed(conn, input="one", instructions="be brief", tools=TOOLS)
        assert "Instructions digest" in first.output[0].content[0].text
        second = completed(conn, input='call:get_weather({"city": "Oslo"})', previous_response_id=first.id)
        assert second.instructions is None and second.tools == []
        assert second.output[0].type == "message"  # the tool was not offered again, so it is not called
        completed(conn, input=[{"type": "item_reference", "id": first.output[0].id}])
    records = socket_records(emulator)
    assert records[2]["references"] == 1 and records[2]["context"] == [records[0]["output"][0]]


def test_store_true_hydrates_an_older_response_another_sockets_and_an_http_one(emulator):
    client = sdk(emulator)
    over_http = http_create(emulator, input="from http")
    with client.responses.connect() as other:
        elsewhere = completed(other, input="another socket")
    with client.responses.connect() as conn:
        older = completed(conn, input="one")
        completed(conn, input="two", previous_response_id=older.id)
        completed(conn, input="three", previous_response_id=older.id)
        completed(conn, input="four", previous_response_id=elsewhere.id)
        completed(conn, input="five", previous_response_id=over_http["id"])
    records = socket_records(emulator)[2:]
    assert [r["hydrated"] for r in records] == [False, True, True, True]
    assert records[1]["context"][:2] == records[0]["context"][:2]
    assert records[3]["context"][1] == over_http["output"][0]


def test_store_false_with_any_other_id_is_previous_response_not_found(emulator):
    client = sdk(emulator)
    with client.responses.connect() as other:
        elsewhere = completed(other, input="another socket", store=False)
        stored_elsewhere = completed(other, input="stored", store=True)
    with client.responses.connect() as conn:
        older = completed(conn, input="one", store=False)
        completed(conn, input="two", store=False, previous_response_id=older.id)
        for previous in (older.id, elsewhere.id, stored_elsewhere.id):
            error = error_of(conn, input="three", store=False, previous_response_id=previous)
            assert error.status == 400
            assert error.error.model_dump(exclude_none=True) == {
                "type": "invalid_request_error", "code": "previous_response_not_found", "param": "previous_response_id",
                "message": f"Previous response with id '{previous}' not found."}
        conn.response.create(model="m", input="again", store=False, previous_response_id=older.id)
        with pytest.raises(openai.OpenAIError, match="previous_response_not_found"):
            conn.dispatch_events()  # the SDK's push-based reader raises on an unhandled error event


@pytest.mark.parametrize("store", [False, True])
def test_a_failed_turn_evicts_the_sockets_latest_response(emulator, store):
    with sdk(emulator).responses.connect() as conn:
        first = completed(conn, input="one", store=store)
        emulator.model.control({"fail_next": [{"kind": "failed"}]})
        assert turn(conn, input="two", store=store, previous_response_id=first.id)[-1].type == "response.failed"
        if store:  # evicted from the socket, still in storage: hydrated
            completed(conn, input="three", store=store, previous_response_id=first.id)
            assert socket_records(emulator)[-1]["hydrated"] is True
        else:
            assert error_of(conn, input="three", previous_response_id=first.id, store=False).status == 400


@pytest.mark.parametrize("fault", [{"kind": "ws_error", "status": 500}, {"kind": "reject"}, {"kind": "status"},
                                   {"kind": "stream_error"}, {"kind": "incomplete"}])
def test_every_refused_or_unfinished_turn_evicts(emulator, fault):
    with sdk(emulator).responses.connect() as conn:
        first = completed(conn, input="one", store=False)
        emulator.model.control({"fail_next": [fault]})
        assert turn(conn, input="two", store=False)[-1].type in ("error", "response.incomplete")
        error = error_of(conn, input="three", store=False, previous_response_id=first.id)
        assert error.error.code == "previous_response_not_found"


def test_generate_false_warms_up_a_response_that_later_turns_continue_from(emulator):
    with sdk(emulator).responses.connect() as conn:
        events = turn(conn, input="the system prompt", store=False, generate=False)
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
        warm = events[-1].response
        assert warm.output == [] and warm.status == "completed"
        answer = completed(conn, input="now answer", store=False, previous_response_id=warm.id)
    warm_record, answer_record = socket_records(emulator)
    assert warm_record["generate"] is False and warm_record["output"] == []
    assert answer_record["context"] == warm_record["context"] + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "now answer"}]}]
    assert answer.output[0].content[0].text.startswith("I saw 2 items;")


def test_closing_the_socket_loses_its_latest_response(emulator):
    client = sdk(emulator)
    with client.responses.connect() as conn:
        first = completed(conn, input="one", store=False)
    with client.responses.connect() as conn:
        assert error_of(conn, input="two", store=False, previous_response_id=first.id).status == 400


def test_a_socket_belongs_to_its_credential(emulator):
    stored = http_create(emulator, key="sk-b", input="b's")
    with sdk(emulator, key="sk-a").responses.connect() as conn:
        error = error_of(conn, input="x", previous_response_id=stored["id"])
    assert error.error.code == "previous_response_not_found"


# -- the socket's own limits ----------------------------------------------------------------------


def test_one_response_at_a_time(emulator):
    emulator.model.control({"think_ms": 300})  # the first turn is still thinking when the second arrives
    with sdk(emulator).responses.connect() as conn:
        conn.response.create(model="m", input="one", store=False)
        conn.response.create(model="m", input="two", store=False)
        events = []
        for event in conn:
            events.append(event)
            if event.type == "response.completed":
                break
        refusals = [e for e in events if e.type == "error"]
        first = events[-1].response
        assert len(refusals) == 1 and refusals[0].status == 400
        assert refusals[0].error.model_dump(exclude_none=True) == {
            "type": "invalid_request_error", "code": "conversation_already_has_active_response",
            "message": f"Conversation already has an active response in progress: {first.id}. Wait until the response"
                       " is finished before creating a new one."}
        assert sum(e.type == "response.created" for e in events) == 1
        emulator.model.control({"think_ms": 0})
        completed(conn, input="three", store=False, previous_response_id=first.id)  # the refusal evicted nothing
    assert [r.get("error", {}).get("code") for r in socket_records(emulator)] == [
        None, "conversation_already_has_active_response", None]


def test_past_its_lifetime_a_socket_refuses_and_a_new_one_works(emulator):
    client = sdk(emulator)
    with client.responses.connect() as conn:
        first = completed(conn, input="one")
        emulator.model.control({"ws_lifetime_s": 0})
        error = error_of(conn, input="two", previous_response_id=first.id)
        assert error.status == 400
        assert error.error.model_dump(exclude_none=True) == {
            "type": "invalid_request_error", "code": "websocket_connection_limit_reached",
            "message": "Responses websocket connection limit reached (60 minutes). Create a new websocket connection"
                       " to continue."}
    emulator.model.control({"ws_lifetime_s": 3600})
    with client.responses.connect() as conn:
        completed(conn, input="two", previous_response_id=first.id)  # stored: hydrated on the new socket


def test_background_is_refused(emulator):
    with sdk(emulator).responses.connect() as conn:
        error = error_of(conn, input="x", background=True)
    assert error.status == 400 and error.error.param == "background"
    assert error.error.code == "unsupported_parameter"


# -- refusing the upgrade ---------------------------------------------------------------------------


def test_a_refused_upgrade_is_an_http_error_the_sdk_raises(emulator):
    emulator.model.control({"websocket": "refuse"})
    with pytest.raises(InvalidStatus) as refused:
        sdk(emulator).responses.connect().enter()
    assert refused.value.response.status_code == 404
    assert json.loads(refused.value.response.body) == {"error": {
        "message": "Invalid URL (GET /v1/responses)", "type": "invalid_request_error", "param": None, "code": None}}
    assert http_create(emulator, input="http still works")["status"] == "completed"
    emulator.model.control({"websocket": None})
    with sdk(emulator).responses.connect() as conn:
        completed(conn, input="accepted again")


def test_an_upgrade_answered_unavailable_is_a_503(emulator):
    emulator.model.control({"websocket": "unavailable"})
    with pytest.raises(InvalidStatus) as refused:
        sdk(emulator).responses.connect().enter()
    assert refused.value.response.status_code == 503
    assert json.loads(refused.value.response.body)["error"]["type"] == "server_error"


def test_an_upgrade_without_a_credential_gets_the_apis_401(emulator):
    with pytest.raises(InvalidStatus) as refused:
        raw_socket(emulator, key=None)
    assert refused.value.response.status_code == 401
    error = json.loads(refused.value.response.body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("You didn't provide an API key.")


def test_a_malformed_handshake_gets_wsprotos_http_error(emulator):
    with httpx.Client(trust_env=False) as client:
        answer = client.get(emulator.url + "/v1/responses", headers={
            "authorization": "Bearer sk-a", "connection": "Upgrade", "upgrade": "websocket",
            "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==", "sec-websocket-version": "8"})
    assert answer.status_code == 426 and answer.headers["sec-websocket-version"] == "13"


# -- faults -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [None, 1011])
def test_ws_close_closes_the_socket_after_n_events(emulator, code):
    emulator.model.control({"fail_next": [{"kind": "ws_close", "after_events": 2, **({"code": code} if code else {})}]})
    with raw_socket(emulator) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "x"}))
        received = [json.loads(ws.recv(timeout=10))["type"] for _ in range(2)]
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=10)
    assert received == ["response.created", "response.in_progress"]
    assert (closed.value.rcvd.code if closed.value.rcvd else None) == code
    record = socket_records(emulator)[-1]
    assert record["fault"] == "ws_close" and len(record["messages"]) == 2


def test_ws_close_reaches_the_sdk_as_a_closed_connection(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_close", "after_events": 1}]})
    with sdk(emulator).responses.connect() as conn:
        conn.response.create(model="m", input="x")
        with pytest.raises(ConnectionClosedError):
            for _ in conn:
                pass


def test_ws_error_sends_an_error_event_instead_of_the_turn(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 429, "code": "rate_limit_exceeded",
                                           "type": "requests", "message": "Rate limit reached."}]})
    with raw_socket(emulator) as ws:
        received = raw_turn(ws, json.dumps({"type": "response.create", "model": "m", "input": "x"}))
    assert [json.loads(m) for m in received] == [{"type": "error", "status": 429, "error": {
        "message": "Rate limit reached.", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}]


def test_ws_stall_silences_the_turn_while_pings_are_answered_and_a_second_turn_is_refused(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_stall", "after_events": 1, "ms": 600}]})
    with raw_socket(emulator) as ws:
        started = time.monotonic()
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "x"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "response.created"
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.2)
        assert ws.ping().wait(5)  # the socket is alive: only the turn is silent
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "y"}))
        refusal = json.loads(ws.recv(timeout=10))
        rest = [json.loads(ws.recv(timeout=10))]
        while rest[-1]["type"] not in TERMINAL:
            rest.append(json.loads(ws.recv(timeout=10)))
    assert refusal["type"] == "error" and refusal["error"]["code"] == "conversation_already_has_active_response"
    assert rest[0]["type"] == "response.in_progress" and rest[-1]["type"] == "response.completed"
    assert time.monotonic() - started >= 0.6
    assert [(r.get("fault"), r.get("error", {}).get("code")) for r in socket_records(emulator)] == [
        ("ws_stall", None), (None, "conversation_already_has_active_response")]


def test_ws_stall_after_the_last_event_keeps_the_turn_running(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_stall", "after_events": 100, "ms": 500}]})
    with raw_socket(emulator) as ws:
        create = {"type": "response.create", "model": "m", "store": False}
        first = json.loads(raw_turn(ws, json.dumps({**create, "input": "one"}))[-1])["response"]
        refused = [json.loads(m) for m in raw_turn(ws, json.dumps({**create, "input": "two"}))]
        time.sleep(0.5)
        third = json.loads(raw_turn(ws, json.dumps({**create, "input": "three",
                                                    "previous_response_id": first["id"]}))[-1])
    assert first["status"] == "completed" and [m["type"] for m in refused] == ["error"]
    assert refused[0]["error"]["code"] == "conversation_already_has_active_response"
    assert third["type"] == "response.completed"  # the refusal evicted nothing


def test_ws_stall_lasts_until_the_client_gives_up(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_stall"}]})
    with raw_socket(emulator) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "x"}))
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.5)
    for _ in range(100):
        if not emulator.open_sockets:
            break
        time.sleep(0.05)
    record = socket_records(emulator)[-1]
    assert not emulator.open_sockets and record["fault"] == "ws_stall" and "messages" not in record  # none sent


def test_http_requests_leave_websocket_faults_queued(emulator):
    emulator.model.control({"fail_next": [{"kind": "ws_error", "status": 503}]})
    assert http_create(emulator, input="x")["status"] == "completed"
    with sdk(emulator).responses.connect() as conn:
        assert error_of(conn, input="y").status == 503


def test_a_stream_error_is_the_http_streams_error_event(emulator):
    emulator.model.control({"fail_next": [{"kind": "stream_error"}]})
    with sdk(emulator).responses.connect() as conn:
        events = turn(conn, input="x")
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1].sequence_number == 2 and events[-1].status is None  # part of the stream, not a refusal
    assert events[-1].error.code == "server_error"


def arrivals(conn, **body) -> list[float]:
    """When each event of one turn arrived, the first entry being just before it was sent.

    Read before the send: the emulator starts the model's time on receipt, which can be before `create` returns.
    """
    times = [time.monotonic()]
    conn.response.create(**{"model": "m", **body})
    for event in conn:
        times.append(time.monotonic())
        if event.type in TERMINAL:
            return times
    raise AssertionError("the socket closed mid-turn")


def test_think_ms_and_slow_ms_pace_socket_turns(emulator):
    with sdk(emulator).responses.connect() as conn:
        emulator.model.control({"think_ms": 200})
        thinking = arrivals(conn, input="x")
        emulator.model.control({"think_ms": 0, "slow_ms": 50})
        slow = arrivals(conn, input="y")
    assert thinking[1] - thinking[0] >= 0.2  # no event before the model's time to answer
    assert slow[-1] - slow[1] >= 0.05 * (len(slow) - 2)  # a pause after each event


# -- the wire ---------------------------------------------------------------------------------------


def test_a_turn_sent_right_after_the_terminal_event_is_taken(emulator):
    emulator.model.control({"slow_ms": 30})
    with sdk(emulator).responses.connect() as conn:
        first = completed(conn, input="one", store=False)
        completed(conn, input="two", store=False, previous_response_id=first.id)


def test_read_rate_paces_what_a_socket_reads_as_it_paces_an_http_body(emulator):
    emulator.model.control({"read_rate_bytes_per_s": 1_000_000})
    message = json.dumps({"type": "response.create", "model": "m", "input": "x" * 300_000})
    with raw_socket(emulator) as ws:
        started = time.monotonic()
        raw_turn(ws, message)
        elapsed = time.monotonic() - started
    assert elapsed >= 0.28, elapsed  # 300 kB at 1 MB/s


def test_the_log_numbers_each_socket(emulator):
    client = sdk(emulator)
    with client.responses.connect() as first, client.responses.connect() as second:
        completed(first, input="one")
        completed(second, input="two")
        completed(first, input="three")
    numbers = [r["socket"] for r in socket_records(emulator)]
    assert numbers[0] == numbers[2] != numbers[1]


def test_each_event_is_one_text_message_exactly_as_the_http_stream_carries_it(emulator):
    body = {"model": "m", "input": 'call:get_weather({"city": "Oslo"})', "tools": TOOLS,
            "reasoning": {"summary": "auto"}}
    with httpx.Client(trust_env=False) as client:
        streamed = client.post(emulator.url + "/v1/responses", json={**body, "stream": True},
                               headers={"authorization": "Bearer sk-a"}).text
    over_http = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    message = json.dumps({"type": "response.create", **body})
    with raw_socket(emulator) as ws:
        assert ws.response.headers.get("sec-websocket-extensions") is None  # permessage-deflate offered, declined
        received = raw_turn(ws, message)
    assert all(isinstance(m, str) and m.startswith("{") for m in received)  # text frames, no SSE framing
    over_socket = [json.loads(m) for m in received]
    assert [e["type"] for e in over_socket] == [e["type"] for e in over_http]
    assert [e["sequence_number"] for e in over_socket] == list(range(len(over_http)))
    assert over_socket[-1]["response"]["output"][1]["arguments"] == over_http[-1]["response"]["output"][1]["arguments"]
    assert {e["type"] for e in over_socket} >= {"response.function_call_arguments.done",
                                                "response.reasoning_summary_text.done"}
    record = socket_records(emulator)[-1]
    assert record["body_bytes"] == len(message.encode())
    assert record["body_sha256"] == hashlib.sha256(message.encode()).hexdigest()
    assert record["messages"] == received
    assert record["stream"] is True and record["transport"] == "websocket"


def test_messages_the_socket_refuses(emulator):
    with raw_socket(emulator) as ws:
        refusals = [json.loads(raw_turn(ws, m)[0]) for m in (
            "not json", json.dumps({"type": "response.cancel"}), json.dumps({"type": "response.create"}))]
        completed_turn = raw_turn(ws, json.dumps({"type": "response.create", "model": "m", "input": "ok"}))
    assert [(r["status"], r["error"]["code"], r["error"]["param"]) for r in refusals] == [
        (400, None, None), (400, "invalid_value", "type"), (400, "missing_required_parameter", "model")]
    assert refusals[1]["error"]["message"] == "Invalid value: 'response.cancel'. Supported values are: 'response.create'."
    assert all(set(r) == {"type", "status", "error"} for r in refusals)
    assert json.loads(completed_turn[-1])["type"] == "response.completed"


def test_http_still_works_on_the_same_port_and_shares_the_store(emulator):
    with sdk(emulator).responses.connect() as conn:
        over_socket = completed(conn, input="one")
        continued = http_create(emulator, input="two", previous_response_id=over_socket.id)
        with httpx.Client(trust_env=False) as client:
            fetched = client.get(f"{emulator.url}/v1/responses/{over_socket.id}",
                                 headers={"authorization": "Bearer sk-a"}).json()
        completed(conn, input="three", previous_response_id=continued["id"])
    assert fetched["id"] == over_socket.id and fetched["output"] == [o.model_dump(exclude_unset=True) for o in over_socket.output]
    assert [r["transport"] for r in emulator.model.snapshot_log()] == ["websocket", "http", "websocket"]


async def test_the_async_sdk_drives_the_same_socket(emulator):
    client = openai.AsyncOpenAI(api_key="sk-a", base_url=emulator.url + "/v1", max_retries=0)
    async with client.responses.connect() as conn:
        previous = None
        for text in ("one", "two"):
            await conn.response.create(model="m", input=text, store=False, previous_response_id=previous)
            async for event in conn:
                if event.type == "response.completed":
                    previous = event.response.id
                    break
    assert [r["continued"] for r in socket_records(emulator)] == [False, True]


def test_stopping_the_emulator_closes_open_sockets():
    emu = Emulator().start()
    try:
        ws = raw_socket(emu)
    finally:
        emu.stop()
    with pytest.raises(ConnectionClosed):
        ws.recv(timeout=5)


# -- lanes and steering (openai-python 3.60's stream_id and response.steer) ------------------------------------


def until_terminals(ws, count: int) -> list[dict]:
    """Every event up to ``count`` terminal ones."""
    received: list[dict] = []
    while sum(e["type"] in TERMINAL for e in received) < count:
        received.append(json.loads(ws.recv(timeout=10)))
    return received


def test_lanes_run_at_once_each_event_naming_its_lane_and_a_busy_lane_refuses(emulator):
    emulator.model.control({"fail_next": [UNTIL_THE_NEXT_MESSAGE], "ws_busy_code": "response_already_in_flight"})
    with raw_socket(emulator) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "a", "stream_id": "a"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "response.created"  # then lane a falls silent
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "b", "stream_id": "b"}))
        events = until_terminals(ws, 2)  # lane b started while lane a ran
        ended = {e["stream_id"]: e["response"] for e in events if e["type"] in TERMINAL}
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "a2", "stream_id": "a",
                            "previous_response_id": ended["b"]["id"]}))  # a fork of b's, on lane a
        forked = until_terminals(ws, 1)
    assert {e["stream_id"] for e in events} == {"a", "b"}
    assert ended["a"]["status"] == ended["b"]["status"] == "completed"
    assert [e["stream_id"] for e in forked] == ["a"] * len(forked) and forked[-1]["type"] == "response.completed"
    log = socket_records(emulator)
    assert [(r["stream_id"], r["continued"]) for r in log] == [("a", False), ("b", False), ("a", True)]

    emulator.model.control({"fail_next": [UNTIL_THE_NEXT_MESSAGE]})
    with raw_socket(emulator) as ws:  # the default lane: no stream_id
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "x"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "response.created"
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "too early"}))
        refusal = next(e for e in until_terminals(ws, 2) if e["type"] == "error")
    assert refusal["error"]["code"] == "response_already_in_flight" and "stream_id" not in refusal


def test_steering_ends_the_response_and_makes_its_successor(emulator):
    emulator.model.control({"fail_next": [UNTIL_THE_NEXT_MESSAGE]})
    with raw_socket(emulator) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "go", "stream_id": "s",
                            "instructions": "Be terse.", "store": False}))
        steered = json.loads(ws.recv(timeout=10))["response"]["id"]
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": steered, "input": "and this"}))
        events = until_terminals(ws, 2)
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": steered, "input": "late"}))
        failed = json.loads(ws.recv(timeout=10))
    accepted = events[0]
    assert accepted["type"] == "response.steer.accepted" and accepted["stream_id"] == "s"
    assert accepted["steer"]["previous_response_id"] == steered and accepted["steer"]["id"].startswith("steer_")
    ended = next(e for e in events if e["type"] == "response.incomplete")["response"]
    assert ended["id"] == steered and ended["incomplete_details"] == {"reason": "steered"} and ended["output"]
    successor = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and successor["previous_response_id"] == steered
    assert successor["instructions"] == "Be terse." and all(e["stream_id"] == "s" for e in events)
    log = socket_records(emulator)
    assert log[1]["continued"] and log[1]["context"] == [*log[0]["context"], *ended["output"],
                                                        {"role": "user", "content": "and this"}]
    assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == "response_not_active"
