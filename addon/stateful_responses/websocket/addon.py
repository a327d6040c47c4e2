"""The WebSocket bridge's mitmproxy glue (``stateful_upstream_websocket``).

A transport of forward mode's engine (``continuation.planner``): the planner says
what the upstream holds of a request (a stored response proven readable, on
any replica, before any restart), and every answer made over a socket is
settled into it, as forward mode settles its HTTP answers.

Listed after store emulation and before forward mode. In ``request``, a
full-history Responses request the bridge may take gets a socket of its
upstream + credential (``pool.Pool``): one whose latest response its history
strictly extends, or a new one, opened right here (a refused upgrade is marked
for that upstream + credential and the flow goes on untouched, over HTTP, to
forward mode). The flow is then pointed at the loopback server, its real
request kept; forward mode no longer sees a Responses request and leaves it
alone. The loopback server answers it over the socket (``relay``), and
``responseheaders`` gives the flow its real request back, so that mitmweb, the
record and ``-w`` show the real upstream URL and the client's body, and lets
mitmproxy stream the answer as it comes.

Not in ``--mode upstream:``: the socket would have to reach the upstream
through that proxy, and the loopback server cannot be reached through it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from blake3 import blake3
from mitmproxy import ctx, http

from ..answer_reader import AnswerReader
from ..bounded import Bounded
from ..counters import Counters
from ..flows import (
    BRIDGED,
    CLIENT_BODY,
    DECISION,
    HELD,
    OVERFLOW,
    RETRY_OF,
    PerFlow,
    bridge_runs_for,
    internal_error,
    request_of,
)
from ..continuation.planner import Plan, Planner
from ..continuation.prefixes import ENTRIES, REFS, entries_found
from ..proofs import Proofs
from ..items import is_compaction_trigger
from ..request_reader import Reader, Reading, upstream_of
from ..replays import Replays, bad_gateway
from ..settings import Config, Settings
from ..state.access import StateAccess
from ..tenancy import Tenancy, is_credential_header
from ..upstreams import TRANSIENT_STATUSES, Upstreams
from .connect import Refused, Target, TLSOptions, Unreachable, open_socket
from .loopback import PATH_PREFIX, Answer, Loopback
from .messages import Tip, socket_message
from .pool import Declined, Held, Pool
from .relay import HttpAnswer, Outcome, Turn, relay

logger = logging.getLogger(__name__)

SWEEP_EVERY_S = 5.0  # idle and aged sockets are closed this often
UNCLAIMED_S = 60.0  # a redirected flow not at the loopback server by then gives its socket back (then: HTTP)
REST_S = 60.0  # an upstream + credential whose socket could not be opened goes over HTTP this long
# A socket verdict drawn from faults (an upgrade never answered, sockets closed before their first event, a
# continuation refused) holds this long, on every replica: then one turn tries a socket again.
REPROBE_S = 3600.0
MISSES_FOR_VERDICT = 8  # cache misses in a row (previous_response_not_found) before sockets are found no use
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade"})
MARKS = {"continue": ":recycle:", "full": ":arrow_right:", "http": ":warning:"}


@dataclass
class _Job:
    """A redirected flow, from its request hook to the end of its answer."""

    flow: http.HTTPFlow
    client: http.Request  # the client's request as it was: restored, and sent over HTTP if it must
    turn: Turn
    held: Held
    scope: str
    label: str
    client_bytes: int
    token: str
    plan: Plan | None  # the engine's plan, settled by the answer (None: nothing to learn, a store:false turn)
    judged: bool = False  # its verdicts on the upstream's sockets are drawn
    unclaimed: asyncio.TimerHandle | None = None  # gives the socket back if the loopback server never sees the flow
    overdue: bool = False  # its socket was given back before the flow came: should it come, it goes over HTTP


def namespace(secret: bytes, upstream: str, model: str, credential: bytes) -> bytes:
    """What a socket's memory is matched under: upstream + model + credential,
    as forward mode's namespace (a keyed hash: the credential is never kept)."""
    h = blake3(key=secret)
    h.update(f"websocket\x00{upstream}\x00{model}\x00".encode("utf-8", "surrogatepass"))
    h.update(credential)
    return h.digest()


