"""Before anything relies on an upstream storing responses, ask it to read one
back: ``GET …/responses/{id}`` with the credential that made it. And where a
continuation's answer echoes its ``previous_response_id`` in another spelling
(gateways re-encode ids), or not at all, ask what the answer was made from:
``GET …/responses/{id}/input_items`` lists the chain's items too, or only the
ones sent when the upstream ignored the field.

An answer's ``store: true`` can be an echo of the request (a gateway bridging
onto chat completions stores nothing and still says so), so the word of an
answer is not proof. One GET per upstream + credential, started as soon as the
first stored answer arrives, sent the way mitmproxy sends the client's own
requests (reverse or upstream mode, TLS options); the requests of that
upstream + credential wait for it before they are planned, until
``PROOF_WAIT`` after it started at most (a slow proof delays no request
longer, however many come). The verdict is a mark in the state store, so
replicas and restarts reuse it; a proof that could not finish (a 5xx, a reset,
no answer within ``PROOF_TIMEOUT``) leaves the upstream unproven, full history
goes out, and a later stored answer tries again (``RETRY_AFTER`` after it).

And where a host in regular or transparent mode is asked for ``/conversations``
before anything showed it is an OpenAI-compatible API (openai-agents'
session starts there), ``GET …/models`` tells: such an API lists its models.

An echo the listing cannot settle (the upstream has no listing, or it failed)
leaves a doubt no later answer can lift: that upstream + credential is taken
to ignore the field, and full history goes to it from then on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from typing import Any
from urllib.parse import quote, urlsplit

from mitmproxy import http

from .bounded import Bounded
from .counters import Counters
from .flows import internal_error
from .replays import Replays
from .state.access import StateAccess
from .upstreams import MARKS, Upstreams

logger = logging.getLogger(__name__)

PROOF_WAIT = 2.0  # requests wait for their upstream's proof until this long after it started, at most
PROOF_TIMEOUT = 10.0  # a proof's GET not answered within this is given up
RETRY_AFTER = 30.0  # an unfinished proof is tried again no sooner than this after it started
RECOGNIZE_TIMEOUT = 10.0  # a host's GET …/models, which a client's first conversations call waits for, at most
UNKNOWN_ROUTE_PATH = "/stateful-responses-no-such-route"  # a path no API has, to see how an upstream answers one
UNKNOWN_ROUTE = b"<route>"
LOOK_AGAIN = 1.0  # the store is asked for another replica's proof of a scope at most this often
_DROPPED_HEADERS = ("content-length", "content-type", "content-encoding", "transfer-encoding")


def _json_object(body: bytes | None) -> dict:
    """The JSON object an answer holds, or an empty one."""
    try:
        answer = json.loads(body or b"")
    except (ValueError, RecursionError):
        return {}
    return answer if isinstance(answer, dict) else {}


def read_the_chain(status: int, body: bytes | None, items_sent: int) -> bool | None:
    """The verdict of an echo proof's answer: True (the answer was made from
    more than the items sent: the chain was read), False (from the items sent
    alone), None (unknown: the upstream cannot list them)."""
    listed = _json_object(body) if status < 400 else {}
    if not isinstance(listed.get("data"), list):
        return None
    return len(listed["data"]) > items_sent or listed.get("has_more") is True


def lists_models(status: int, body: bytes | None) -> bool:
    """Whether an answer to ``GET …/models`` is an OpenAI-compatible API's
    list of models (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM and smg all
    answer one): ``object: list`` and ``data`` a list of objects with an
    ``id``, each ``object: model``."""
    listed = _json_object(body) if status < 300 else {}
    data = listed.get("data")
    return listed.get("object") == "list" and isinstance(data, list) and all(
        isinstance(model, dict) and isinstance(model.get("id"), str) and model.get("object") == "model"
        for model in data)


def _without_route(body: bytes, method: str, path: str) -> bytes:
    """An error body with the request's method and path (which unknown-route
    errors name: ``Invalid URL (GET /v1/x)``) taken out."""
    return body.replace(f"{method} {path}".encode(), UNKNOWN_ROUTE).replace(path.encode(), UNKNOWN_ROUTE)


def same_as_unknown_route(status: int, body: bytes, method: str, path: str,
                          unknown: tuple[int, bytes] | None) -> bool:
    """Whether a 404 to ``method path`` is the upstream's answer to any route
    it does not have (``unknown``, from ``Proofs.unknown_route``): evidence
    about the route, where an API's own 404 of an id it does not hold
    ("Conversation not found") is evidence about one id only."""
    return unknown is not None and unknown == (status, _without_route(body, method, path))


def reads_back(status: int, body: bytes | None) -> bool | None:
    """The verdict of a proof's answer: True (the response came back), False
    (the upstream cannot read it: any 4xx but 408 and 429), None (unknown: try
    again later)."""
    if status in (408, 429) or status >= 500:
        return None
    answer = _json_object(body) if status < 400 else {}
    return isinstance(answer.get("id"), str) and isinstance(answer.get("output"), list)


class Proofs:
    def __init__(self, upstreams: Upstreams, replays: Replays, state: StateAccess, counters: Counters) -> None:
        self.upstreams = upstreams
        self.replays = replays
        self.state = state
        self.counters = counters
        self._running: dict[str, tuple[asyncio.Task, float]] = {}  # scope -> its proof under way, since when
        self._tried = Bounded(4096)  # scope -> when its last unfinished storage proof started
        self._looked = Bounded(4096)  # scope -> when the store was last asked for its proof

    def _now(self) -> float:
        return self.upstreams.config.clock()

    def start(self, flow: http.HTTPFlow, scope: str, label: str, upstream: str, response_id: str) -> None:
        """Prove ``scope`` (``upstream``, a base URL, as seen by ``flow``'s
        credential) stores responses, with the stored ``response_id`` ``flow``
        was just answered with, unless it is proven, disproven or being proven."""
        now = self._now()
        if not self.upstreams.unproven(scope) or scope in self._running \
                or now < self._tried.get(scope, float("-inf")) + RETRY_AFTER:
            return
        self._tried.put(scope, now)
        self._run(scope, self._prove_storage(flow, scope, label, upstream, response_id))

    def start_echo(self, flow: http.HTTPFlow, scope: str, label: str, upstream: str, response_id: str,
                   items_sent: int) -> None:
        """Find out whether the continuation ``flow`` was just answered with
        (``response_id``, echoing the id sent in another spelling, or none)
        was made from its chain, unless that is known or being found out."""
        if self.upstreams.has("honours_previous", scope) or self.upstreams.cannot_continue(scope) \
                or scope in self._running:
            return
        self._run(scope, self._prove_echo(flow, scope, label, upstream, response_id, items_sent))

    def _run(self, scope: str, proof: Coroutine[Any, Any, asyncio.Future | None]) -> None:
        task = asyncio.get_running_loop().create_task(self._finally_done(scope, proof))
        if not task.done():  # an eager task (mitmproxy 12) that never waited is over, its entry already dropped
            self._running[scope] = (task, self._now())

    async def _finally_done(self, scope: str,
                            proof: Coroutine[Any, Any, asyncio.Future | None]) -> asyncio.Future | None:
        try:
            return await proof
        except Exception:
            internal_error(self.counters, "proving what an upstream does")
            return None
        finally:
            self._running.pop(scope, None)

    async def _over(self, scope: str) -> asyncio.Task | None:
        """Until ``scope``'s running proof is over, and no later than
        ``PROOF_WAIT`` after it started; the proof, if one is running."""
        running = self._running.get(scope)
        if running is None:
            return None
        task, started = running
        left = min(PROOF_WAIT, started + PROOF_WAIT - self._now())
        if left > 0:
            await asyncio.wait({task}, timeout=left)
        return task

    async def settled(self, scope: str) -> None:
        """Until ``scope``'s running proof is over (see ``_over``); with none
        running here, another replica's verdict is read from the store (now
        and then: a scope no upstream answer proves is asked about at most
        every ``LOOK_AGAIN``)."""
        if await self._over(scope) is not None or not self.upstreams.unproven(scope):
            return
        now = self._now()
        if now < self._looked.get(scope, float("-inf")) + LOOK_AGAIN:
            return
        self._looked.put(scope, now)
        self.upstreams.load(await self.state.get(MARKS, self.upstreams.proof_keys(scope)), in_use=True)

    async def proven(self, scope: str) -> None:
        """Until ``scope``'s running proof is over and its verdict written to
        the store (see ``_over``): the answer that started it reaches the
        client whole only then, so that another replica finds the verdict."""
        task = await self._over(scope)
        if task is not None and task.done() and not task.cancelled():
            await self.state.written(task.result())

    async def _get(self, flow: http.HTTPFlow, upstream: str, path: str, why: str,
                   timeout: float = PROOF_TIMEOUT, method: str = "GET") -> tuple[http.Response, str | None]:
        """``GET {upstream}{path}`` (or another bodiless ``method``) with
        ``flow``'s credential, sent as mitmproxy sends the client's requests."""
        request = flow.request.copy()
        request.method = method
        query = request.path.partition("?")[2]  # some gateways take keys there
        request.path = urlsplit(upstream).path + path + (f"?{query}" if query else "")
        for name in _DROPPED_HEADERS:
            request.headers.pop(name, None)
        request.content = b""
        return await self.replays.send(flow, request, why, kind="proof", timeout=timeout)

    async def holds(self, flow: http.HTTPFlow, scope: str, upstream: str, response_id: str) -> bool:
        """Whether ``upstream`` returns ``response_id`` to ``flow``'s
        credential (a client's own id the proxy never recorded): then it reads
        stored responses back, and ``scope`` is marked so. Any other answer is
        about that one id (never stored there, forgotten): nothing is marked."""
        answer, failure = await self._get(flow, upstream, f"/responses/{quote(response_id, safe='')}",
                                          f"does the upstream hold {response_id}?")
        if failure is not None or reads_back(answer.status_code, answer.content) is not True:
            return False
        self._tried.pop(scope, None)
        self.upstreams.mark("reads_back", scope)
        await self.state.written(self.state.flush())
        return True

    async def openai_compatible(self, flow: http.HTTPFlow, base: str) -> bool | None:
        """Whether ``base`` (a base URL) is an OpenAI-compatible API, asked of
        it with ``flow``'s credential: True when it lists models as one does,
        False when it answers otherwise, None when it did not answer (a 5xx,
        a 408 or 429, a reset, no answer within ``RECOGNIZE_TIMEOUT``)."""
        answer, failure = await self._get(flow, base, "/models", "is this an OpenAI-compatible API?",
                                          RECOGNIZE_TIMEOUT)
        if failure is not None or answer.status_code in (408, 429) or answer.status_code >= 500:
            return None
        return lists_models(answer.status_code, answer.content)

    async def unknown_route(self, flow: http.HTTPFlow, base: str) -> tuple[int, bytes] | None:
        """What ``base`` answers ``flow``'s method on a path no API has (with
        ``flow``'s credential): the status and the body with that path and
        method replaced by ``UNKNOWN_ROUTE``, for ``same_as_unknown_route``;
        None when it did not answer (a reset, no answer within
        ``RECOGNIZE_TIMEOUT``)."""
        path = urlsplit(base).path + UNKNOWN_ROUTE_PATH
        answer, failure = await self._get(flow, base, UNKNOWN_ROUTE_PATH, "how does a route nobody has answer?",
                                          RECOGNIZE_TIMEOUT, method=flow.request.method)
        if failure is not None:
            return None
        return answer.status_code, _without_route(answer.content or b"", flow.request.method, path)

    async def _prove_storage(self, flow: http.HTTPFlow, scope: str, label: str, upstream: str,
                             response_id: str) -> asyncio.Future | None:
        """Send the GET and mark the verdict; the verdict's write, on its way."""
        answer, failure = await self._get(flow, upstream, f"/responses/{quote(response_id, safe='')}",
                                          f"can the upstream read {response_id} back?")
        verdict = None if failure is not None else reads_back(answer.status_code, answer.content)
        if verdict is True:
            self._tried.pop(scope, None)
            self.upstreams.mark("reads_back", scope)
        elif verdict is False:
            self._tried.pop(scope, None)
            self._unsupported(scope, label, f"cannot read back a response it said it stored ({answer.status_code})")
        return self.state.flush()

    async def _prove_echo(self, flow: http.HTTPFlow, scope: str, label: str, upstream: str, response_id: str,
                          items_sent: int) -> asyncio.Future | None:
        answer, failure = await self._get(flow, upstream, f"/responses/{quote(response_id, safe='')}/input_items"
                                          "?limit=100", f"was {response_id} made from its chain?")
        verdict = None if failure is not None else read_the_chain(answer.status_code, answer.content, items_sent)
        if verdict is True:
            self.upstreams.mark("honours_previous", scope)
        elif verdict is False:
            self._unsupported(scope, label, "answered a previous_response_id from the items sent alone")
        elif self.upstreams.mark("refuses_previous", scope):
            why = failure or f"answered {answer.status_code}"
            logger.info("stateful-responses: %s echoed a previous_response_id in another spelling and its input items "
                        "cannot be listed (%s); sending full history to it from now on", label, why)
        return self.state.flush()

    def _unsupported(self, scope: str, label: str, why: str) -> None:
        if self.upstreams.mark("unsupported", scope):
            self.counters.unsupported_upstreams += 1
            logger.info("stateful-responses: %s %s; sending full history to it from now on", label, why)
