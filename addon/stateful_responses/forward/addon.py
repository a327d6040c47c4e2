"""Forward mode's mitmproxy glue: moves bytes between flows and the pure planner.

Everything that decides lives in ``planner``; this class only reads a flow into
a ``Request``, writes a planned body back, taps the answer on its way to the
client, and hands the answer to the planner (and what it learned to the state
store). Every hook is wrapped so that an error inside the addon lets the
client's request through untouched. ``CheckedContinuations`` is its answer side
listed before store emulation: a continuation that must be checked before the
client gets it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
from mitmproxy import command, ctx, http
from mitmproxy.utils import human

from ..items import TOP_LEVEL_BOOKKEEPING
from ..flows import (
    CLIENT_BODY,
    COMPARISON,
    CONVERSATION,
    DECISION,
    EMULATION,
    HELD,
    RETRY_OF,
    SOCKET_TURN,
    WITHHELD,
    PerFlow,
    bridge_runs_for,
    end_still_to_come,
    hold,
    internal_error,
    keep_end_for_hooks,
    request_of,
)
from ..proofs import Proofs
from ..request_reader import names_kept_state, upstream_of
from ..replays import Replays
from ..answer_reader import AnswerReader
from ..state.access import StateAccess
from ..tenancy import credential_material
from ..upstreams import TRANSIENT_STATUSES, UNAVAILABLE_STATUSES, same_context, usage_of
from ..continuation.planner import Outcome, Plan, Planner, plan_summary
from ..continuation.prefixes import ENTRIES, REFS, entries_found

logger = logging.getLogger(__name__)

# Request bodies the addon may rewrite are kept whole up to this size even when
# mitmproxy's stream_large_bodies would stream them past every addon.
MAX_BUFFERED_REQUEST = 64 * 1024 * 1024
class _Stream(msgspec.Struct):
    stream: object = None


_STREAM = msgspec.json.Decoder(_Stream)


def _asks_to_stream(body: bytes) -> bool:
    """Whether a request body asks for an event stream (any doubt: it does)."""
    try:
        stream = _STREAM.decode(body).stream
    except (msgspec.DecodeError, ValueError):
        return True
    return stream is not None and stream is not False


_RESPONSE_PATH = re.compile(r"^(?P<base>.*)/responses/(?P<id>[^/]+)/?$")
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


def _reader_for(response: http.Response) -> AnswerReader:
    length = response.headers.get("content-length", "")
    return AnswerReader(
        response.headers.get("content-type", ""),
        response.headers.get("content-encoding", ""),
        int(length) if length.isdigit() else None,
    )


def _without_item_ids(request: http.Request) -> http.Request:
    """The turn sent whole for a comparison, without the ids its items carry
    where an id is bookkeeping (``items.TOP_LEVEL_BOOKKEEPING``: not a
    reasoning item's, which names hidden reasoning): a gateway such as
    agentic-api refuses items whose ids it already holds, and the count the
    comparison reads is of what the model is fed, not of ids."""
    try:
        body = json.loads(request.content or b"")
    except (ValueError, RecursionError):
        return request
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return request
    body["input"] = [{k: v for k, v in item.items() if k != "id"}
                     if isinstance(item, dict) and "id" in TOP_LEVEL_BOOKKEEPING.get(item.get("type", "message"), ())
                     and ("type" in item or "role" in item) else item for item in items]
    whole = request.copy()
    whole.content = json.dumps(body).encode()
    return whole


def _streamed_anyway(response: http.Response) -> bool:
    """Whether mitmproxy's ``stream_large_bodies`` will stream this answer
    (past the limit, or of unknown length), held or not."""
    limit = human.parse_size(ctx.options.stream_large_bodies)
    if limit is None:
        return False
    length = response.headers.get("content-length", "")
    return not length.isdigit() or int(length) > limit


def _answer_of(response: http.Response) -> dict:
    """The response object of an answer held whole (JSON or SSE), or an empty one."""
    reader = _reader_for(response)
    reader.feed(response.raw_content or b"")
    answer = reader.finish()
    return answer if isinstance(answer, dict) else {}


class ForwardMode:
    """Forward mode: full-history requests continued with previous_response_id
    when, and only when, the upstream provably stored the prefix."""

    def __init__(self, planner: Planner, state: StateAccess, replays: Replays, proofs: Proofs) -> None:
        self.planner = planner
        self.state = state
        self.replays = replays
        self.proofs = proofs
        self._pending: PerFlow[_Pending] = PerFlow()
        self._polls: PerFlow[tuple[str, str, str, str]] = PerFlow()  # (response id, scope, label, upstream)

    # -- hooks ---------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            req = flow.request
            if self._may_rewrite(req) and self._would_stream(req) and not flow.metadata.get(COMPARISON):
                await self.state.ready()  # planned without waiting once the body is in
                await self._proven(flow)
                self._collect_request(flow)
        except Exception:
            self._internal_error("reading request headers")

    def _may_rewrite(self, req: http.Request) -> bool:
        s = self.planner.settings
        return (s.enabled and req.method.upper() == "POST" and upstream_of(req.url) is not None
                and s.url_matches(req.url))

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
            if self.planner.settings.emulate != "off" and flow.metadata.get(RETRY_OF) is None \
                    and names_kept_state(bytes(body)):
                # Store emulation reads the store before it can expand this: the body waits for the request hooks,
                # and store emulation sends it in this flow's place (the upstream gets this one empty).
                req.raw_content = bytes(body)
                flow.metadata[WITHHELD] = True
                return []
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
        if flow.request.method.upper() == "GET":
            self._watch_poll(flow)
            return
        if DECISION in flow.metadata or flow.request.raw_content is None or flow.metadata.get(COMPARISON):
            return  # planned while streamed, streamed past the addon, or our comparison (_compare learns from it)
        await self.state.ready()
        try:
            if self._may_rewrite(flow.request):
                await self._proven(flow)
            client = flow.request  # unchanged until the end: _plan copies it only if it will be
            body = self._plan(flow, client)
            pending = self._pending.get(flow)
            if pending is not None and (refs := self.planner.unresolved_references(pending.plan)):
                found = await self.state.get(REFS, refs)
                if found:  # item references another process learned: plan again with them
                    self.planner.learn_references(found)
                    self.planner.discard(pending.plan)
                    body = self._plan(flow, client)
                    pending = self._pending.get(flow)
            if pending is not None and (keys := self.planner.lookups(pending.plan)):
                body = self._improve(flow, pending, entries_found(await self.state.get(ENTRIES, keys))) or body
            if body is not None:
                flow.request.content = body
        except Exception:
            self._internal_error("planning a request")

    async def _proven(self, flow: http.HTTPFlow) -> None:
        """Until the proof that this request's upstream + credential reads
        stored responses back is over (briefly): a continuation needs it."""
        upstream = upstream_of(flow.request.url)
        if upstream is not None:
            scope, _ = self.planner.tenancy.scope(upstream, credential_material(request_of(flow)))
            await self.proofs.settled(scope)

    def _improve(self, flow: http.HTTPFlow, pending: _Pending, found: dict) -> bytes | None:
        """Continue from deeper than memory could, out of the backing store
        (another proxy learned it, or this one before a restart)."""
        plan = pending.plan
        before = plan.previous_response_id
        self.planner.improve(plan, found)
        if plan.previous_response_id == before:
            return None
        flow.metadata[DECISION] = _metadata(plan)
        flow.comment = plan_summary(plan)
        flow.marked = MARKS.get(plan.action, "")
        if pending.original is None:
            pending.original = flow.request.copy()
            flow.metadata.setdefault(CLIENT_BODY, pending.original.raw_content)
        self._debug("rewritten %s from the store: %d items, %d new, previous %s", plan.model,
                    plan.items_total, plan.items_sent, plan.previous_response_id)
        return plan.body

    def _plan(self, flow: http.HTTPFlow, original: http.Request) -> bytes | None:
        """Plan the client's ``original`` request; returns the body to send
        instead of the client's, or None to send the client's."""
        retry_of = flow.metadata.get(RETRY_OF)
        client_body = original.raw_content or b""
        # A conversation the proxy keeps is named in each answer as it streams by: a stream cannot be held to be
        # checked (a JSON answer can: it is named whole, once held).
        checkable = CONVERSATION not in flow.metadata or not _asks_to_stream(original.raw_content or b"")
        stored_chain = (flow.metadata.get(EMULATION) or {}).get("stored_chain")
        plan = self.planner.plan(request_of(flow, original), rewrite=retry_of is None,
                                 checkable=checkable, websocket_mode=bridge_runs_for(flow),
                                 keep_store_false=SOCKET_TURN in flow.metadata,
                                 stored_chain=tuple(stored_chain) if stored_chain else None)
        if plan.upstream == "":
            return None  # not a Responses API request: no trace at all
        flow.metadata[DECISION] = _metadata(plan)
        if retry_of is None:
            flow.comment = plan_summary(plan)
            flow.marked = MARKS.get(plan.action, "")
        if not plan.tracked:
            self._debug("passed %s: %s", plan.model or "-", plan.reason)
            if plan.watched:
                self._pending.put(flow, _Pending(plan, None))
            return None
        kept = None
        if plan.body is not None:
            flow.metadata.setdefault(CLIENT_BODY, client_body)  # store emulation may have set the client's own
            kept = original.copy() if original is flow.request else original  # for a retry, before it changes
        self._pending.put(flow, _Pending(plan, kept))
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

    def _watch_poll(self, flow: http.HTTPFlow) -> None:
        """A poll of a background response this addon is waiting for."""
        url = urlsplit(flow.request.url)
        match = _RESPONSE_PATH.match(url.path)
        if match is None or self.planner.background.get(match["id"]) is None:
            return
        upstream = f"{url.scheme}://{url.netloc}{match['base']}"
        scope, label = self.planner.tenancy.scope(upstream, credential_material(request_of(flow)))
        self._polls.put(flow, (match["id"], scope, label, upstream))

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            return
        pending = self._pending.get(flow)
        try:
            if pending is None:
                return
            status = flow.response.status_code
            if status >= 400 and pending.plan.changed and status not in TRANSIENT_STATUSES | UNAVAILABLE_STATUSES:
                # Buffered, whatever stream_large_bodies says: the response hook
                # replaces this refusal before the client sees it.
                hold(flow)
                return
            if flow.metadata.get(HELD):
                return  # another addon of ours holds it back: read whole in the response hook
            reader = pending.reader = _reader_for(flow.response)
            if status < 300 and pending.plan.tracked and self.planner.upstreams.unproven(pending.plan.scope):
                keep_end_for_hooks(flow)  # a first stored answer: its proof is written before the client has it
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

    async def response(self, flow: http.HTTPFlow) -> None:
        poll = self._polls.pop(flow)
        if poll is not None and flow.response is not None:
            try:
                reader = _reader_for(flow.response)
                reader.feed(flow.response.raw_content or b"")
                outcome = self.planner.polled(poll[0], poll[1], flow.response.status_code, reader.finish())
                if outcome is not None:
                    self._debug("background %s finished: %s", poll[0], outcome.detail)
                    if outcome.kind == "advanced":
                        self.proofs.start(flow, poll[1], poll[2], poll[3], poll[0])
                    await self.state.written(self.state.flush())
            except Exception:
                self._internal_error("reading a polled background response")
            return
        pending = self._pending.pop(flow)
        if pending is None or flow.response is None:
            return
        outcome = pending.outcome or self._settle_safely(flow, pending)
        if outcome is not None and outcome.kind == "retry" and flow.metadata.get(RETRY_OF) is None:
            await self._retry(flow, pending)
        # A streamed answer's end reaches the client after this hook: by then
        # what it taught is in the store, for every other proxy too.
        if end_still_to_come(flow):
            await self.state.written(pending.written)
            await self.proofs.proven(pending.plan.scope)

    def error(self, flow: http.HTTPFlow) -> None:
        pending = self._pending.pop(flow)
        if pending is None or pending.outcome is not None:
            return  # nothing planned, or the answer was complete before the failure
        try:
            outcome = self.planner.abandon(pending.plan, "no answer from the upstream")
            self.state.flush()
            self._debug("dropped: %s", outcome.detail)
            flow.metadata[DECISION] = _metadata(pending.plan, outcome)
        except Exception:
            self._internal_error("handling a failed flow")

    def done(self) -> None:
        logger.info("stateful-responses: %s", self._stats_line())

    # -- commands ------------------------------------------------------------

    @command.command("stateful.stats")
    def stats(self) -> str:
        """Counters of what the addon did, as one line."""
        return self._stats_line()

    # -- internals -----------------------------------------------------------

    def _settle_safely(self, flow: http.HTTPFlow, pending: _Pending, *, chain_read: bool = False) -> Outcome | None:
        try:
            pending.outcome = self._settle(flow, pending, chain_read)
            pending.written = self.state.flush()
        except Exception:
            pending.outcome = Outcome("dropped", "internal error")
            self._internal_error("reading an answer")
            return None
        return pending.outcome

    def _settle(self, flow: http.HTTPFlow, pending: _Pending, chain_read: bool = False) -> Outcome:
        assert flow.response is not None
        reader = pending.reader
        if reader is None:  # buffered answer
            reader = _reader_for(flow.response)
            reader.feed(flow.response.raw_content or b"")
        response = reader.finish()
        outcome = self.planner.settle(pending.plan, flow.response.status_code, response, chain_read=chain_read)
        flow.metadata[DECISION] = _metadata(pending.plan, outcome)
        if outcome.kind == "advanced":
            self._debug("advanced: %s %s", outcome.response_id, outcome.detail)
            if outcome.response_id is not None:
                plan = pending.plan
                self.proofs.start(flow, plan.scope, plan.scope_label, plan.upstream, outcome.response_id)
        elif outcome.kind == "unverified" and outcome.response_id is not None:
            plan = pending.plan
            self.proofs.start_echo(flow, plan.scope, plan.scope_label, plan.upstream, outcome.response_id,
                                   plan.items_sent)
        elif outcome.kind == "lossy":
            logger.info("stateful-responses: %s %s; such conversations go whole to it from now on",
                        pending.plan.scope_label, outcome.detail)
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

    async def _retry(self, flow: http.HTTPFlow, pending: _Pending, why: str | None = None) -> None:
        """Send the client's original request once more and give its answer to
        the client instead of the rejection our change caused (or, ``why``,
        an answer that cannot be trusted)."""
        assert pending.original is not None and flow.response is not None
        rejected, refusal = flow.response.status_code, flow.response.get_content(strict=False) or b""
        flow.metadata[DECISION]["retried_after"] = rejected
        if why is not None:
            flow.metadata[DECISION]["retry_reason"] = why
        why = why or f"upstream answered {rejected}"
        self.planner.counters.retries += 1
        self._debug("retrying with the original body after %d: %s", rejected, why)
        answer, failure = await self.replays.send(flow, pending.original, f"original body after {rejected}: {why}")
        client_body = flow.metadata.get(CLIENT_BODY)
        if failure is None and answer.status_code >= 400 \
                and answer.status_code not in TRANSIENT_STATUSES | UNAVAILABLE_STATUSES \
                and (flow.metadata.get(EMULATION) or {}).get("expanded") is True \
                and self.planner.upstreams.continuable(pending.plan.scope) \
                and client_body is not None and client_body != pending.original.raw_content:
            # What forward mode was handed, a chain store emulation expanded, failed too: the client's own body
            # goes, and its answer is the client's (only where the upstream continues chains: one that ignores
            # previous_response_id would answer it without the history).
            own = pending.original.copy()
            own.raw_content = client_body
            if "content-length" in own.headers:
                own.headers["content-length"] = str(len(client_body))
            answer, failure = await self.replays.send(flow, own, f"the client's own body after {rejected} "
                                                      f"and {answer.status_code}")
        flow.response = answer
        flow.marked = ":warning:"
        summary = plan_summary(pending.plan)
        if failure is None:
            self.planner.retried(pending.plan, rejected, refusal, answer.status_code)
            self.state.flush()
            self.planner.counters.fallbacks += 1
            flow.comment = f"{summary}; {why}, retried with the original body"
        else:
            # Without the addon the client's request met this failure: it gets
            # what mitmproxy answers a failed connection with (SDKs retry a
            # 502), never the 400 our change caused (they would not).
            flow.comment = f"{summary}; {why}; the retry with the original body failed ({failure}): answered 502"

    @property
    def checks(self) -> CheckedContinuations:
        return CheckedContinuations(self)

    async def check(self, flow: http.HTTPFlow) -> None:
        """A checked continuation's answer, held whole: it stands only if the
        upstream + credential shows it was made from the chain (the echo, the
        bill, or a listing of its input items, ``PROOF_WAIT`` at most), and,
        for a chain holding item kinds it has not yet shown it feeds back, if
        it was fed what the same turn sent whole is (``_compare``); otherwise
        the client's full body goes again and its answer is the client's, so
        that no turn is answered without its history, and that upstream +
        credential is sent full history from then on (for those item kinds
        only, after a comparison; checking every turn would send each twice)."""
        pending = self._pending.get(flow)
        if pending is None or not pending.plan.checked or flow.response is None or flow.response.status_code >= 300:
            return
        try:
            scope = pending.plan.scope
            outcome = self._settle_safely(flow, pending)
            if outcome is not None and outcome.kind == "unverified":
                await self.proofs.proven(scope)  # the listing of its input items
                if self.planner.upstreams.has("honours_previous", scope):
                    self._settle_safely(flow, pending, chain_read=True)  # made from its chain after all: learned from
            upstreams = self.planner.upstreams
            if not upstreams.has("honours_previous", scope):
                if not upstreams.cannot_continue(scope) and upstreams.mark("refuses_previous", scope):
                    logger.info("stateful-responses: %s did not show it answered a previous_response_id from its "
                                "chain; sending full history to it from now on", pending.plan.scope_label)
                await self._retry(flow, pending, "the upstream did not show it read the chain")
            elif outcome is not None and outcome.kind == "lossy":
                await self._retry(flow, pending, "the upstream's stored chain dropped items of the conversation")
            elif outcome is not None and outcome.kind == "advanced" and pending.plan.verify:
                await self._compare(flow, pending)
        except Exception:
            self._internal_error("checking a continuation's answer")

    async def _compare(self, flow: http.HTTPFlow, pending: _Pending) -> None:
        """Send the turn whole too, and see whether the held continuation was
        fed what it was fed (``usage.input_tokens``, within rounding): if so
        the upstream keeps the chain's item kinds (``Plan.verify``) and the
        client has the continuation; if not, it drops them: the client has the
        whole turn's answer, and no conversation is continued across such
        items from then on. Without both counts nothing is learned (the
        continuation stands, as it would have unchecked)."""
        assert pending.original is not None and flow.response is not None
        plan = pending.plan
        continued = usage_of(_answer_of(flow.response))
        if continued is None:
            return
        whole, failure = await self.replays.send(flow, _without_item_ids(pending.original),
                                                 "the same turn sent whole, to compare", kind="comparison")
        counted = usage_of(_answer_of(whole)) if failure is None and whole.status_code < 300 else None
        if counted is None:
            return
        kept = same_context(continued, counted)
        marked = self.planner.judge_chain(plan, kept)
        await self.state.written(self.state.flush())
        flow.metadata[DECISION]["compared"] = {"continued": continued.input, "whole": counted.input}
        if kept:
            self._debug("%s keeps %s in its stored chain (%d input tokens either way)", plan.scope_label,
                        ", ".join(sorted(plan.verify)), counted.input)
            return
        self.planner.counters.retries += 1
        logger.info("stateful-responses: %s fed a continuation %d input tokens where the same turn sent whole is %d: "
                    "its stored chain does not keep %s; such conversations go whole to it from now on",
                    plan.scope_label, continued.input, counted.input, ", ".join(sorted(marked or plan.verify)))
        flow.response = whole
        flow.comment = f"{plan_summary(plan)}; its stored chain lost items, answered by the turn sent whole"

    def _internal_error(self, doing: str) -> None:
        internal_error(self.planner.counters, doing)

    def _debug(self, msg: str, *args) -> None:
        if self.planner.settings.debug:
            logger.info("stateful-responses: " + msg, *args)

    def _stats_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.planner.stats().items())


class CheckedContinuations:
    """Forward mode's answer side for checked continuations (store emulation's
    always mode: no ``previous_response_id`` the upstream has not shown it
    honours may decide a client's answer), listed before store emulation so
    that the answer emulation records is the one the client gets."""

    def __init__(self, forward: ForwardMode) -> None:
        self.forward = forward

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        pending = self.forward._pending.get(flow)
        if pending is not None and pending.plan.checked and flow.response is not None \
                and flow.response.status_code < 300:
            if pending.plan.verify and _streamed_anyway(flow.response) \
                    and self.forward.planner.upstreams.has("honours_previous", pending.plan.scope):
                # mitmproxy streams an answer past stream_large_bodies whatever an addon says: it cannot be held to
                # be compared, so it is read on the side as any other (the shortfall check still applies)
                pending.plan.checked, pending.plan.verify = False, frozenset()
                return
            hold(flow)  # read whole in the response hook, and replaced there unless it was made from the chain

    async def response(self, flow: http.HTTPFlow) -> None:
        await self.forward.check(flow)
