"""WebSocket-mode clients for an upstream WITHOUT the mode, which the proxy
serves: the openai SDK's ``responses.connect()`` (chains with and without
``store``, lanes, warm-ups, errors) and openai-agents' WebSocket transport.
Run as a process of its own so that the environment alone (``HTTPS_PROXY``,
``SSL_CERT_FILE``) can put mitmproxy in between as a regular proxy.
``python ws_served_clients.py SCENARIO BASE_URL`` prints, as JSON, what the
client got and what it meant (each turn's whole context, as the client's
history holds it)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import openai
from openai.lib.responses_websocket import AsyncResponsesWebSocketSession, ResponsesWebSocketLimits

MODEL = os.environ.get("WS_MODEL", "gpt-test")
KEY = os.environ.get("WS_KEY", "sk-ws-served")
OPEN = {"open_timeout": 60}  # a busy machine's regular proxy mints a certificate meanwhile
LIMITS = ResponsesWebSocketLimits(max_lanes=4, max_events_per_lane=256, max_events=512, max_bytes_per_lane=1 << 22,
                                  max_bytes=1 << 23)


def _dump(item) -> dict:
    return item.model_dump(exclude_unset=True) if hasattr(item, "model_dump") else item


def until_done(conn) -> tuple[list, object]:
    """The socket's events until a response ends (or an error): their types, and the last one."""
    types = []
    for event in conn:
        types.append(event.type)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return types, event
    raise AssertionError("the socket closed mid-turn")


def chain(client: openai.OpenAI, store: bool | None, turns: int = 3, sockets: int = 1) -> dict:
    """A conversation continued by previous_response_id on one socket (or, for ``sockets`` > 1, moved to a new
    socket each turn: continued by id from the upstream's storage)."""
    ids, meant, history, sequences = [], [], [], []
    store_arg = {} if store is None else {"store": store}
    conn_cm = None
    for n in range(turns):
        if conn_cm is None or sockets > 1:
            if conn_cm is not None:
                conn_cm.__exit__(None, None, None)
            conn_cm = client.responses.connect(websocket_connection_options=OPEN)
            conn = conn_cm.__enter__()
        text = f"turn {n} of a {'stored' if store is not False else 'store:false'} chain"
        conn.response.create(model=MODEL, input=text, **store_arg,
                             **({"previous_response_id": ids[-1]} if ids else {}))
        types, last = until_done(conn)
        assert last.type == "response.completed", last
        response = last.response
        history.append({"role": "user", "content": text})
        meant.append(list(history))
        history += [_dump(item) for item in response.output]
        ids.append(response.id)
        sequences.append(types)
    conn_cm.__exit__(None, None, None)
    return {"ids": ids, "meant": meant, "events": sequences}


def stored(client):
    return chain(client, None)


def store_false(client):
    return chain(client, False)


def across_sockets(client):
    return chain(client, None, sockets=3)


def errors(client: openai.OpenAI) -> dict:
    """What the mode refuses, each as an error event with its status: an unknown store:false parent, a stream_id
    out of rules, background, a steer; then a turn goes on as normal on the same socket."""
    got = {}
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.response.create(model=MODEL, input="the upstream refuses this one")  # the test's fault
        got["upstream_refusal"] = until_done(conn)[1].model_dump()
        conn.response.create(model=MODEL, input="x", store=False, previous_response_id="resp_nowhere")
        got["not_found"] = until_done(conn)[1].model_dump()
        conn.send({"type": "response.create", "model": MODEL, "input": "x", "stream_id": "bad id!"})
        got["bad_lane"] = until_done(conn)[1].model_dump()
        conn.send({"type": "response.create", "model": MODEL, "input": "x", "background": True})
        got["background"] = until_done(conn)[1].model_dump()
        conn.send({"type": "response.processed", "response_id": "resp_x"})  # Codex's ack: ignored silently
        conn.send({"type": "response.steer", "previous_response_id": "resp_x",
                   "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "s"}]}]})
        steer = next(iter(conn))
        got["steer"] = steer.model_dump() if hasattr(steer, "model_dump") else steer
        conn.response.create(model=MODEL, input="after the refusals")
        types, last = until_done(conn)
        got["after"] = {"type": last.type, "events": types}
    return got


def warm_up(client: openai.OpenAI) -> dict:
    """Codex's start: a generate:false warm-up with the instructions' message, then a turn continuing it."""
    developer = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]}
    with client.responses.connect(websocket_connection_options=OPEN) as conn:
        conn.send({"type": "response.create", "model": MODEL, "input": [developer], "generate": False,
                   "store": False})
        types, warm = until_done(conn)
        user = {"role": "user", "content": "after the warm-up"}
        conn.response.create(model=MODEL, input=[user], store=False, previous_response_id=warm.response.id)
        _, answer = until_done(conn)
    return {"warm_events": types, "warm_id": warm.response.id, "warm_output": len(warm.response.output),
            "meant": [[developer, user]], "id": answer.response.id}


def lanes(client: openai.AsyncOpenAI) -> dict:
    """Two conversations on one socket's lanes, each turn of both at once."""
    async def run() -> dict:
        got: dict = {"a": [], "b": [], "meant": {"a": [], "b": []}}
        async with client.responses.connect(websocket_connection_options=OPEN) as conn, \
                AsyncResponsesWebSocketSession(conn, limits=LIMITS) as session:
            lane = {name: session.lane(name) for name in ("a", "b")}
            history = {"a": [], "b": []}
            for n in range(3):
                for name in ("a", "b"):
                    text = f"lane {name} turn {n}"
                    history[name].append({"role": "user", "content": text})
                    got["meant"][name].append(list(history[name]))
                    await lane[name].send({"type": "response.create", "model": MODEL, "input": text, "store": False,
                                           **({"previous_response_id": got[name][-1]} if got[name] else {})})
                a, b = await asyncio.gather(lane["a"].get_final_response(), lane["b"].get_final_response())
                for name, response in (("a", a), ("b", b)):
                    got[name].append(response.id)
                    history[name] += [_dump(item) for item in response.output]
        return got
    return asyncio.run(run())


def agents_runs(base_url: str) -> dict:
    """openai-agents' WebSocket transport (no HTTP fallback of its own): a run with a tool call, then a run
    continuing it by previous_response_id."""
    import agents

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"{city}: 21C"

    async def run(given: object, **options: object) -> object:
        client = openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0)
        provider = agents.OpenAIProvider(openai_client=client, use_responses_websocket=True)
        agent = agents.Agent(name="assistant", instructions="Be terse.", tools=[get_weather], model=MODEL)
        return await agents.Runner.run(agent, given, run_config=agents.RunConfig(model_provider=provider),
                                       **options)

    first = asyncio.run(run('call:get_weather({"city": "Paris"})'))
    second = asyncio.run(run('call:get_weather({"city": "Oslo"})', previous_response_id=first.last_response_id))
    return {"ids": [first.last_response_id, second.last_response_id], "outputs": [str(first.final_output),
                                                                                  str(second.final_output)]}


if __name__ == "__main__":
    scenario, base_url = sys.argv[1], sys.argv[2]
    if scenario == "agents_runs":
        print(json.dumps(agents_runs(base_url)))
        sys.exit()
    make = openai.AsyncOpenAI if scenario == "lanes" else openai.OpenAI
    print(json.dumps(globals()[scenario](make(api_key=KEY, base_url=base_url, max_retries=0)),
                     default=str))
