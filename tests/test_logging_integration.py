"""Nothing secret reaches any log. One conversation through each capability (forward mode over HTTP, the
WebSocket bridge with a refused continuation on its socket, store emulation, conversations the proxy keeps,
the router over two upstreams, state in Redis, the record file), under mitmdump printing every level with
``stateful_debug`` on, and under mitmweb, whose event log keeps every level and serves it at ``GET /events``.
A marker is in every credential (``Authorization``, ``api-key``, a ``?key=`` query, the Redis password) and
another in every prompt and instruction: neither may appear in anything either prints or keeps in its log,
while the lines the addon writes for operators (a socket opened, a fallback and why, the store) are there.

mitmdump runs with ``flow_detail=0``: from 1 on it lists each flow with its URL (the query included), and
from 3 its headers and bodies, with or without the addon: that is mitmproxy showing the traffic it was
asked to show, not a log line."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time

import httpx
import pytest
from harness import ADDON, Proxy, free_port, mitmdump_binary, wait_listening
from redis_server import start_redis_server
from stateful_responses.emulator import Emulator

CREDENTIAL = "MARKERKEY5e1d"  # in every credential the clients send, and in the Redis password
PROMPT = "MARKERPROMPT8b2c"  # in every prompt, instruction and upstream error message
STORE_UP = r"state in redis://127\.0\.0\.1:\d+/0\n|state store redis://127\.0\.0\.1:\d+/0 is back"
TOKEN = "stateful-logging-token"  # mitmweb 12's web token (not a marker: mitmweb names it at start)


@pytest.fixture
def upstreams():
    emulators = [Emulator().start() for _ in range(2)]
    yield emulators
    for emulator in emulators:
        emulator.stop()


@pytest.fixture
def redis_store(tmp_path):
    server = start_redis_server(tmp_path / "redis", password=f"{CREDENTIAL}-redis")
    yield server
    server.stop()


def start_proxy(tool: str, upstreams: list[Emulator], store: str) -> tuple[Proxy, int | None]:
    """mitmdump or mitmweb with every level shown, the addon's debug lines on, every capability at hand."""
    confdir, port = tempfile.mkdtemp(prefix="mitm-logs-"), free_port()
    args = [mitmdump_binary(tool), "--mode", f"reverse:{upstreams[0].url}", "--listen-host", "127.0.0.1",
            "--listen-port", str(port), "--set", f"confdir={confdir}", "--set", "termlog_verbosity=debug",
            "-s", str(ADDON), "--set", "stateful_debug=true", "--set", f"stateful_store={store}",
            "--set", "stateful_emulate=auto", "--set", "stateful_upstream_websocket=auto",
            "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams),
            "--set", f"stateful_record_file={confdir}/record.jsonl"]
    web_port = None
    if tool == "mitmweb":
        web_port = free_port()
        args += ["--web-host", "127.0.0.1", "--web-port", str(web_port), "--set", "web_open_browser=false"]
        if "web_password" in subprocess.run([args[0], "--options"], capture_output=True, text=True).stdout:
            args += ["--set", f"web_password={TOKEN}"]  # mitmweb 12 asks for a token
    else:
        args += ["--set", "flow_detail=0"]
    proxy = Proxy(args, port, confdir, owns_confdir=True).ready()
    if web_port is not None:
        try:
            wait_listening(web_port, proxy.process, "mitmweb", proxy.output)
        except BaseException:
            proxy.stop()
            raise
    return proxy, web_port


class Client:
    """One tenant: its credential in a bearer token, an api-key header and the query, each with the marker."""

    def __init__(self, proxy: Proxy, name: str) -> None:
        self.http = httpx.Client(
            base_url=proxy.url + "/v1", trust_env=False, timeout=30, params={"key": f"{CREDENTIAL}-{name}-query"},
            headers={"authorization": f"Bearer sk-{CREDENTIAL}-{name}", "api-key": f"{CREDENTIAL}-{name}-api"})

    def post(self, path: str, body: dict) -> dict:
        """The answer's JSON (a stream's final response); the prompt leads the body, where a frame's
        first bytes would show it."""
        answer = self.http.post(path, content=json.dumps(body).encode())
        assert answer.status_code == 200, answer.text
        if not body.get("stream"):
            return answer.json()
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        return next(e["response"] for e in events if e["type"] == "response.completed")

    def close(self) -> None:
        self.http.close()


def said(text: str) -> dict:
    return {"content": f"{PROMPT} {text}", "role": "user"}


def full_history(proxy: Proxy, name: str, turns: int, stream: bool = False, between=lambda turn: None) -> None:
    """A client that sends the whole conversation every turn, as most agent loops do."""
    client, history = Client(proxy, name), []
    for turn in range(turns):
        between(turn)
        history.append(said(f"turn {turn}: tell me about {turn}"))
        response = client.post("/responses", {"input": history, "instructions": f"{PROMPT} be terse",
                                              "model": "gpt-test", "store": False, "stream": stream})
        history += response["output"]
    client.close()


