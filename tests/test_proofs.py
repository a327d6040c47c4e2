"""The questions the addon asks an upstream before relying on it (through real
mitmdump in tests/test_proofs_integration.py, tests/test_gateway_integration.py
and the emulation tests): what each answer means, and the proofs themselves
with a clock the tests move: a GET that fails or is slow, a mark reset or
expired, an echo the listing cannot settle."""

import asyncio
import json

import pytest
from mitmproxy.test import tflow, tutils
import stateful_responses.proofs as proofs_module
from stateful_responses.counters import Counters
from stateful_responses.proofs import PROOF_TIMEOUT, RETRY_AFTER, Proofs, read_the_chain, reads_back
from stateful_responses.settings import Config
from stateful_responses.tenancy import Tenancy
from stateful_responses.upstreams import Upstreams

RESPONSE = json.dumps({"id": "resp_1", "object": "response", "output": []}).encode()


@pytest.mark.parametrize(("status", "body", "verdict"), [
    (200, RESPONSE, True),
    (200, b"<html>ok</html>", False),  # a gateway's page, not a response
    (200, json.dumps({"id": "resp_1"}).encode(), False),
    (404, b'{"error": {"message": "not found"}}', False),
    (400, b'{"error": {"code": "400"}}', False),
    (408, b"", None), (429, b"", None), (500, RESPONSE, None), (503, b"", None),  # not now: ask again later
])
def test_a_stored_response_read_back_proves_the_upstream_stores(status, body, verdict):
    assert reads_back(status, body) is verdict


def listing(n: int, more: bool = False) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": f"msg_{k}"} for k in range(n)], "has_more": more}).encode()


@pytest.mark.parametrize(("status", "body", "verdict"), [
    (200, listing(3), True),  # more than the one item sent: the chain was read
    (200, listing(1, more=True), True),
    (200, listing(1), False),  # only what was sent: the field was ignored
    (404, b"{}", None), (200, b"not json", None), (200, b"{}", None),  # no listing: unknown
])
def test_an_answers_input_items_tell_whether_it_read_its_chain(status, body, verdict):
    assert read_the_chain(status, body, items_sent=1) is verdict


# -- the proofs themselves, with a clock the tests move and GETs they answer ----------