def target_of(request: http.Request) -> Target:
    """Where mitmproxy would send ``request``, as a WebSocket URL: the
    upstream's name (an address of transparent mode gives way to the Host
    header's name, for TLS), the request's path and query, its credential
    headers and User-Agent on the upgrade (never Proxy-Authorization)."""
    name = request.host
    try:
        ipaddress.ip_address(name)
        name = request.host_header.rsplit(":", 1)[0].strip("[]") if request.host_header else name
    except ValueError:
        pass
    netloc = f"[{name}]" if ":" in name else name
    default_port = 443 if request.scheme == "https" else 80
    if request.port != default_port:
        netloc += f":{request.port}"
    scheme = "wss" if request.scheme == "https" else "ws"
    headers = tuple((k, v) for k, v in request.headers.items(multi=True)
                    if (lower := k.lower()) != "proxy-authorization" and (is_credential_header(lower)
                                                                           or lower == "user-agent"))
    return Target(f"{scheme}://{netloc}{request.path}", name, request.host, request.port, headers)


def tls_options() -> TLSOptions:
    o = ctx.options
    return TLSOptions(o.ssl_insecure, o.ssl_verify_upstream_trusted_ca, o.ssl_verify_upstream_trusted_confdir,
                      o.client_certs)


class WebSocketBridge:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, upstreams: Upstreams,
                 state: StateAccess, replays: Replays, planner: Planner, proofs: Proofs) -> None:
        self.config = config
        self.planner = planner
        self.proofs = proofs
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.upstreams = upstreams
        self.state = state
        self.replays = replays
        s = config.settings
        self.pool = Pool(time.monotonic, s.upstream_websocket_max_sockets, s.upstream_websocket_idle_s)
        self.loopback = Loopback(self._serve)
        self._jobs: dict[str, _Job] = {}  # by token: redirected, not yet claimed by the loopback server
        self._flows: PerFlow[_Job] = PerFlow()
        self._resting = Bounded(4096)  # scope -> until when its sockets are not tried
        self._refusals = Bounded(4096)  # scope -> continuations its sockets refused in a row
        self._misses = Bounded(4096)  # scope -> continuations its sockets no longer remembered, in a row
        self._sweeper: asyncio.Task | None = None
        config.on_change(self._reconfigure)
        tenancy.on_new_secret(self._close_all)  # scopes and namespaces are named anew

    @property
    def settings(self) -> Settings:
        return self.config.settings

    def _reconfigure(self, old: Settings, new: Settings) -> None:
        self.pool.max_per_scope = new.upstream_websocket_max_sockets
        self.pool.idle_s = new.upstream_websocket_idle_s
        if new.upstream_websocket == "off" or not new.enabled:
            self._close_all()

    # -- hooks -------------------------------------------------------------------

    def running(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def done(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.loopback.close()
        for connection in self.pool.close_all():
            connection.abort()

    async def request(self, flow: http.HTTPFlow) -> None:
        if not self._may_bridge(flow):
            return
        await self.state.ready()
        try:
            await self._bridge(flow)
        except Exception:
            internal_error(self.counters, "bridging a request to an upstream WebSocket")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        job = self._flows.get(flow)
        if job is None or flow.response is None:
            return
        flow.request.data = job.client.data  # mitmweb, the record and -w show what the client sent, and where
        if not flow.response.stream and not flow.metadata.get(HELD):
            flow.response.stream = True  # each event on to the client as it comes

    def response(self, flow: http.HTTPFlow) -> None:
        job = self._flows.pop(flow)  # the job refers to its flow: kept, it would keep the flow, its body and messages
        if job is not None:
            self._unclaimed(job)  # answered without the loopback server (by another addon): its socket goes back

    def error(self, flow: http.HTTPFlow) -> None:
        job = self._flows.pop(flow)
        if job is None:
            return
        flow.request.data = job.client.data
        self._unclaimed(job)

    # -- taking a flow -----------------------------------------------------------

    def _may_bridge(self, flow: http.HTTPFlow) -> bool:
        s = self.settings
        req = flow.request
        return (s.enabled and s.upstream_websocket == "auto" and req.method == "POST" and flow.response is None
                and req.raw_content is not None and upstream_of(req.url) is not None and s.url_matches(req.url)
                and not ({RETRY_OF, DECISION, CLIENT_BODY} & flow.metadata.keys()) and bridge_runs_for(flow))

    async def _bridge(self, flow: http.HTTPFlow) -> None:
        reading = self.reader.read(request_of(flow), count=False)
        if not isinstance(reading, Reading) or reading.previous is not None or _socket_refuses(reading):
            return
        scope, label = reading.scope, reading.label
        if self.upstreams.has("refuses_websocket", scope) or self._resting.get(scope, 0.0) > time.monotonic():
            return
        plan = await self._plan(flow, reading)
        root = namespace(self.tenancy.secret, reading.upstream, reading.model, reading.credential)
        named = self.reader.digests.references
        references = {d: named[d] for d in reading.digests if d in named} if named else {}
        target = target_of(flow.request)
        # One address (transparent mode's upstream) may serve several names, each reached with the same
        # credential: a socket serves only the name, path and query it was opened to.
        choice = self.pool.choose(f"{scope}\x00{target.url}", root, reading.digests, references,
                                  hydrates=self.upstreams.has("reads_back", scope))
        self._close(self.pool.take_closing())
        if isinstance(choice, Declined):
            if choice.reason == "live":
                flow.metadata[OVERFLOW] = True  # forward mode treats it as it would without the bridge
            self._debug("ws: every socket of %s is %s; over HTTP", label,
                        "busy" if choice.reason == "busy" else "holding a live conversation")
            return
        try:
            tip, stored = choice.continued, False
            if plan is not None and plan.action == "continue" and plan.previous_response_id is not None \
                    and (depth := plan.items_total - plan.items_sent) > (tip.length if tip is not None else 0):
                if reading.client_store is not False:  # a stored response, hydrated on this socket
                    tip, stored = Tip(root, b"", depth, plan.previous_response_id), True
                # else a socket reads no stored response for a store:false turn (one the pool once sent over
                # HTTP, store forced): it goes whole on this socket, whose memory then serves its next turns
                # with nothing stored, rather than back to HTTP for good
            await self._take(flow, reading, target, root, references, choice.held, tip, choice.fresh, plan, stored)
        except BaseException:  # a socket the flow does not go to goes back, whatever happened
            if choice.held.busy and self._flows.get(flow) is None:
                self._give_back_choice(choice.held)
            raise

    async def _plan(self, flow: http.HTTPFlow, reading: Reading) -> Plan | None:
        """The engine's plan of a turn (as forward mode's, from the same
        prefix store and the backing store: a stored response proven readable
        by any replica, before any restart); None when nothing is to be
        learned from its answer (a ``store: false`` turn, an upstream that
        does not store)."""
        if reading.client_store is not False:  # a store:false turn is continued from no stored response
            await self.proofs.settled(reading.scope)
        request = request_of(flow)
        plan = self.planner.plan(request, websocket_mode=True, count=False)
        if not plan.tracked:
            return None
        if refs := self.planner.unresolved_references(plan):
            found = await self.state.get(REFS, refs)
            if found:  # item references another process learned: plan again with them
                self.planner.learn_references(found)
                plan = self.planner.plan(request, websocket_mode=True, count=False)
        if keys := self.planner.lookups(plan):
            self.planner.improve(plan, entries_found(await self.state.get(ENTRIES, keys)))
        return plan

    def _give_back_choice(self, held: Held) -> None:
        self._close([c for c in [self.pool.give_back(held)] if c is not None])

    async def _take(self, flow: http.HTTPFlow, reading: Reading, target: Target, root: bytes,
                    references: dict[bytes, str], held: Held, tip: Tip | None, fresh: bool, plan: Plan | None,
                    stored: bool) -> None:
        """Open the socket if it is new, then make the turn and point the flow at the loopback server."""
        scope, label, s = reading.scope, reading.label, self.settings
        if fresh:
            self._debug("ws: opening a socket to %s", label)
            try:
                self.pool.opened(held, await open_socket(target, tls_options()))
            except Refused as e:
                self.pool.remove(held)
                self.pool.events["refused"] += 1
                self._refused(scope, label, e.status)
                return
            except Unreachable as e:
                self.pool.remove(held)
                self.pool.events["unreachable"] += 1
                if str(e) == "TimeoutError":  # the upstream took the connection and never answered the upgrade
                    self._refuses(scope, label, "never answered the WebSocket upgrade", REPROBE_S)
                    return
                self._resting.put(scope, time.monotonic() + REST_S)
                self._debug("ws: no socket to %s (%s); over HTTP for %ds", label, e, REST_S)
                return
        digests = reading.digests
        if tip is not None and references and not stored:
            digests = tip.resolved(digests, references)
        client = flow.request.copy()
        body, fields = client.raw_content or b"", reading.fields
        turn = Turn(streamed=bytes(fields.get("stream", b"")) == b"true", root=root, digests=digests,
                    whole=lambda: socket_message(body, fields), items_total=len(digests),
                    open_socket=lambda: open_socket(target, tls_options()),
                    over_http=lambda outcome: self._over_http(flow, client, job, outcome),
                    settle=lambda outcome: self._settle(job, outcome),
                    first_event_s=s.upstream_websocket_first_event_s, silence_s=s.upstream_websocket_silence_s,
                    fresh=fresh, stored=stored, rehydrate=stored or (
                        tip is not None and plan is not None and plan.previous_response_id == tip.response_id))
        if tip is not None:
            assert reading.raw_items is not None  # a string input is one item: it extends nothing
            turn.continued, turn.items_sent = tip, len(digests) - tip.length
            turn.delta_message = socket_message(body, fields, reading.raw_items[tip.length:], tip.response_id)
        job = _Job(flow, client, turn, held, scope, label, len(body), secrets.token_urlsafe(24), plan)
        await self.loopback.start()
        self._redirect(flow, job)

    def _redirect(self, flow: http.HTTPFlow, job: _Job) -> None:
        """Point the flow at the loopback server (the last step: nothing after it can fail)."""
        self._jobs[job.token] = job
        self._flows.put(flow, job)
        job.unclaimed = asyncio.get_running_loop().call_later(UNCLAIMED_S, self._overdue, job)
        where = f"127.0.0.1:{self.loopback.port}"
        flow.request.data = http.Request.make("POST", f"http://{where}{PATH_PREFIX}{job.token}", b"",
                                              {"host": where, "content-length": "0"}).data
        turn = job.turn
        self.counters.requests += 1
        plan = _summary(turn.continued.response_id if turn.continued else None, turn.items_sent, turn.items_total)
        flow.comment, flow.marked = plan, MARKS["continue" if turn.continued else "full"]
        flow.metadata[BRIDGED] = {"transport": "websocket", "action": "continue" if turn.continued else "full",
                                  "previous_response_id": turn.continued.response_id if turn.continued else None,
                                  "items_total": turn.items_total,
                                  "items_sent": turn.items_sent if turn.continued else turn.items_total}

    def _unclaimed(self, job: _Job) -> None:
        """A flow that will never reach the loopback server (the client went
        away, or another addon answered it): its socket goes back, its memory
        unchanged."""
        if job.unclaimed is not None:
            job.unclaimed.cancel()  # the timer would hold the job, and its flow
            job.unclaimed = None
        if self._jobs.get(job.token) is job:
            del self._jobs[job.token]
            if not job.overdue:
                self._give_back(job)

    def _overdue(self, job: _Job) -> None:
        """A flow not at the loopback server within ``UNCLAIMED_S`` (held by
        an interception, say): its socket goes back, its memory unchanged,
        for other turns; the flow, should it still come, goes over HTTP."""
        job.unclaimed = None
        if self._jobs.get(job.token) is job and not job.overdue:
            job.overdue = True
            self._give_back(job)

    def _give_back(self, job: _Job) -> None:
        self._close([c for c in [self.pool.give_back(job.held)] if c is not None])

    # -- answering it ------------------------------------------------------------

    async def _serve(self, token: str, answer: Answer) -> None:
        job = self._jobs.pop(token, None)
        if job is None:
            await answer.json(404, b'{"error":{"message":"No such turn.","type":"invalid_request_error"}}')
            return
        if job.unclaimed is not None:
            job.unclaimed.cancel()  # claimed: the timer would hold the job, and its flow, a minute more
            job.unclaimed = None
        if job.overdue:
            await self._late(job, answer)
            return
        try:
            await relay(job.turn, job.held, self.pool, answer)
        except Exception:
            internal_error(self.counters, "answering over an upstream WebSocket")
            self._close([c for c in [self.pool.remove(job.held)] if c is not None])
            if answer.started:
                answer.drop()
            else:
                failed = bad_gateway("internal error")
                await answer.whole(502, list(failed.headers.fields), failed.raw_content or b"")

    async def _late(self, job: _Job, answer: Answer) -> None:
        """A flow that came after its socket was given back (and may be in
        another turn's use): the client's own request over HTTP."""
        outcome = Outcome("http", items_sent=job.turn.items_total,
                          retries=[f"the flow came after its socket's {UNCLAIMED_S:g} s hold"])
        try:
            outcome.status, headers, body = await job.turn.over_http(outcome)
            await self._settle(job, outcome)
        except Exception:
            internal_error(self.counters, "answering a late flow over HTTP")
            failed = bad_gateway("internal error")
            outcome.status, headers, body = 502, list(failed.headers.fields), failed.raw_content or b""
        await answer.whole(outcome.status, headers, body)

    async def _over_http(self, flow: http.HTTPFlow, client: http.Request, job: _Job, outcome: Outcome) -> HttpAnswer:
        """The client's own request over HTTP, sent as mitmproxy sends it;
        once this upstream + credential's sockets are found no use (this very
        turn may have found it), as forward mode sends it with the bridge off:
        with ``store`` forced, so that the next turn is continued (the
        client's own body again if that is refused)."""
        self._judge(job, outcome)
        request, forced = client.copy(), None
        if self.upstreams.has("refuses_websocket", job.scope):
            plan = self.planner.plan(request_of(flow, client), websocket_mode=True, count=False)
            if plan.action == "full" and plan.forced_store and plan.body is not None:
                request.content, forced = plan.body, plan
        answer, _ = await self.replays.send(flow, request, "the upstream WebSocket could not answer it")
        if forced is not None and 400 <= answer.status_code < 500 and answer.status_code not in TRANSIENT_STATUSES:
            refused, refusal = answer.status_code, answer.get_content(strict=False) or b""
            answer, _ = await self.replays.send(flow, client.copy(), "the upstream refused a forced store")
            self.planner.retried(forced, refused, refusal, answer.status_code)
            self.state.flush()
        headers = [(k, v) for k, v in answer.headers.fields if k.lower() not in _HOP_BY_HOP]  # bytes, as they came
        return answer.status_code, headers, answer.raw_content or b""

    async def _settle(self, job: _Job, outcome: Outcome) -> None:
        """What the turn came to, on the flow and in the counters, marks and
        the engine's prefix store: before the answer's last byte, so that the
        response hooks (the record) read it, and the client's next turn (on
        any replica) finds what it taught."""
        written = None
        try:
            self._report(job, outcome)
            written = self._learn(job, outcome)
        except Exception:
            internal_error(self.counters, "learning from an answer over an upstream WebSocket")
        if written is not None:
            await written

    def _learn(self, job: _Job, outcome: Outcome) -> Awaitable[None] | None:
        """Report an answer made over the socket to the engine, as forward
        mode reports its HTTP answers (an answer made over HTTP, the bridge's
        fallback, went through forward mode: learned there)."""
        plan, turn = job.plan, job.turn
        if plan is None or outcome.abandoned or outcome.transport == "http":
            return None
        if turn.stored and outcome.previous_response_id != plan.previous_response_id:
            self.planner.abandon(plan, "the socket did not continue the stored response")
        if outcome.dropped is not None or outcome.status is None:
            self.planner.abandon(plan, outcome.dropped or "no answer")
            return self.state.written(self.state.flush())
        continued = outcome.previous_response_id is not None
        self.planner.carried(plan, outcome.previous_response_id, outcome.items_sent,
                             turn.delta_message if continued else None)
        response = None
        if outcome.response is not None:
            reader = AnswerReader("application/json", "")
            reader.feed(outcome.response)
            response = reader.finish()
        learned = self.planner.settle(plan, outcome.status, response)
        written = self.state.flush()
        self._debug("ws: %s: %s", learned.kind, learned.detail)
        if learned.kind == "advanced" and learned.response_id is not None and self.upstreams.unproven(plan.scope):
            proof = job.flow.copy()
            proof.request = job.client.copy()  # the flow points at the loopback server: the proof goes upstream
            self.proofs.start(proof, plan.scope, plan.scope_label, plan.upstream, learned.response_id)
            return self._proven(written, plan.scope)
        return self.state.written(written)

    async def _proven(self, written, scope: str) -> None:
        await self.state.written(written)
        await self.proofs.proven(scope)

    def _judge(self, job: _Job, outcome: Outcome) -> None:
        """The verdicts on this upstream + credential's sockets the turn
        reached (once: before it goes over HTTP, which they may shape)."""
        if job.judged:
            return
        job.judged = True
        turn, continued = job.turn, outcome.previous_response_id is not None
        if outcome.refused_upgrade is not None:
            self._refused(job.scope, job.label, outcome.refused_upgrade)
        if outcome.unverified:  # one answer: an hour, as every verdict drawn from a turn
            self._refuses(job.scope, job.label, "answered a continuation without echoing its previous_response_id",
                          REPROBE_S)
        if outcome.refused_continuation is not None and not turn.stored:
            # A refusal that names the field is a verdict at once; any other, the second in a row.
            again = self._refusals.get(job.scope, 0) + 1
            self._refusals.put(job.scope, again)
            if outcome.refused_the_field or again >= 2:
                self._refuses(job.scope, job.label, f"refused a continuation of its socket's own latest response "
                              f"({outcome.refused_continuation})", REPROBE_S)
        elif continued and outcome.transport == "websocket":
            self._refusals.pop(job.scope, None)
            self._misses.pop(job.scope, None)
        if outcome.missed_memory and not turn.stored:
            # A cache miss is the socket's state, not a refusal (an eviction, a restart upstream): only sockets
            # that keep no memory at all, turn after turn, are no use (each turn would cost a call for nothing).
            misses = self._misses.get(job.scope, 0) + outcome.missed_memory
            self._misses.put(job.scope, misses)
            if misses >= MISSES_FOR_VERDICT:
                self._refuses(job.scope, job.label, f"kept no socket's memory for {misses} continuations in a row",
                              REPROBE_S)
        if outcome.closes_unused:
            self._refuses(job.scope, job.label, "closed sockets opened for a turn before their first event", REPROBE_S)

    def _report(self, job: _Job, outcome: Outcome) -> None:
        flow, turn = job.flow, job.turn
        c = self.counters
        continued = outcome.previous_response_id is not None
        if outcome.abandoned:
            pass  # nothing was answered: only its retries count
        elif outcome.transport == "websocket":
            c.websocket_turns += 1
            if continued:
                c.continued += 1
                c.delta_items += outcome.items_sent
            else:
                c.full_items += outcome.items_sent
            sent = turn.delta_message if continued and turn.delta_message is not None else turn.full_message
            c.bytes_saved += job.client_bytes - len(sent)
        else:
            c.fallbacks += 1
            c.full_items += outcome.items_sent
        c.websocket_retries += bool(outcome.retries)
        self._judge(job, outcome)
        self.state.flush()
        if outcome.abandoned:
            flow.comment = f"ws: not sent over HTTP: the client went away (after: {'; '.join(outcome.retries)})"
            flow.marked = ":warning:"
            self._debug("%s (%s)", flow.comment, job.label)
            return
        action = "http" if outcome.transport == "http" else "continue" if continued else "full"
        summary = "ws: sent over HTTP" if action == "http" else \
            _summary(outcome.previous_response_id, outcome.items_sent, turn.items_total)
        if outcome.retries:
            summary += f" (after: {'; '.join(outcome.retries)})"
        if outcome.dropped:
            summary += f"; {outcome.dropped} mid-answer: the client's stream was cut"
        flow.comment, flow.marked = summary, MARKS[action] if not outcome.retries else ":warning:"
        flow.metadata[BRIDGED] = {"transport": outcome.transport, "action": action,
                                  "previous_response_id": outcome.previous_response_id,
                                  "items_total": turn.items_total, "items_sent": outcome.items_sent,
                                  "retries": list(outcome.retries), "dropped": outcome.dropped,
                                  "sent_bytes": outcome.sent_bytes}  # over sockets, every attempt's
        self._debug("%s (%s)", summary, job.label)

    def _refused(self, scope: str, label: str, status: int) -> None:
        if 400 <= status < 500 and status not in (408, 429):
            self.upstreams.mark("lacks_websocket", scope)  # no WebSocket mode: forward mode's policy, as without us
            self._refuses(scope, label, f"refused the WebSocket upgrade ({status})")
        else:
            self._resting.put(scope, time.monotonic() + REST_S)
            self._debug("ws: %s refused the upgrade for now (%d); over HTTP for %ds", label, status, REST_S)

    def _refuses(self, scope: str, label: str, why: str, period: float | None = None) -> None:
        """The verdict that this upstream + credential's sockets are no use:
        HTTP, with forward mode's own policy, for ``period`` (the store's
        time to live when None), on every replica."""
        if self.upstreams.mark("refuses_websocket", scope, period):
            logger.info("stateful-responses: %s %s; HTTP from now on", label, why)
        self.state.flush()

    # -- housekeeping ------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            self._close(self.pool.sweep())
            now = time.monotonic()
            for scope in [s for s, until in self._resting.items() if until <= now]:
                del self._resting[scope]

    def _close_all(self) -> None:
        self._close(self.pool.close_all())

    @staticmethod
    def _close(connections: list) -> None:
        for connection in connections:
            connection.close_soon()

    def _debug(self, msg: str, *args) -> None:
        if self.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _socket_refuses(reading: Reading) -> bool:
    """A request WebSocket mode does not take: a background one (the API
    refuses it there), one already holding a field of the socket's own, or a
    compaction trigger (never continued from a socket's memory: docs/compaction.md)."""
    fields = reading.fields
    return bytes(fields.get("background", b"")) == b"true" or "type" in fields or "generate" in fields \
        or any(map(is_compaction_trigger, reading.raw_items or ()))


def _summary(previous: str | None, sent: int, total: int) -> str:
    if previous is not None:
        return f"ws: continued from {previous}: {sent} of {total} items sent"
    return f"ws: full: {total} items"