def both(upstreams: list[Emulator], command: dict) -> None:
    for upstream in upstreams:
        upstream.model.control(command)


def served(upstreams: list[Emulator], since: list[int]) -> list[dict]:
    """What the upstreams answered since ``since`` (each one's log length then)."""
    return [r for u, start in zip(upstreams, since, strict=True) for r in u.model.snapshot_log()[start:]]


def marks(upstreams: list[Emulator]) -> list[int]:
    return [len(u.model.snapshot_log()) for u in upstreams]


def store_up(proxy: Proxy) -> None:
    """Until the proxy has its Redis store. On a loaded machine the first connection may time out while
    mitmproxy starts: the proxy tries again every 2 s, and says the store is back once a request read it."""
    client, deadline = Client(proxy, "warm-up"), time.monotonic() + 30
    while not re.search(STORE_UP, proxy.output()):
        assert time.monotonic() < deadline, "the proxy never reached its Redis store"
        client.post("/responses", {"input": [said("warm up")], "model": "gpt-test"})
        time.sleep(0.5)
    client.close()


def every_capability(proxy: Proxy, upstreams: list[Emulator]) -> None:
    """A few turns through each capability, each checked to have been taken."""
    store_up(proxy)
    # Forward mode over HTTP: these upstreams refuse the WebSocket upgrade, so the history goes as continuations.
    both(upstreams, {"websocket": "refuse"})
    since = marks(upstreams)
    full_history(proxy, "forward", 3)
    assert any(r["transport"] == "http" and r["previous_response_id"] for r in served(upstreams, since))

    # The bridge: a continuation the socket refuses (its message holds the prompt marker) goes again in full.
    both(upstreams, {"websocket": None})
    since = marks(upstreams)

    def refuse_the_second(turn: int) -> None:
        if turn == 1:
            upstream = next(u for u, start in zip(upstreams, since, strict=True) if len(u.model.snapshot_log()) > start)
            upstream.model.control({"fail_next": [{"kind": "ws_error", "status": 400, "code": "invalid_value",
                                                   "message": f"{PROMPT} is not allowed", "when": "continued"}]})

    full_history(proxy, "bridge", 4, stream=True, between=refuse_the_second)
    bridged = served(upstreams, since)
    assert all(r["transport"] == "websocket" for r in bridged) and any(r.get("continued") for r in bridged)
    assert any(r["fault"] == "ws_error" for r in bridged)

    # Store emulation: an upstream that refuses previous_response_id; the proxy expands the chain.
    both(upstreams, {"websocket": "refuse", "stateless": "reject"})
    client, previous = Client(proxy, "chained"), None
    for turn in range(3):
        body = {"input": [said(f"turn {turn}")], "model": "gpt-test"}
        if previous is not None:
            body["previous_response_id"] = previous
        previous = client.post("/responses", body)["id"]
    client.close()

    # Conversations kept by the proxy: an upstream without the API.
    both(upstreams, {"stateless": None, "conversations": "absent"})
    client = Client(proxy, "conversation")
    conversation = client.post("/conversations", {"items": [said("the conversation's first item")]})["id"]
    for turn in range(2):
        client.post("/responses", {"input": [said(f"turn {turn}")], "conversation": conversation, "model": "gpt-test"})
    client.post("/conversations/" + conversation + "/items", {"items": [said("a note")]})
    client.close()
    assert {r["conversation"] for r in served(upstreams, [0, 0])} == {None}  # never sent upstream


def events(web_port: int) -> str:
    """mitmweb's event log, every entry's text."""
    answer = httpx.get(f"http://127.0.0.1:{web_port}/events", params={"token": TOKEN}, trust_env=False, timeout=10)
    assert answer.status_code == 200, answer.text
    return "\n".join(entry["message"] for entry in answer.json())


@pytest.mark.parametrize("tool", ["mitmdump", "mitmweb"])
def test_no_credential_and_no_prompt_text_in_any_log(tool, upstreams, redis_store):
    proxy, web_port = start_proxy(tool, upstreams, redis_store.url)
    kept = ""
    try:
        every_capability(proxy, upstreams)
        if web_port is not None:
            kept = events(web_port)
    finally:
        printed = proxy.stop()
    assert len(set(r["credential"] for u in upstreams for r in u.model.snapshot_log())) >= 4  # a tenant each
    assert all(len(u.model.snapshot_log()) >= 3 for u in upstreams)  # the router used both upstreams
    logs = {"the event log": kept} if web_port is not None else {}
    for where, logged in {**logs, "the output": printed}.items():
        for marker in (CREDENTIAL, PROMPT):
            at = logged.find(marker)
            assert at < 0, f"{marker!r} in {where}: …{logged[max(0, at - 600):at + 200]}…"
        # what the bridge, forward mode, store emulation and the state store tell operators
        assert re.search(STORE_UP, logged)
        for line in ["ws: opening a socket to http://127.0.0.1:",
                     "refused the WebSocket upgrade (404); HTTP from now on", "ws: continued from resp_",
                     "(after: the socket refused it (invalid_value))", "lacks the Conversations API"]:
            assert line in logged, line