SCOPE, LABEL, UPSTREAM = "scope", "http://upstream (test)", "http://upstream.test/v1"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Answers:
    """The upstream's answers to the proofs' GETs, one per GET, in order: a
    (status, body), a failure (str: no answer at all), or an Event to wait
    for first (a slow upstream)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, float | None]] = []  # (path, timeout)

    async def send(self, flow, request, why, kind="retry", timeout=None):
        self.sent.append((request.path, timeout))
        answer = self.answers.pop(0)
        if isinstance(answer, asyncio.Event):
            await answer.wait()
            answer = self.answers.pop(0)
        if isinstance(answer, str):
            return tutils.tresp(status_code=502), answer
        status, body = answer
        return tutils.tresp(status_code=status, content=body), None


class NoStore:
    async def get(self, table, keys):
        return {}

    def flush(self):
        return None

    async def written(self, done, timeout=1.0):
        return True


def proofs_over(answers: Answers, clock: Clock) -> Proofs:
    upstreams = Upstreams(Config(clock=clock), Tenancy())
    return Proofs(upstreams, answers, NoStore(), Counters())


def a_flow():
    return tflow.tflow(req=tutils.treq(method=b"POST", host="upstream.test", port=80, path=b"/v1/responses",
                                       headers=[(b"authorization", b"Bearer sk-x")]))


async def prove(proofs: Proofs, response_id: str = "resp_1") -> None:
    """A stored answer arrived: its proof starts; the next request waits for it."""
    proofs.start(a_flow(), SCOPE, LABEL, UPSTREAM, response_id)
    await proofs.settled(SCOPE)


@pytest.mark.parametrize("failure", [(503, b"{}"), (429, b""), "no answer within 10.0 s"], ids=["5xx", "429", "none"])
async def test_a_proof_that_could_not_finish_leaves_the_scope_unproven_and_is_tried_again_later(failure):
    clock, answers = Clock(), Answers(failure, (200, RESPONSE))
    proofs = proofs_over(answers, clock)
    await prove(proofs)
    assert proofs.upstreams.unproven(SCOPE) and not proofs.upstreams.continuable(SCOPE)  # full history goes
    clock.now += RETRY_AFTER - 1
    await prove(proofs, "resp_2")
    assert len(answers.sent) == 1  # a later stored answer, too soon: no second GET
    clock.now += 1
    await prove(proofs, "resp_3")
    assert [path for path, _ in answers.sent] == ["/v1/responses/resp_1", "/v1/responses/resp_3"]
    assert proofs.upstreams.continuable(SCOPE)
    assert {timeout for _, timeout in answers.sent} == {PROOF_TIMEOUT}  # a GET never answered is given up


async def test_requests_wait_for_a_slow_proof_until_proof_wait_after_it_started_and_no_longer(monkeypatch):
    wait = 1.0  # far apart from "no wait at all", however loaded the machine
    # The module these Proofs come from (a test that reloads the package leaves another under its name).
    monkeypatch.setattr(proofs_module, "PROOF_WAIT", wait)
    clock, slow = Clock(), asyncio.Event()
    proofs = proofs_over(Answers(slow, (200, RESPONSE)), clock)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await prove(proofs)
    elapsed = loop.time() - started  # the first request waited (a timer fires within its resolution)
    assert wait - 0.01 <= elapsed < 4 * wait and proofs.upstreams.unproven(SCOPE)
    clock.now += wait
    started = loop.time()
    for _ in range(5):  # every later request, while the proof is still slow: no wait at all
        await proofs.settled(SCOPE)
        await proofs.proven(SCOPE)
    assert loop.time() - started < wait / 2 and proofs.upstreams.unproven(SCOPE)
    slow.set()  # the answer comes, late: the verdict stands from then on
    for _ in range(10):
        await asyncio.sleep(0)
    assert proofs.upstreams.continuable(SCOPE)


async def test_a_reset_or_expired_mark_is_proved_again():
    clock, answers = Clock(), Answers((200, RESPONSE), (200, RESPONSE), (404, b"{}"))
    proofs = proofs_over(answers, clock)
    await prove(proofs)
    await prove(proofs, "resp_2")
    assert len(answers.sent) == 1 and proofs.upstreams.continuable(SCOPE)  # proven: asked once
    proofs.upstreams.clear()  # stateful.clear
    assert proofs.upstreams.unproven(SCOPE)
    await prove(proofs, "resp_3")
    assert len(answers.sent) == 2 and proofs.upstreams.continuable(SCOPE)
    clock.now += proofs.upstreams.config.ttl + 1  # the mark expired
    assert proofs.upstreams.unproven(SCOPE)
    await prove(proofs, "resp_4")
    assert len(answers.sent) == 3 and proofs.upstreams.has("unsupported", SCOPE)  # the answer now: 404


@pytest.mark.parametrize(("listing", "mark"), [
    ((200, listing(3)), "honours_previous"),
    ((200, listing(1)), "unsupported"),
    ((404, b'{"error": {"message": "Invalid URL"}}'), "refuses_previous"),  # no listing: the doubt stays
    ((200, b"<html></html>"), "refuses_previous"),
    ((503, b"{}"), "refuses_previous"),
    ("no answer within 10.0 s", "refuses_previous"),
], ids=["chain", "sent-alone", "404", "not-a-list", "5xx", "none"])
async def test_an_echo_in_another_spelling_is_settled_by_the_listing_and_any_doubt_stops_continuing(listing, mark):
    clock, answers = Clock(), Answers((200, RESPONSE), listing)
    proofs = proofs_over(answers, clock)
    await prove(proofs)
    proofs.start_echo(a_flow(), SCOPE, LABEL, UPSTREAM, "resp_2", items_sent=1)
    await proofs.settled(SCOPE)
    assert answers.sent[-1][0] == "/v1/responses/resp_2/input_items?limit=100"
    assert [kind for kind in ("honours_previous", "unsupported", "refuses_previous")
            if proofs.upstreams.has(kind, SCOPE)] == [mark]
    assert proofs.upstreams.continuable(SCOPE) is (mark == "honours_previous")
    proofs.start_echo(a_flow(), SCOPE, LABEL, UPSTREAM, "resp_3", items_sent=1)
    await proofs.settled(SCOPE)
    assert len(answers.sent) == 2  # settled either way: never asked again
