"""The continuation record of WebSocket-mode clients through real mitmdump, in
reverse and regular mode (``HTTPS_PROXY`` and mitmproxy's CA): the openai SDK's
``responses.connect()`` over several sockets, a whole history resent after
turns continued by id (over HTTP too), two lanes at once, steering and a
request refused while another streams. One chain per conversation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stateful_responses.emulator import Emulator
from test_https_proxy_integration import self_signed
from test_node_clients_integration import node_clients  # noqa: F401 - a fixture
from test_record_integration import wait_for_lines

CLIENTS = Path(__file__).with_name("ws_record_clients.py")
# the first turn falls silent after its response.created until the client's next message (steering, a create too
# early): that message is sure to come while the turn runs
UNTIL_THE_NEXT_MESSAGE = {"kind": "ws_stall", "after_events": 1, "ms": 30_000, "until_message": True}


@pytest.fixture(params=["reverse", "regular"])
def run(request, start_proxy, tmp_path):
    """``run(scenario, lines, **control)``: the scenario's client through mitmdump in front of the emulator (set
    with ``control``); what it printed, the record file's lines (``lines`` of them, None: one per message the
    emulator answered) and the emulator's log."""
    regular = request.param == "regular"
    record = tmp_path / "record.jsonl"

    def go(scenario: str, count: int | None, **control) -> tuple[dict, list[dict], list[dict]]:
        cert, key = self_signed(tmp_path) if regular else (None, None)
        with Emulator(certfile=cert, keyfile=key) as emu:
            emu.model.control(control)
            extra = ("--set", f"ssl_verify_upstream_trusted_ca={cert}") if regular else ()
            proxy = start_proxy(emu.url, "--set", f"stateful_record_file={record}", *extra,
                                mode="regular" if regular else None)
            env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
            if regular:
                env.update(HTTPS_PROXY=proxy.url, NO_PROXY="", SSL_CERT_FILE=str(Path(proxy.confdir) /
                                                                                "mitmproxy-ca-cert.pem"))
            base_url = (emu.url if regular else proxy.url) + "/v1"
            result = subprocess.run([sys.executable, str(CLIENTS), scenario, base_url], env=env,
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr[-3000:]
            count = len(emu.model.snapshot_log()) if count is None else count  # one line per message answered
            try:
                wait_for_lines(record, count)
            except AssertionError:
                raise AssertionError(proxy.output()[-3000:]) from None
            log = emu.model.snapshot_log()
        lines = [json.loads(line) for line in record.read_text().splitlines()]
        assert len(lines) == count
        return json.loads(result.stdout), lines, log
    return go


def assert_one_linked_chain(turns: list[dict]) -> None:
    assert len({t["chainId"] for t in turns}) == 1, [t["chainId"] for t in turns]
    for before, after in zip(turns, turns[1:]):
        assert after["previousTurnId"] == before["turnId"]


def in_order(lines: list[dict]) -> list[dict]:
    """The turns, socket by socket in the order they opened (the record file's order), each in its place."""
    sockets = list(dict.fromkeys(line["flow"] for line in lines))
    return sorted(lines, key=lambda line: (sockets.index(line["flow"]), line.get("turn", 0)))


def test_a_conversation_over_several_sockets_is_one_chain_even_when_its_history_is_resent_whole(run):
    got, lines, log = run("sockets", 4)
    assert [r["socket"] for r in log][1:] == [log[0]["socket"]] + [log[0]["socket"] + 1, log[0]["socket"] + 2]
    assert [r["continued"] for r in log] == [False, True, True, False]  # the last resent its whole history
    turns = [line["continuation"] for line in in_order(lines)]
    assert_one_linked_chain(turns)
    assert [t["resumeFrom"]["responseId"] for t in turns[1:]] == got["ids"][:3]
    assert all(line["transport"] == {"client": "websocket", "upstream": "websocket"} for line in lines)


def test_an_http_history_resent_whole_after_a_turn_continued_by_id_stays_on_its_chain(run):
    got, lines, _ = run("http", 3)
    turns = [line["continuation"] for line in lines]
    assert_one_linked_chain(turns)
    assert turns[2]["resumeFrom"]["responseId"] == got["ids"][1]
    assert turns[2]["resumeFrom"]["previousResponseId"] is None  # found by its history, not by id


def test_two_lanes_of_one_socket_keep_their_own_chains_and_answers(run):
    got, lines, log = run("lanes", 6, slow_ms=15)
    assert {r["stream_id"] for r in log} == {"a", "b"}
    by_turn = {line["turn"]: line["continuation"] for line in lines}
    lane = {"a": [by_turn[n] for n in (0, 2, 4)], "b": [by_turn[n] for n in (1, 3, 5)]}
    for name, turns in lane.items():
        assert_one_linked_chain(turns)
        assert [t["resumeFrom"]["responseId"] for t in turns[1:]] == got[name][:2]
    assert lane["a"][0]["chainId"] != lane["b"][0]["chainId"]


def test_a_steered_responses_successor_is_a_turn_and_the_next_turn_goes_on_from_it(run):
    got, lines, log = run("steer", 3, fail_next=[UNTIL_THE_NEXT_MESSAGE])
    assert "response.steer.accepted" in got["events"] and "response.incomplete" in got["events"]
    steered, successor, after = got["ids"]
    assert [r["response_id"] for r in log] == [steered, successor, after]
    assert log[1]["previous_response_id"] == steered and log[2]["previous_response_id"] == successor
    turns = [line["continuation"] for line in in_order(lines)]
    assert_one_linked_chain(turns)
    assert [t["resumeFrom"]["responseId"] for t in turns[1:]] == [steered, successor]
    made = [e["reason"] for e in lines[1]["audit"]["protocolMapping"]["preserved"] if "successor" in e["reason"]]
    assert made and steered in made[0]


@pytest.mark.parametrize("code", ["conversation_already_has_active_response", "response_already_in_flight"])
def test_a_request_refused_while_another_streams_takes_the_refusal_and_leaves_the_answer(run, code):
    got, lines, log = run("in_flight", 3, fail_next=[UNTIL_THE_NEXT_MESSAGE], ws_busy_code=code)
    assert got["refused"] == code and got["ids"][0] == got["ids"][1]
    assert [r["status_code"] for r in log] == [200, 400, 200]
    first, refused, after = [line["continuation"] for line in in_order(lines)]
    assert after["previousTurnId"] == first["turnId"] and after["chainId"] == first["chainId"]
    assert after["resumeFrom"]["responseId"] == got["ids"][0]
    assert refused["chainId"] != first["chainId"] and refused["previousTurnId"] is None


def test_a_resumed_codex_session_opens_a_chain_at_its_warm_up(run):
    got, lines, log = run("warm_up", 4)
    assert [r["generate"] for r in log] == [False, True, False, True] and log[3]["input_items"] == 3
    first_warm_up, first, second_warm_up, second = [line["continuation"] for line in in_order(lines)]
    assert_one_linked_chain([first_warm_up, first])
    assert_one_linked_chain([second_warm_up, second])
    assert second["chainId"] != first["chainId"] and second_warm_up["previousTurnId"] is None
    assert second["resumeFrom"]["responseId"] == got["ids"][2]


def test_openai_agents_runs_over_their_own_sockets_are_one_chain(run):
    got, lines, log = run("agents_runs", None)
    assert [r["socket"] - log[0]["socket"] for r in log] == [0, 0, 1, 1, 2, 2]  # a tool call and its answer each
    # whole histories in the first two runs (the second resends the first's), continued by id in the third
    assert [(r["continued"], r["input_items"]) for r in log] == [(False, 1), (False, 3), (False, 5), (False, 7),
                                                                  (True, 1), (True, 1)]
    turns = [line["continuation"] for line in in_order(lines)]
    assert_one_linked_chain(turns)
    assert turns[4]["resumeFrom"]["previousResponseId"] == got["ids"][1]  # the third run, on from the second


def test_openai_agents_js_runs_over_their_own_sockets_are_one_chain(node_clients, emulator, start_proxy, tmp_path):
    record = tmp_path / "record.jsonl"
    proxy = start_proxy(emulator.url, "--set", f"stateful_record_file={record}")  # it ignores HTTPS_PROXY
    # Node.js 20 has its global WebSocket (undici's, which takes headers) behind a flag; later ones always
    major = int(subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.lstrip("v").split(".")[0])
    flags = ["--experimental-websocket"] if major < 22 else []
    result = subprocess.run(["node", *flags, "openai_agents_websocket.mjs", proxy.url + "/v1"],
                            cwd=node_clients, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    got, log = json.loads(result.stdout), emulator.model.snapshot_log()
    wait_for_lines(record, len(log))
    assert [r["socket"] - log[0]["socket"] for r in log] == [0, 0, 1, 1, 2, 2]  # a tool call and its answer each
    # whole histories in the first two runs (the second resends the first's), continued by id in the third
    assert [r["previous_response_id"] is not None for r in log] == [False, False, False, False, True, True]
    turns = [line["continuation"] for line in in_order([json.loads(line) for line in record.read_text().splitlines()])]
    assert_one_linked_chain(turns)
    assert turns[4]["resumeFrom"]["previousResponseId"] == got["ids"][1]
