"""The router's mitmproxy glue: ``stateful_upstreams``.

Listed after the continuation record and before store emulation and forward
mode: it reads the record (``routes.Routes`` decides, with who answered the
turn it continues as the chain index recorded it, so a restart or another
replica routes alike), points the flow at the chosen upstream, and those two
then plan for that upstream. An upstream that refuses connections is found by
a connect probe before it is used after a quiet second, and avoided; a 5xx is
held back and the turn goes to another upstream with full history (reasoning
another upstream encrypted cannot travel: the audit says so). A turn that
may need its upstream's stored state (a ``previous_response_id`` chain, a
conversation) moves only if store emulation can expand it; otherwise it stays
there, and a 5xx reaches the client, whose SDK retries it there. A connection
that fails after the probe gets mitmproxy's 502 (its SDK retries, and the retry
goes elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

import msgspec
from mitmproxy import ctx, http

from ..counters import Counters
from ..flows import CONTINUATION, RETRY_OF, ROUTED, hold, internal_error
from ..request_reader import splice
from ..replays import Replays
from ..record.index import ChainIndex
from ..settings import Config
from .routes import Route, Routes

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.3
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


def point_at(request: http.Request, upstream: str) -> None:
    """Send ``request`` to ``upstream`` (a base URL), keeping its own path."""
    base = urlsplit(upstream)
    request.scheme = base.scheme
    request.host = base.hostname or ""
    request.port = base.port or (443 if base.scheme == "https" else 80)
    request.host_header = base.netloc
    prefix = base.path.rstrip("/")
    if prefix and not request.path.startswith(prefix + "/"):
        request.path = prefix + request.path


async def reachable(upstream: str) -> bool:
    base = urlsplit(upstream)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(base.hostname, base.port or (443 if base.scheme == "https" else 80)),
            PROBE_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


def relies_on_stored_state(record: dict) -> bool:
    """The turn continues state kept under an id (a ``previous_response_id``
    chain, a conversation): elsewhere it needs that state expanded."""
    return record.get("stickyScope") == "request_chain" or bool((record.get("resumeFrom") or {}).get("conversationId"))


def without_foreign_reasoning(body: bytes) -> tuple[bytes, int]:
    """A Responses body without the reasoning items another upstream
    encrypted (no other upstream can read them); how many were dropped."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        items = _ITEMS.decode(fields["input"]) if "input" in fields else []
    except (msgspec.DecodeError, KeyError):
        return body, 0
    kept = []
    for raw in items:
        item = json.loads(bytes(raw))
        if not (isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content")):
            kept.append(bytes(raw))
    if len(kept) == len(items):
        return body, 0
    return splice(body, fields, {"input": b"[" + b",".join(kept) + b"]"}), len(items) - len(kept)


class Router:
    def __init__(self, config: Config, counters: Counters, index: ChainIndex, replays: Replays, expand) -> None:
        self.config = config
        self.counters = counters
        self.index = index
        self.replays = replays
        self.expand = expand  # async (flow, client request) -> full-history body or None (store emulation)
        self.routes: Routes | None = None
        self._clients: dict[str, http.Request] = {}

    def configure(self, updated: set[str]) -> None:
        if "stateful_upstreams" in updated:
            upstreams = self.config.settings.upstreams
            self.routes = Routes(list(upstreams)) if upstreams else None
            if self.routes is not None and ctx.options.connection_strategy == "eager":
                # Eager, mitmproxy connects every new client to the proxy's own
                # upstream before reading a request, and drops the client while
                # that one is down: the router could never route around it.
                ctx.options.update(connection_strategy="lazy")
                logger.info("stateful-responses: connection_strategy=lazy, so that routing decides where "
                            "each request connects")

    async def request(self, flow: http.HTTPFlow) -> None:
        routes = self.routes
        if routes is None or flow.metadata.get(RETRY_OF) is not None or flow.response is not None:
            return
        try:
            record = flow.metadata.get(CONTINUATION) or {}
            resume = record.get("resumeFrom") or {}
            answered_by = self.index.upstream_of(resume.get("turnId") or record.get("previousTurnId"))
            route = await self._choose(flow, record, answered_by)
            while routes.needs_probe(route.upstream) and not await reachable(route.upstream):
                routes.failed(route.upstream)
                logger.warning("stateful-responses: upstream %s refused a connection; avoided for a while",
                               urlsplit(route.upstream).netloc)
                if not any(routes.up(u) for u in routes.upstreams) or route.upstream == route.home:
                    break
                route = await self._choose(flow, record, answered_by)
            self._clients[flow.id] = flow.request.copy()
            point_at(flow.request, route.upstream)
            routes.started(route.upstream)
            flow.metadata[ROUTED] = {"upstream": route.upstream, "reason": route.reason, "moved": route.moved}
        except Exception:
            internal_error(self.counters, "routing a request")

    async def _choose(self, flow: http.HTTPFlow, record: dict, answered_by: str | None) -> Route:
        """The route, unless it moves a turn that needs its upstream's stored
        state and cannot travel as full history: that one stays home."""
        assert self.routes is not None
        route = self.routes.choose(record, answered_by)
        if route.moved and route.home is not None and relies_on_stored_state(record) \
                and await self.expand(flow, flow.request) is None:
            return Route(route.home, "its parent's state is there only", home=route.home)
        return route

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if ROUTED in flow.metadata and flow.response is not None and flow.response.status_code >= 500 \
                and flow.metadata.get(RETRY_OF) is None:
            hold(flow)  # another upstream may answer instead, before the client sees this

    @property
    def answers(self) -> RouterAnswers:
        return RouterAnswers(self)

    async def finish_response(self, flow: http.HTTPFlow) -> None:
        routed = flow.metadata.get(ROUTED)
        client = self._clients.pop(flow.id, None)
        if routed is None or self.routes is None or flow.response is None:
            return
        routes, upstream = self.routes, routed["upstream"]
        routes.ended(upstream)
        try:
            if flow.response.status_code < 500:
                routes.heard_from(upstream)
                routes.settle(flow.metadata.get(CONTINUATION) or {}, upstream)
            elif client is not None:
                routes.failed(upstream)
                await self._fail_over(flow, client, upstream)
        except Exception:
            internal_error(self.counters, "failing over")

    def finish_error(self, flow: http.HTTPFlow) -> None:
        routed = flow.metadata.get(ROUTED)
        self._clients.pop(flow.id, None)
        if routed is not None and self.routes is not None:
            self.routes.ended(routed["upstream"])
            self.routes.failed(routed["upstream"])

    async def _fail_over(self, flow: http.HTTPFlow, client: http.Request, failed: str) -> None:
        """The turn's upstream answered 5xx: another one answers, with full
        history, and the client never sees the failure."""
        assert self.routes is not None and flow.response is not None
        record = flow.metadata.get(CONTINUATION) or {}
        route: Route = self.routes.choose({**record, "stickyScope": "request"})
        if route.upstream == failed:
            return  # nowhere else to go: the client gets the upstream's own answer
        body = await self.expand(flow, client)
        if body is None and relies_on_stored_state(record):
            return  # its state is there only: the client's SDK retries, and the retry goes home
        body = body or client.raw_content or b""
        body, dropped = without_foreign_reasoning(body)
        retry = client.copy()
        retry.content = body
        point_at(retry, route.upstream)
        status = flow.response.status_code
        answer, failure = await self.replays.send(flow, retry, f"failed over after {status}")
        flow.response = answer
        if failure is None and answer.status_code < 500:
            self.routes.heard_from(route.upstream)
            self.routes.settle(record, route.upstream)
        flow.metadata[ROUTED] = {**flow.metadata[ROUTED], "failed_over_to": route.upstream,
                                 "failed_after": status, "reasoning_dropped": dropped}
        flow.marked = ":warning:"
        logger.info("stateful-responses: a turn failed over from %s to %s after %d",
                    urlsplit(failed).netloc, urlsplit(route.upstream).netloc, status)


class RouterAnswers:
    """The router's answer side, listed after store emulation and forward
    mode: they learn from the failed upstream's own answer before a failover
    replaces it."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def response(self, flow: http.HTTPFlow) -> None:
        await self.router.finish_response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.router.finish_error(flow)
