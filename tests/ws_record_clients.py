"""WebSocket-mode conversations of the openai SDK (``responses.connect()`` and
its lanes session), run as a process of their own so that the environment
alone (``HTTPS_PROXY``, ``SSL_CERT_FILE``) can put mitmproxy in between: a
regular proxy. ``python ws_record_clients.py SCENARIO BASE_URL`` prints what
the client got, as JSON: the ids it continued from, in the order it sent."""

from __future__ import annotations

import asyncio
import json
import sys

import openai
from openai.lib.responses_websocket import AsyncResponsesWebSocketSession, ResponsesWebSocketLimits

MODEL = "gpt-test"
# websockets' 10 s to open is short for a busy machine whose regular proxy mints a certificate meanwhile
OPEN = {"open_timeout": 60}
LIMITS = ResponsesWebSocketLimits(max_lanes=4, max_events_per_lane=256, max_events=512, max_bytes_per_lane=1 << 22,
                                  max_bytes=1 << 23)


def final(conn) -> object:
    """The socket's events until a response ends: that response."""
    return next(e for e in conn if e.type in ("response.completed", "response.incomplete")).response


def sockets(client: openai.OpenAI) -> dict:
    """A conversation over three sockets: two turns on the first, one continued by id on a new socket (as a
    reconnect), then its whole history resent without the id on a third (as after previous_response_not_found)."""
    ids, history = [], []
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        for n in range(2):
            conn.response.create(model=MODEL, input=f"socket turn {n}",
                                 **({"previous_response_id": ids[-1]} if ids else {}))
            response = final(conn)
            ids.append(response.id)
            history += [{"role": "user", "content": f"socket turn {n}"}, *response.output]
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.response.create(model=MODEL, input="socket turn 2", previous_response_id=ids[-1])
        response = final(conn)
        ids.append(response.id)
        history += [{"role": "user", "content": "socket turn 2"}, *response.output]
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.response.create(model=MODEL, input=[*history, {"role": "user", "content": "socket turn 3"}])
        ids.append(final(conn).id)
    return {"ids": ids}


def http(client: openai.OpenAI) -> dict:
    """The same recovery over HTTP: continued by id, then the whole history resent without it."""
    first = client.responses.create(model=MODEL, input="http turn 0")
    second = client.responses.create(model=MODEL, input="http turn 1", previous_response_id=first.id)
    history = [{"role": "user", "content": "http turn 0"}, *first.output,
               {"role": "user", "content": "http turn 1"}, *second.output,
               {"role": "user", "content": "http turn 2"}]
    third = client.responses.create(model=MODEL, input=history)
    return {"ids": [first.id, second.id, third.id]}


def lanes(client: openai.AsyncOpenAI) -> dict:
    """Two conversations on one socket's lanes, each turn of both at once."""
    async def run() -> dict:
        ids: dict[str, list[str]] = {"a": [], "b": []}
        async with client.responses.connect(websocket_connection_options=OPEN) as conn, \
                AsyncResponsesWebSocketSession(conn, limits=LIMITS) as session:
            lane = {name: session.lane(name) for name in ids}
            for n in range(3):
                for name in ids:
                    await lane[name].send({"type": "response.create", "model": MODEL, "input": f"lane {name} turn {n}",
                                           **({"previous_response_id": ids[name][-1]} if ids[name] else {})})
                a, b = await asyncio.gather(lane["a"].get_final_response(), lane["b"].get_final_response())
                ids["a"].append(a.id)
                ids["b"].append(b.id)
        return ids
    return asyncio.run(run())


def steer(client: openai.OpenAI) -> dict:
    """A response steered while it streams: the server ends it and makes a successor; the client goes on from
    the successor."""
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.response.create(model=MODEL, input="a long answer, please", store=False)
        events = iter(conn)
        steered = next(e for e in events if e.type == "response.created").response.id
        conn.response.steer(input="and mention lanes", previous_response_id=steered)
        kinds = []
        for event in events:
            kinds.append(event.type)
            if event.type == "response.completed":
                successor = event.response.id
                break
        conn.response.create(model=MODEL, input="thanks", previous_response_id=successor, store=False)
        after = final(conn).id
    return {"ids": [steered, successor, after], "events": kinds}


def in_flight(client: openai.OpenAI) -> dict:
    """A second response.create while the first still streams: refused; the first's answer goes on."""
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.response.create(model=MODEL, input="the first", store=False)
        events = iter(conn)
        first = next(e for e in events if e.type == "response.created").response.id
        conn.response.create(model=MODEL, input="too early", store=False)
        refused, done = None, None
        for event in events:
            if event.type == "error":
                refused = event.error.code
            elif event.type == "response.completed":
                done = event.response.id
            if refused and done:
                break
        conn.response.create(model=MODEL, input="after the first", previous_response_id=done, store=False)
        after = final(conn).id
    return {"ids": [first, done, after], "refused": refused}


def warm_up(client: openai.OpenAI) -> dict:
    """Codex's way: each session opens with a generate: false warm-up holding only the developer message, then
    continues from it; a resumed session on a new socket sends the history so far after its own warm-up."""
    developer = {"role": "developer", "content": "You are a coding agent."}
    ids, history = [], []
    for n in range(2):
        with client.responses.connect(websocket_connection_options=OPEN) as conn:
            conn.response.create(model=MODEL, input=[developer], generate=False, store=False)
            warm = final(conn).id
            history.append({"role": "user", "content": f"session turn {n}"})
            conn.response.create(model=MODEL, input=history, previous_response_id=warm, store=False)
            response = final(conn)
            history += response.output
            ids += [warm, response.id]
    return {"ids": ids}


def agents_runs(base_url: str) -> dict:
    """openai-agents' WebSocket transport: a run with a tool call per socket; the second run resends the first's
    items whole, the third goes on from the second's last response by id."""
    import agents

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"{city}: 21C"

    async def run(given: object, **options: object) -> object:
        client = openai.AsyncOpenAI(api_key="sk-ws-record", base_url=base_url, max_retries=0)
        provider = agents.OpenAIProvider(openai_client=client, use_responses_websocket=True)
        agent = agents.Agent(name="assistant", instructions="Be terse.", tools=[get_weather], model=MODEL)
        return await agents.Runner.run(agent, given, run_config=agents.RunConfig(model_provider=provider),
                                       **options)

    first = asyncio.run(run('call:get_weather({"city": "Paris"})'))
    rome = {"role": "user", "content": 'call:get_weather({"city": "Rome"})'}
    second = asyncio.run(run([*first.to_input_list(), rome]))
    third = asyncio.run(run('call:get_weather({"city": "Oslo"})', previous_response_id=second.last_response_id))
    return {"ids": [first.last_response_id, second.last_response_id, third.last_response_id]}


if __name__ == "__main__":
    scenario, base_url = sys.argv[1], sys.argv[2]
    if scenario == "agents_runs":
        print(json.dumps(agents_runs(base_url)))
        sys.exit()
    make = openai.AsyncOpenAI if scenario == "lanes" else openai.OpenAI
    print(json.dumps(globals()[scenario](make(api_key="sk-ws-record", base_url=base_url, max_retries=0))))
