"""WebSocket-mode clients over an upstream WITHOUT the mode, served by the
proxy itself (``stateful_client_websocket=auto``), through real mitmdump in
reverse and regular mode (``HTTPS_PROXY`` and mitmproxy's CA): the openai
SDK's ``responses.connect()`` (stored chains, ``store: false`` chains from the
socket's memory, emulated chains, lanes, warm-ups, errors) and openai-agents'
WebSocket transport. The emulator is the upstream, its WebSocket mode off
(``{"websocket": "refuse"}``: 404 to the upgrade). Every turn: what the
upstream saw equals what the client meant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from driver import expand_input, meaning, without_comparisons
from stateful_responses.emulator import Emulator
from test_https_proxy_integration import self_signed
from test_node_clients_integration import node_clients  # noqa: F401 - a fixture
from test_record_integration import wait_for_lines

CLIENTS = Path(__file__).with_name("ws_served_clients.py")


@pytest.fixture(params=["reverse", "regular", "transparent"])
def run(request, start_proxy, tmp_path):
    """``run(scenario, *options, **control)``: the scenario's client through mitmdump in front of the emulator
    (its WebSocket mode off unless ``websocket`` is given); what the client printed, the emulator's log, the
    record file's lines and mitmdump's output. Transparent mode without root networking: mitmproxy's lookup of
    a redirected connection's original destination is replaced by one naming the emulator, whose certificate
    names localhost only (the probe upgrade must use the Host header's name)."""
    mode = request.param
    record = tmp_path / "record.jsonl"

    def go(scenario: str, *options: str, lines: int = 0, **control) -> tuple[dict, list[dict], list[dict], str]:
        cert, key = self_signed(tmp_path, dns_name="localhost") if mode != "reverse" else (None, None)
        with Emulator(certfile=cert, keyfile=key) as emu:
            emu.model.control({"websocket": "refuse", **control})
            extra: tuple = ("--set", f"ssl_verify_upstream_trusted_ca={cert}") if mode != "reverse" else ()
            if mode == "transparent":
                original_destination = tmp_path / "original_destination.py"
                original_destination.write_text("from mitmproxy import platform\n"
                                                f"platform.original_addr = lambda sock: ('127.0.0.1', {emu.port})\n")
                extra += ("-s", str(original_destination))
            proxy = start_proxy(emu.url, "--set", f"stateful_record_file={record}", "--set", "stateful_store=memory",
                                "--set", "stateful_debug=true", *extra, *options,
                                mode=None if mode == "reverse" else mode)
            env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
            ca = str(Path(proxy.confdir) / "mitmproxy-ca-cert.pem")
            if mode == "regular":
                env.update(HTTPS_PROXY=proxy.url, NO_PROXY="", SSL_CERT_FILE=ca)
            elif mode == "transparent":
                env.update(SSL_CERT_FILE=ca)
            base_url = {"reverse": proxy.url, "regular": emu.url.replace("127.0.0.1", "localhost"),
                        "transparent": f"https://localhost:{proxy.port}"}[mode] + "/v1"
            result = subprocess.run([sys.executable, str(CLIENTS), scenario, base_url], env=env,
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr[-3000:] + proxy.output()[-3000:]
            if lines:
                wait_for_lines(record, lines)
            log = emu.model.snapshot_log()
        written = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        return json.loads(result.stdout), log, written, proxy.output()
    return go


def responses(log: list[dict]) -> list[dict]:
    """The upstream's Responses requests, less the proxy's comparisons (see driver.without_comparisons)."""
    return [r for r in without_comparisons(log) if r.get("protocol") == "openai-responses" and "context" in r]


def assert_meant(meant: list[list], log: list[dict]) -> None:
    """Each turn the upstream answered saw the context the client meant (a string input is the user message it
    stands for, as the API reads it; ids and statuses of echoed items aside)."""
    seen = responses(log)
    assert len(seen) == len(meant), (len(seen), len(meant))
    for n, (client, upstream) in enumerate(zip(meant, seen, strict=True)):
        assert meaning(upstream["context"]) == meaning(expand_input(client)), f"turn {n}"


def test_a_stored_chain_is_served_and_continued_upstream_by_the_engine(run):
    got, log, lines, output = run("stored", lines=3)
    assert all(r["transport"] == "http" for r in responses(log))  # the upstream has no socket: HTTP, each turn
    assert [r["continued"] for r in responses(log)] == [False, True, True]  # forward mode continued it by id
    assert [r["input_items"] for r in responses(log)] == [1, 1, 1]  # only the new item went up
    assert_meant(got["meant"], log)
    assert all(events[-1] == "response.completed" for events in got["events"])
    # the record: one line per socket turn, one chain, on the socket's flow
    assert [line["turn"] for line in lines] == [0, 1, 2] and len({line["flow"] for line in lines}) == 1
    assert all(line["transport"] == {"client": "websocket", "upstream": "http"} for line in lines)
    turns = [line["continuation"] for line in lines]
    assert len({t["chainId"] for t in turns}) == 1
    assert "refused the WebSocket upgrade (404)" in output


def test_a_store_false_chain_is_served_from_the_sockets_memory_and_never_stored(run):
    got, log, _, _ = run("store_false")
    assert [r["store"] for r in responses(log)] == [False, False, False]  # never forced
    assert [r["continued"] for r in responses(log)] == [False, False, False]
    assert [r["input_items"] for r in responses(log)] == [1, 3, 5]  # expanded from the socket's memory
    assert_meant(got["meant"], log)


def test_a_chain_moving_between_sockets_is_expanded_by_store_emulation_on_a_stateless_upstream(run):
    got, log, _, _ = run("across_sockets", "--set", "stateful_emulate=auto", stateless="reject")
    assert [r["previous_response_id"] for r in responses(log)] == [None, None, None]  # the upstream stores nothing
    assert_meant(got["meant"], log)


def test_a_chain_moving_between_sockets_goes_on_by_id_where_the_upstream_stores(run):
    got, log, _, _ = run("across_sockets")
    assert [r["continued"] for r in responses(log)] == [False, True, True]
    assert_meant(got["meant"], log)


def test_two_lanes_run_at_once_each_with_its_own_memory(run):
    got, log, _, _ = run("lanes", slow_ms=10)
    seen = responses(log)
    assert len(seen) == 6 and all(r["store"] is False for r in seen)
    for name in ("a", "b"):
        mine = [r for r in seen if f"lane {name} turn" in json.dumps(r["context"][-1])]
        assert [meaning(r["context"]) for r in mine] == [meaning(expand_input(m)) for m in got["meant"][name]]


def test_a_warm_up_is_answered_by_the_proxy_and_continued_from_its_memory(run):
    got, log, _, _ = run("warm_up")
    assert got["warm_events"] == ["response.created", "response.completed"] and got["warm_output"] == 0
    assert len(responses(log)) == 1  # the warm-up never reached the upstream
    assert_meant(got["meant"], log)


def test_what_the_mode_refuses_comes_as_error_events_with_their_status(run):
    got, log, _, _ = run("errors", fail_next=[{"kind": "status", "status": 503}])
    assert got["upstream_refusal"]["type"] == "error" and got["upstream_refusal"]["status"] == 503
    assert got["upstream_refusal"]["error"]["type"] == "server_error"  # the upstream's own error object
    assert got["not_found"]["status"] == 400
    assert got["not_found"]["error"]["code"] == "previous_response_not_found"
    assert got["not_found"]["error"]["message"] == "Previous response with id 'resp_nowhere' not found."
    assert got["bad_lane"]["status"] == 400 and got["bad_lane"]["error"]["code"] == "invalid_stream_id"
    assert got["background"]["status"] == 400 and got["background"]["error"]["param"] == "background"
    assert got["steer"]["type"] == "response.steer.failed"
    assert got["steer"]["error"]["code"] == "steering_not_supported"
    assert got["after"]["type"] == "response.completed"  # response.processed was ignored: no stray event
    sent = [json.dumps(r.get("body") or {}) for r in log]
    assert not any('"generate"' in s or '"stream_id"' in s or '"response.create"' in s for s in sent)


def test_openai_agents_websocket_transport_runs_over_an_upstream_without_the_mode(run):
    got, log, _, _ = run("agents_runs")
    seen = responses(log)
    assert len(seen) == 4 and all(r["transport"] == "http" for r in seen)  # a tool call and its answer, twice
    assert {"type": "function_call_output", "call_id": seen[0]["output"][0]["call_id"], "output": "Paris: 21C"} \
        in [{k: item.get(k) for k in ("type", "call_id", "output")} for item in seen[1]["context"]]
    # the second run continued the first by id: its first turn saw the whole first run
    assert seen[2]["context"][: len(seen[1]["context"]) + 1] == seen[1]["context"] + seen[1]["output"]


def test_an_upstream_with_the_mode_keeps_its_sockets(start_proxy, tmp_path):
    """The guard: where the upstream accepts the upgrade, the client's socket passes through as before."""
    with Emulator() as emu:
        proxy = start_proxy(emu.url, "--set", "stateful_store=memory")
        result = subprocess.run([sys.executable, str(CLIENTS), "stored", proxy.url + "/v1"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        log = emu.model.snapshot_log()
    assert [r["transport"] for r in responses(log)] == ["websocket"] * 3
    assert_meant(json.loads(result.stdout)["meant"], log)


def test_off_leaves_the_upgrade_to_the_upstream(start_proxy):
    with Emulator() as emu:
        emu.model.control({"websocket": "refuse"})
        proxy = start_proxy(emu.url, "--set", "stateful_client_websocket=off")
        result = subprocess.run([sys.executable, str(CLIENTS), "stored", proxy.url + "/v1"], capture_output=True,
                                text=True, timeout=120)
    assert result.returncode != 0 and "404" in result.stderr


def test_openai_agents_js_websocket_transport_runs_over_an_upstream_without_the_mode(node_clients, start_proxy,
                                                                                       tmp_path):
    """The TypeScript Agents SDK (``useResponsesWebSocket``): three runs, the second resending the first's
    history whole, the third continuing the second by id; it ignores HTTPS_PROXY: reverse mode only."""
    record = tmp_path / "record.jsonl"
    with Emulator() as emu:
        emu.model.control({"websocket": "refuse"})
        proxy = start_proxy(emu.url, "--set", f"stateful_record_file={record}", "--set", "stateful_store=memory")
        major = int(subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.lstrip("v")
                    .split(".")[0])
        flags = ["--experimental-websocket"] if major < 22 else []
        result = subprocess.run(["node", *flags, "openai_agents_websocket.mjs", proxy.url + "/v1"],
                                cwd=node_clients, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:] + proxy.output()[-3000:]
        wait_for_lines(record, 6)
        seen = responses(emu.model.snapshot_log())
    assert len(seen) == 6 and all(r["transport"] == "http" for r in seen)  # a tool call and its answer, thrice
    # each run's second turn saw its first turn whole, and the third run saw the second's whole conversation
    for first, second in ((0, 1), (2, 3), (4, 5)):
        assert seen[second]["context"][: len(seen[first]["context"])] == seen[first]["context"]
    assert meaning(seen[4]["context"][: len(seen[3]["context"]) + 1]) == meaning(seen[3]["context"]
                                                                                + seen[3]["output"][:1])
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(line["transport"] == {"client": "websocket", "upstream": "http"} for line in lines)
    assert len({line["continuation"]["chainId"] for line in lines}) == 1  # one conversation, across sockets
