"""The router through real mitmdump over three emulators, each with
its own store: chains stay where their state is, new chains spread, and one
upstream stopping mid-run costs no client an error or its context."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from driver import ChainedConversation, Conversation, drop_nulls, expand_input
from stateful_responses.emulator import Emulator


@pytest.fixture
def upstreams():
    emulators = [Emulator().start() for _ in range(3)]
    yield emulators
    for emulator in emulators:
        emulator.stop()


class Tracked:
    """A client whose every request is found again in whichever upstream served it."""

    def __init__(self, conv, upstreams) -> None:
        self.conv, self.upstreams = conv, upstreams
        self.served: list[tuple[int, dict]] = []  # (upstream index, record) per answered request

    def turn(self, text: str) -> None:
        before = [len(u.model.snapshot_log()) for u in self.upstreams]
        self.conv.turn(text)
        for index, (u, start) in enumerate(zip(self.upstreams, before, strict=True)):
            self.served += [(index, r) for r in u.model.snapshot_log()[start:] if r["status_code"] == 200]

    def meant(self) -> list[list]:
        if isinstance(self.conv, ChainedConversation):
            return self.conv.meant
        return [s.body["input"] for s in self.conv.sent]


def test_chains_stay_with_their_state_spread_out_and_survive_an_upstream_stopping(upstreams, start_proxy):
    proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams),
                        "--set", "stateful_emulate=auto", "--set", "stateful_debug=true")
    clients = [Tracked(ChainedConversation(proxy.url, api_key=f"sk-chained-{n}"), upstreams) for n in range(3)]
    clients += [Tracked(Conversation(proxy.url, api_key=f"sk-full-{n}"), upstreams) for n in range(3)]
    for n in range(3):
        for k, client in enumerate(clients):
            client.turn(f"client {k} turn {n}")
    starts = Counter(client.served[0][0] for client in clients)
    assert all(starts[u] >= 2 for u in range(3)), starts  # each upstream started a third of the six chains
    for client in clients:  # and every chain stayed where it started
        assert len({index for index, _ in client.served}) == 1

    upstreams[1].stop()
    time.sleep(1.2)  # the router probes an upstream it has not heard from for a second
    for n in range(3, 6):
        for k, client in enumerate(clients):
            client.turn(f"client {k} turn {n}")  # no client sees an error
    for client in clients:
        client.conv.close()
        meant, served = client.meant(), client.served
        assert len(served) == len(meant)
        for number, (context, (_, record)) in enumerate(zip(meant, served, strict=True)):
            assert drop_nulls(record["context"]) == drop_nulls(expand_input(context)), f"request {number}"
        assert all(index != 1 for index, _ in served[-3:])  # nothing went to the stopped upstream
    not_found = [r for u in (upstreams[0], upstreams[2]) for r in u.model.snapshot_log()
                 if (r.get("error") or {}).get("code") == "previous_response_not_found"]
    assert not_found == []
    assert "refused a connection" in proxy.output()


@pytest.mark.parametrize("chained", [True, False], ids=["previous-response-id", "full-history"])
def test_a_5xx_fails_over_with_full_history_invisibly(upstreams, start_proxy, tmp_path, chained):
    record_file = tmp_path / "records.jsonl"
    proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams),
                        "--set", "stateful_emulate=auto", "--set", f"stateful_record_file={record_file}")
    conv = ChainedConversation(proxy.url) if chained else Conversation(proxy.url)
    client = Tracked(conv, upstreams)
    for n in range(2):
        client.turn(f"turn {n}")
    home = client.served[-1][0]
    upstreams[home].model.control({"fail_next": [{"kind": "status", "status": 503}]})
    client.turn("the home upstream fails this one")
    client.turn("and the chain goes on")
    conv.close()
    assert client.served[-2][0] != home  # answered elsewhere, the client never saw the 503
    for number, (context, (_, record)) in enumerate(zip(client.meant(), client.served, strict=True)):
        assert drop_nulls(record["context"]) == drop_nulls(expand_input(context)), f"request {number}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(record_file.read_text().splitlines()) < len(client.served):
        time.sleep(0.05)
    import json

    lines = [json.loads(line) for line in record_file.read_text().splitlines()]
    moved = [line for line in lines if any(e["field"] == "upstream" for e in line["audit"]["protocolMapping"]["lossy"])]
    assert len(moved) == 1


def test_a_5xx_on_a_turn_that_needs_its_home_reaches_the_client_and_its_retry_goes_home(upstreams, start_proxy):
    """Without store emulation, a previous_response_id turn can only be
    answered where its chain is stored: its 5xx reaches the client, whose
    SDK retries it, and the retry goes home again."""
    proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams))
    conv = ChainedConversation(proxy.url)
    conv.client = conv.client.with_options(max_retries=2)  # the openai SDK's default
    client = Tracked(conv, upstreams)
    for n in range(2):
        client.turn(f"turn {n}")
    home = client.served[-1][0]
    upstreams[home].model.control({"fail_next": [{"kind": "status", "status": 500, "when": "continued"}]})
    client.turn("the home upstream fails this one once")
    client.turn("and the chain goes on")
    conv.close()
    assert {index for index, _ in client.served} == {home}
    for number, (context, (_, record)) in enumerate(zip(client.meant(), client.served, strict=True)):
        assert drop_nulls(record["context"]) == drop_nulls(expand_input(context)), f"request {number}"
    elsewhere = [r for u in upstreams for r in u.model.snapshot_log() if r["status_code"] == 400]
    assert elsewhere == []  # never moved to an upstream that would answer previous_response_not_found


@pytest.mark.parametrize("how", ["restart", "replica"])
def test_a_chain_is_routed_home_after_a_restart_and_through_another_replica(upstreams, start_proxy, tmp_path, how):
    shared = f"sqlite:{tmp_path / 'shared.db'}"
    routing = ("--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams), "--set", f"stateful_store={shared}")
    first = start_proxy(upstreams[0].url, *routing)
    clients = [Tracked(ChainedConversation(first.url, api_key=f"sk-{n}"), upstreams) for n in range(3)]
    for client in clients:
        client.turn("opening")
    homes = [client.served[-1][0] for client in clients]
    assert len(set(homes)) == 3  # spread: one chain per upstream
    if how == "restart":
        port = first.port
        first.stop()
        second = start_proxy(upstreams[0].url, *routing, port=port)
    else:
        second = start_proxy(upstreams[0].url, *routing)
    for client in clients:
        client.conv.client = client.conv.client.with_options(base_url=second.url + "/v1")
        client.turn("after the " + how)
        client.conv.close()
    assert [client.served[-1][0] for client in clients] == homes
    for client in clients:
        for number, (context, (_, record)) in enumerate(zip(client.meant(), client.served, strict=True)):
            assert drop_nulls(record["context"]) == drop_nulls(expand_input(context)), f"request {number}"


def test_a_turn_whose_home_is_down_and_cannot_move_fails_fast_and_its_retry_goes_home(upstreams, start_proxy):
    """Without store emulation, a previous_response_id turn whose home refuses
    connections can go nowhere else: the client gets the 502 it would get
    without the addon (at once, never a hang), other chains carry on, and
    once the home is back the chain continues there."""
    import openai

    proxy = start_proxy(upstreams[0].url, "--set", "stateful_upstreams=" + ",".join(u.url for u in upstreams))
    conv = ChainedConversation(proxy.url)
    client = Tracked(conv, upstreams)
    client.turn("opening")
    home = client.served[-1][0]
    stopped = upstreams[home]
    port = stopped.port
    stopped.stop()
    time.sleep(1.2)  # the router probes an upstream it has not heard from for a second
    conv.client = conv.client.with_options(max_retries=0, timeout=15)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as failure:
        conv.turn("its home is down")
    assert failure.value.status_code == 502 and time.monotonic() - started < 5
    conv.history.pop()  # the client gives that turn up, and makes another once its upstream is back
    conv.meant.pop()
    other = Tracked(Conversation(proxy.url, api_key="sk-another"), upstreams)
    other.turn("a new chain meanwhile")  # the proxy's own upstream is down: routed elsewhere all the same
    assert other.served[-1][0] != home
    upstreams[home] = Emulator(port=port, model=stopped.model).start()
    client.upstreams = upstreams
    time.sleep(1.2)
    client.turn("its home is back")
    conv.close()
    other.conv.close()
    assert [index for index, _ in client.served] == [home, home]
    for number, (context, (_, record)) in enumerate(zip(client.meant(), client.served, strict=True)):
        assert drop_nulls(record["context"]) == drop_nulls(expand_input(context)), f"request {number}"
