"""Forward mode's mitmproxy glue: moves bytes between flows and the pure planner.

Everything that decides lives in ``planner``; this class only reads a flow into
a ``Request``, writes a planned body back, taps the answer on its way to the
client, and hands the answer to the planner (and what it learned to the state
store). Every hook is wrapped so that an error inside the addon lets the
client's request through untouched.
"""

from __future__ import annotations

import asyncio
import html
import logging
import os
import sys
import traceback
from collections import OrderedDict
from dataclasses import dataclass

from mitmproxy import command, ctx, http, version
from mitmproxy.utils import human

from .planner import TRANSIENT_STATUSES, Outcome, Plan, Planner, Request, plan_summary, upstream_of
from .state import REFS
from .statestore import StateStore
from .sse import AnswerReader
from .view import CLIENT_BODY, META, register, unregister

logger = logging.getLogger(__name__)

RETRY_OF = "stateful_retry_of"  # flow.metadata key marking our own retry
MAX_PENDING = 10_000
# Request bodies the addon may rewrite are kept whole up to this size even when
# mitmproxy's stream_large_bodies would stream them past every addon.
MAX_BUFFERED_REQUEST = 64 * 1024 * 1024
# flow.marked shows in mitmweb's flow list: continued, sent full, passed.
MARKS = {"continue": ":recycle:", "full": ":arrow_right:", "pass": ":white_circle:"}


@dataclass
class _Pending:
    """What the addon keeps about a flow between its request and its answer."""

    plan: Plan
    original: http.Request | None  # the client's request, when we changed it
    reader: AnswerReader | None = None
    outcome: Outcome | None = None  # once the answer has been learned from
    written: asyncio.Future | None = None  # what it taught, on its way to the store


def _metadata(plan: Plan, outcome: Outcome | None = None) -> dict:
    data = {
        "action": plan.action,
        "reason": plan.reason,
        "items_total": plan.items_total,
        "items_sent": plan.items_sent,
        "previous_response_id": plan.previous_response_id,
        "forced_store": plan.forced_store,
    }
    if outcome is not None:
        data["outcome"] = outcome.kind
        data["outcome_detail"] = outcome.detail
        data["response_id"] = outcome.response_id
    return data


def _bad_gateway(why: str) -> http.Response:
    """The answer mitmproxy itself gives when the upstream connection fails."""
    body = (f"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>"
            f"<p>{html.escape(why)}</p></body></html>").encode()
    return http.Response.make(
        502, body, {"Server": version.MITMPROXY, "Connection": "close", "Content-Type": "text/html"}
    )


def _reader_for(response: http.Response) -> AnswerReader:
    length = response.headers.get("content-length", "")
    return AnswerReader(
        response.headers.get("content-type", ""),
        response.headers.get("content-encoding", ""),
        int(length) if length.isdigit() else None,
    )


