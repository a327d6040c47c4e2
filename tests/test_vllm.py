"""vLLM itself as the upstream, through a real mitmdump: its stored chain drops
``role: system`` input items and feeds a function call sent after an assistant
message otherwise than the same history sent whole, and the proxy must notice
(``usage.input_tokens``) before the model loses anything.

The oracle of every request is the same client's direct run against vLLM: the
``usage.input_tokens`` of each request through the proxy equals the direct
full-history run's (temperature 0: the tiny model answers alike both times).
One vLLM (its Responses store on) serves the module; the last test restarts it
without its store."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from vllm_server import MODEL, VLLMServer, build_model

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vllm")
    server = VLLMServer(build_model(directory / "model"), directory, store=True)
    server.start()
    yield server
    server.stop()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def tool_round(n: int) -> list[dict]:
    """A call the client's agent made and its result (the tiny model calls no tool itself)."""
    call_id = f"call_{n}"
    return [{"type": "function_call", "call_id": call_id, "name": "get_weather",
             "arguments": json.dumps({"city": ["Paris", "Berlin", "Rome"][n % 3]})},
            {"type": "function_call_output", "call_id": call_id, "output": json.dumps({"temp": 20 + n})}]


def text_turns(n: int) -> list[list[dict]]:
    return [[user(f"Turn {k}: what is the weather like?")] for k in range(n)]


def tool_turns(n: int) -> list[list[dict]]:
    """Text turns, every other one after a function call and its output right
    after the assistant's answer (as when a model answers and calls at once)."""
    return [(tool_round(k) if k % 2 else []) + [user(f"Turn {k}: and the weather?")] for k in range(n)]


def full_history(base: str, turns: list[list[dict]], *, key: str, stream: bool = False,
                 first: list[dict] = (), sizes: list[int] | None = None) -> list[int]:
    """A full-history client's conversation; each request's usage.input_tokens
    (and, into ``sizes``, each request body's bytes)."""
    history, counts = list(first), []
    with httpx.Client(base_url=base, timeout=120, trust_env=False, headers={"authorization": f"Bearer {key}"}) as c:
        for new in turns:
            history += new
            body = {"model": MODEL, "input": history, "tools": TOOLS, "temperature": 0, "max_output_tokens": 6,
                    "stream": stream}
            answer = _answer(c.post("/v1/responses", content=json.dumps(body).encode(),
                                    headers={"content-type": "application/json"}), stream)
            if sizes is not None:
                sizes.append(len(json.dumps(body).encode()))
            counts.append(answer["usage"]["input_tokens"])
            history += answer["output"]
    return counts


def chained(base: str, turns: list[list[dict]], *, key: str, first: list[dict] = ()) -> list[int]:
    """A ``previous_response_id`` client's conversation; each request's usage.input_tokens."""
    previous, counts = None, []
    with httpx.Client(base_url=base, timeout=120, trust_env=False, headers={"authorization": f"Bearer {key}"}) as c:
        for n, new in enumerate(turns):
            body = {"model": MODEL, "input": (list(first) if n == 0 else []) + new, "tools": TOOLS,
                    "temperature": 0, "max_output_tokens": 6}
            if previous is not None:
                body["previous_response_id"] = previous
            answer = _answer(c.post("/v1/responses", json=body), False)
            counts.append(answer["usage"]["input_tokens"])
            previous = answer["id"]
    return counts


def _answer(response: httpx.Response, stream: bool) -> dict:
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    return next(e["response"] for e in events if e.get("type") == "response.completed")


def continued(proxy) -> int:
    return len(re.findall(r"stateful-responses: rewritten", proxy.output()))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_forward_mode_continues_text_and_never_a_chain_that_loses_tools_or_system_items(vllm, start_proxy, stream):
    """Text turns are continued; a conversation with function calls or a system
    item is compared once, found fed otherwise, and sent whole from then on."""
    proxy = start_proxy(vllm.url, "--set", "stateful_debug=true")
    key = f"sk-forward-{stream}"
    text, sizes = text_turns(6), []
    assert full_history(proxy.url, text, key=key, stream=stream, sizes=sizes) == full_history(vllm.url, text, key=key)
    assert continued(proxy) == 5
    tools = tool_turns(6)
    assert full_history(proxy.url, tools, key=key, stream=stream, sizes=sizes) \
        == full_history(vllm.url, tools, key=key)
    system = text_turns(4)
    assert full_history(proxy.url, system, key=key, stream=stream, first=[SYSTEM], sizes=sizes) \
        == full_history(vllm.url, system, key=key, first=[SYSTEM])
    output = proxy.output()
    assert "its stored chain does not keep" in output
    # savings stay where the chain is whole: a text conversation after all that is still continued
    before = continued(proxy)
    assert full_history(proxy.url, text_turns(3), key=key, stream=stream, sizes=sizes) \
        == full_history(vllm.url, text_turns(3), key=key)
    assert continued(proxy) == before + 2
    stats = dict(re.findall(r"(\w+)=(-?\d+)", [line for line in proxy.stop().splitlines() if "requests=" in line][-1]))
    print(f"\nvLLM forward mode: {len(sizes)} requests exact, {stats['continued']} continued, "
          f"{stats['retries']} answered by the turn sent whole, "
          f"{(sum(sizes) - int(stats['bytes_saved'])) / sum(sizes):.2f}x the bytes")