class ForwardMode:
    """Forward mode: full-history requests continued with previous_response_id
    when, and only when, the upstream provably stored the prefix."""

    def __init__(self, planner: Planner, state: StateStore) -> None:
        self.planner = planner
        self.state = state
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._retry_bodies: dict[str, bytearray | None] = {}  # our retries' answers, by the retry's flow id
        self._view = None

    # -- hooks ---------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            req = flow.request
            if self._may_rewrite(req) and self._would_stream(req):
                await self.state.ready()  # planned without waiting once the body is in
                self._collect_request(flow)
        except Exception:
            self._internal_error("reading request headers")

    def _may_rewrite(self, req: http.Request) -> bool:
        s = self.planner.settings
        return s.enabled and req.method.upper() == "POST" and upstream_of(req.url) is not None and s.url_matches(req.url)

    @staticmethod
    def _would_stream(req: http.Request) -> bool:
        """mitmproxy's ``stream_large_bodies`` would stream this body past every
        addon: a length above it, or no length (it switches mid-body, whatever
        an addon says)."""
        limit = human.parse_size(ctx.options.stream_large_bodies)
        if limit is None:
            return False
        length = req.headers.get("content-length", "")
        if not length.isdigit():
            return True
        return limit < int(length) <= MAX_BUFFERED_REQUEST

    def _collect_request(self, flow: http.HTTPFlow) -> None:
        """Stream the request ourselves: hold its chunks, plan once the body is
        whole, and send what the plan says as one chunk. The length is unknown
        until then, so the body goes out chunked (HTTP/2 needs no length)."""
        req = flow.request
        client_headers = req.headers.copy()
        req.headers.pop("content-length", None)
        if req.http_version.startswith("HTTP/1"):
            req.headers["transfer-encoding"] = "chunked"
        body: bytearray | None = bytearray()

        def collect(chunk: bytes) -> list[bytes]:
            nonlocal body
            if body is None:
                return [chunk]  # too large to hold: passes untouched
            if chunk:
                body.extend(chunk)
                if len(body) <= MAX_BUFFERED_REQUEST:
                    return []
                held, body = bytes(body), None
                return [held]
            original = req.copy()
            original.headers = client_headers
            original.raw_content = bytes(body)
            sent = original.raw_content
            try:
                sent = self._plan(flow, original) or sent
            except Exception:
                self._internal_error("planning a request")
            req.raw_content = sent  # what went upstream, for mitmweb and -w
            return [sent]

        req.stream = collect

    async def request(self, flow: http.HTTPFlow) -> None:
        if META in flow.metadata or flow.request.raw_content is None:
            return  # planned while streamed, or streamed past the addon
        await self.state.ready()
        try:
            client = flow.request.copy()
            body = self._plan(flow, client)
            pending = self._pending.get(flow.id)
            if pending is not None and (refs := self.planner.unresolved_references(pending.plan)):
                found = await self.state.get(REFS, refs)
                if found:  # item references another process learned: plan again with them
                    self.planner.learn_references(found)
                    self.planner.discard(pending.plan)
                    body = self._plan(flow, client)
                    pending = self._pending.get(flow.id)
            if pending is not None and (keys := self.planner.lookups(pending.plan)):
                body = self._improve(flow, pending, await self.state.entries(keys)) or body
            if body is not None:
                flow.request.content = body
        except Exception:
            self._internal_error("planning a request")

    def _improve(self, flow: http.HTTPFlow, pending: _Pending, found: dict) -> bytes | None:
        """Continue from deeper than memory could, out of the backing store
        (another proxy learned it, or this one before a restart)."""
        plan = pending.plan
        before = plan.previous_response_id
        self.planner.improve(plan, found)
        if plan.previous_response_id == before:
            return None
        flow.metadata[META] = _metadata(plan)
        flow.comment = plan_summary(plan)
        flow.marked = MARKS.get(plan.action, "")
        if pending.original is None:
            pending.original = flow.request.copy()
            flow.metadata[CLIENT_BODY] = pending.original.raw_content
        self._debug("rewritten %s from the store: %d items, %d new, previous %s", plan.model,
                    plan.items_total, plan.items_sent, plan.previous_response_id)
        return plan.body

    def _plan(self, flow: http.HTTPFlow, original: http.Request) -> bytes | None:
        """Plan the client's ``original`` request; returns the body to send
        instead of the client's, or None to send the client's."""
        retry_of = flow.metadata.get(RETRY_OF)
        client_body = original.raw_content or b""
        proxy_user = flow.metadata.get("proxyauth")
        plan = self.planner.plan(
            Request(
                method=original.method,
                url=original.url,
                headers={k.lower(): v for k, v in original.headers.items()},
                body=client_body,
                content_encoding=original.headers.get("content-encoding", ""),
                proxy_user="\x00".join(map(str, proxy_user)) if isinstance(proxy_user, tuple) else "",
            ),
            rewrite=retry_of is None,
        )
        if plan.upstream == "":
            return None  # not a Responses API request: no trace at all
        flow.metadata[META] = _metadata(plan)
        if retry_of is None:
            flow.comment = plan_summary(plan)
            flow.marked = MARKS.get(plan.action, "")
        if not plan.tracked:
            self._debug("passed %s: %s", plan.model or "-", plan.reason)
            if plan.watched:
                self._remember(flow.id, _Pending(plan, None))
            return None
        if plan.body is not None:
            flow.metadata[CLIENT_BODY] = client_body
        self._remember(flow.id, _Pending(plan, original if plan.body is not None else None))
        if plan.action == "continue":
            self._debug(
                "rewritten %s: %d items, %d new, previous %s",
                plan.model,
                plan.items_total,
                plan.items_sent,
                plan.previous_response_id,
            )
        else:
            self._debug("full %s: %d items (%s)", plan.model, plan.items_total, plan.reason)
        return plan.body

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        pending = self._pending.get(flow.id)
        try:
            if flow.id in self._retry_bodies:
                self._keep_whole(flow, pending)
                return
            if pending is None:
                return
            status = flow.response.status_code
            if 400 <= status < 500 and pending.plan.changed and status not in TRANSIENT_STATUSES:
                # Buffered, whatever stream_large_bodies says: the response hook
                # replaces this refusal before the client sees it.
                flow.response.stream = False
                return
            reader = pending.reader = _reader_for(flow.response)
            downstream = flow.response.stream

            def tap(chunk: bytes) -> bytes:
                if pending.outcome is None:  # once learned from, bytes only pass
                    reader.feed(chunk)  # never raises
                    if reader.complete:
                        # Learn before these last bytes reach the client: a fast
                        # agent's next request must find this answer stored.
                        self._settle_safely(flow, pending)
                if callable(downstream):
                    return downstream(chunk)
                return chunk

            flow.response.stream = tap
        except Exception:
            self._internal_error("tapping an answer")

    def _keep_whole(self, flow: http.HTTPFlow, pending: _Pending | None) -> None:
        """Our retry's answer is kept whole for the client's flow. Collected
        from a stream rather than left to mitmproxy's buffering, which
        ``stream_large_bodies`` would turn into streaming to nowhere."""
        assert flow.response is not None
        body = self._retry_bodies[flow.id] = bytearray()
        reader = pending.reader = _reader_for(flow.response) if pending is not None else None

        def keep(chunk: bytes) -> bytes:
            body.extend(chunk)
            if reader is not None:
                reader.feed(chunk)
            return b""

        flow.response.stream = keep

    async def response(self, flow: http.HTTPFlow) -> None:
        pending = self._pending.pop(flow.id, None)
        if pending is None or flow.response is None:
            return
        outcome = pending.outcome or self._settle_safely(flow, pending)
        if outcome is not None and outcome.kind == "retry" and flow.metadata.get(RETRY_OF) is None:
            await self._retry(flow, pending)
        # A streamed answer's end reaches the client after this hook: by then
        # what it taught is in the store, for every other proxy too.
        await self.state.written(pending.written)

    def error(self, flow: http.HTTPFlow) -> None:
        pending = self._pending.pop(flow.id, None)
        if pending is None or pending.outcome is not None:
            return  # nothing planned, or the answer was complete before the failure
        try:
            outcome = self.planner.abandon(pending.plan, "no answer from the upstream")
            self.state.flush()
            self._debug("dropped: %s", outcome.detail)
            flow.metadata[META] = _metadata(pending.plan, outcome)
        except Exception:
            self._internal_error("handling a failed flow")

    def load(self, loader) -> None:
        self._view = register()

    def done(self) -> None:
        if self._view is not None:
            unregister(self._view)
        logger.info("stateful-responses: %s", self._stats_line())

    # -- commands ------------------------------------------------------------

    @command.command("stateful.stats")
    def stats(self) -> str:
        """Counters of what the addon did, as one line."""
        return self._stats_line()

    # -- internals -----------------------------------------------------------

    def _settle_safely(self, flow: http.HTTPFlow, pending: _Pending) -> Outcome | None:
        try:
            pending.outcome = self._settle(flow, pending)
            pending.written = self.state.flush()
        except Exception:
            pending.outcome = Outcome("dropped", "internal error")
            self._internal_error("reading an answer")
            return None
        return pending.outcome

    def _settle(self, flow: http.HTTPFlow, pending: _Pending) -> Outcome:
        assert flow.response is not None
        reader = pending.reader
        if reader is None:  # buffered answer
            reader = _reader_for(flow.response)
            reader.feed(flow.response.raw_content or b"")
        response = reader.finish()
        outcome = self.planner.settle(pending.plan, flow.response.status_code, response)
        flow.metadata[META] = _metadata(pending.plan, outcome)
        if outcome.kind == "advanced":
            self._debug("advanced: %s %s", outcome.response_id, outcome.detail)
        elif outcome.kind == "unsupported":
            logger.info(
                "stateful-responses: %s does not store responses (%s); "
                "sending full history to it from now on",
                pending.plan.scope_label,
                outcome.detail,
            )
        elif outcome.kind != "retry":
            self._debug("%s: %s", outcome.kind, outcome.detail)
        return outcome

    async def _retry(self, flow: http.HTTPFlow, pending: _Pending) -> None:
        """Send the client's original request once more and give its answer to
        the client instead of the rejection our change caused."""
        from mitmproxy.addons.clientplayback import ReplayHandler

        assert pending.original is not None and flow.response is not None
        rejected = flow.response.status_code
        counters = self.planner.counters
        counters.retries += 1
        self._debug("retrying with the original body after %d", rejected)
        child = None
        try:
            child = flow.copy()
            child.request = pending.original
            child.response = None
            child.error = None
            child.metadata = {RETRY_OF: flow.id}
            child.comment = f"retry of {flow.id}: original body after {rejected}"
            self._retry_bodies[child.id] = None  # responseheaders starts collecting
            await ReplayHandler(child, ctx.options).replay()
        except Exception:
            self._internal_error("retrying a rejected request")
        body = self._retry_bodies.pop(child.id, None) if child is not None else None
        flow.marked = ":warning:"
        flow.metadata[META]["retried_after"] = rejected
        if child is not None and child.response is not None and body is not None:
            child.response.raw_content = bytes(body)
            self.planner.retried(pending.plan, child.response.status_code)
            self.state.flush()
            flow.response = child.response
            counters.fallbacks += 1
            flow.comment = f"{plan_summary(pending.plan)}; upstream answered {rejected}, retried with the original body"
            return
        # The client must not see the refusal our change caused: its SDK would
        # not retry a 400. Without the addon its request met this failure, so
        # it gets what mitmproxy answers a failed connection with.
        why = str(child.error) if child is not None and child.error else "internal error"
        flow.response = _bad_gateway(why)
        flow.comment = (f"{plan_summary(pending.plan)}; upstream answered {rejected}; "
                        f"the retry with the original body failed ({why}): answered 502")

    def _remember(self, flow_id: str, pending: _Pending) -> None:
        self._pending[flow_id] = pending
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def _internal_error(self, doing: str) -> None:
        """Log where it broke, never the exception's message: a message can
        quote request content (a KeyError of a prompt, say)."""
        self.planner.counters.errors += 1
        kind, _, tb = sys.exc_info()
        where = traceback.extract_tb(tb)[-1] if tb else None
        logger.warning(
            "stateful-responses: internal error (%s at %s:%s) while %s; flow passed through",
            kind.__name__ if kind else "?",
            os.path.basename(where.filename) if where else "?",
            where.lineno if where else "?",
            doing,
        )

    def _debug(self, msg: str, *args) -> None:
        if self.planner.settings.debug:
            logger.info("stateful-responses: " + msg, *args)

    def _stats_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.planner.stats().items())