@pytest.mark.parametrize("emulate", ["off", "auto", "always"])
def test_previous_response_id_clients_get_the_whole_context(vllm, start_proxy, emulate):
    """A client chaining by id meets vLLM's lossy chain: ``off`` passes it (as
    without the proxy); ``auto`` and ``always`` must not hand a chain vLLM
    loses back to it. The oracle is the full-history run's counts."""
    proxy = start_proxy(vllm.url, "--set", f"stateful_emulate={emulate}", "--set", "stateful_debug=true")
    key = f"sk-chained-{emulate}"
    turns = tool_turns(5)
    direct = full_history(vllm.url, turns, key=key, first=[SYSTEM])
    through = chained(proxy.url, turns, key=key, first=[SYSTEM])
    if emulate == "off":
        assert through == chained(vllm.url, turns, key=key, first=[SYSTEM])  # untouched, lossy as vLLM is
        assert through != direct
    else:
        assert through == direct


def test_background_passes_through_and_its_answer_is_continued(vllm, start_proxy):
    """vLLM runs background responses with its store: the proxy passes the
    create and the polls, learns from the poll that finds it finished, and the
    next turn is continued from it with the same count as sent whole."""
    proxy = start_proxy(vllm.url, "--set", "stateful_debug=true")
    history = [user("Hello there")]
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False,
                      headers={"authorization": "Bearer sk-background"}) as c:
        created = c.post("/v1/responses", json={"model": MODEL, "input": history, "background": True,
                                                "temperature": 0})
        assert created.status_code == 200, created.text
        assert created.json()["status"] in ("queued", "in_progress")
        for _ in range(1200):
            polled = c.get(f"/v1/responses/{created.json()['id']}")
            if polled.json()["status"] == "completed":
                break
            time.sleep(0.05)
        assert polled.json()["status"] == "completed"
        history += polled.json()["output"] + [user("And now?")]
        answer = c.post("/v1/responses", json={"model": MODEL, "input": history, "temperature": 0})
    direct = httpx.post(f"{vllm.url}/v1/responses", json={"model": MODEL, "input": history, "temperature": 0},
                        timeout=60, headers={"authorization": "Bearer sk-background"})
    assert answer.json()["usage"]["input_tokens"] == direct.json()["usage"]["input_tokens"]
    assert continued(proxy) == 1


def test_after_a_restart_without_its_store(vllm, start_proxy):
    """vLLM restarted loses every stored response, and without its store keeps
    none: the continuation the proxy sends is refused and resent whole
    invisibly, and full history goes from then on; every count as direct."""
    proxy = start_proxy(vllm.url, "--set", "stateful_debug=true", "--set", "stateful_emulate=auto")
    key = "sk-restart"
    turns = text_turns(6)
    history, counts = [], []
    with httpx.Client(base_url=proxy.url, timeout=120, trust_env=False,
                      headers={"authorization": f"Bearer {key}"}) as c:
        for n, new in enumerate(turns):
            if n == 3:
                vllm.store = False
                vllm.restart()
            history += new
            answer = c.post("/v1/responses", json={"model": MODEL, "input": history, "tools": TOOLS,
                                                    "temperature": 0, "max_output_tokens": 6})
            assert answer.status_code == 200, answer.text
            counts.append(answer.json()["usage"]["input_tokens"])
            history += answer.json()["output"]
        chained_counts = chained(proxy.url, turns, key=key + "-chained")
    assert counts == full_history(vllm.url, turns, key=key)
    assert chained_counts == full_history(vllm.url, turns, key=key + "-chained")  # emulation expands for it
    assert "does not store responses" in proxy.output()
