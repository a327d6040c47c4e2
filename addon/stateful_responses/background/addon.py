"""Background responses on every upstream (mitmproxy glue).

``Background`` (early in the hook order) answers a ``background: true``
create itself where the upstream has no background mode, and every request
that names one of its jobs: ``GET`` (JSON, or the event stream with
``starting_after``), ``cancel``, ``DELETE``, ``input_items``, and a
``previous_response_id`` naming a finished job (sent as the upstream's id).
Where the upstream's verdict is unknown, the client's create goes upstream as
it is (a probe) for ``PROBE_WAIT`` at most: a native answer passes, a
refusal or a synchronous answer makes the job the proxy's.

A job runs as a request the proxy replays through mitmproxy (``ReplayHandler``),
so that every addon plans it as any client's: store emulation expands it,
forward mode continues it, the bridge takes it. ``BackgroundAnswers`` (late)
taps its answer and appends the events to the job's log (``jobs.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit

from mitmproxy import ctx, http

from ..counters import Counters
from ..flows import RETRY_OF, PerFlow, internal_error, request_of
from ..settings import Config
from ..state.access import StateAccess
from ..state.storage import StorageError, log_entry
from ..store_emulation.turns import Tenant
from ..tenancy import Tenancy, credential_material
from ..upstreams import TRANSIENT_STATUSES, UNAVAILABLE_STATUSES, Upstreams
from ..websocket.loopback import PATH_PREFIX, Answer, Loopback
from . import jobs as core
from .jobs import JOBS, LEASES, Entry, Jobs, JobView, Relabel, SSEReader

logger = logging.getLogger(__name__)

ROUTE = re.compile(r"^(?P<base>.*?)/responses(?:/(?P<id>[^/]+)(?:/(?P<action>cancel|input_items))?)?/?$")
# A body that may ask for background or continue a job of ours (a prefilter: the parsed body decides).
MAY_CONCERN_US = re.compile(rb'"background"\s*:\s*true|"previous_response_id"\s*:\s*"resp_[0-9a-f]{48}"')
JOB = "stateful_background_job"  # flow.metadata: the job a replayed flow runs
SERVED = "stateful_background_served"  # flow.metadata: a client's flow the loopback server streams a job's events to
PROBE_WAIT = 0.3  # seconds a create waits for an upstream of unknown verdict before the proxy answers it
POLL_S = 0.1  # a stream served from another replica's job looks for new entries this often
WRITE_WAIT = 2.0  # a create's answer waits this long at most for its job to be in the store


def _json(status: int, body: object) -> http.Response:
    return http.Response.make(status, json.dumps(body).encode(), {"content-type": "application/json"})


def _not_found(response_id: str) -> http.Response:
    return _json(404, {"error": {"message": f"Response with id '{response_id}' not found.",
                                 "type": "invalid_request_error", "param": None, "code": None}})


def _unavailable() -> http.Response:
    return _json(503, {"error": {"message": "The proxy's state store is unavailable; retry shortly.",
                                 "type": "server_error", "param": None, "code": None}})


@dataclass
class Run:
    """A job this process runs."""

    job_id: str
    key: bytes
    tenant: Tenant
    credential: bytes
    scope: str
    body: dict
    template: http.HTTPFlow  # the client's create, before any change: what the replay copies
    queued: dict
    relabel: Relabel
    probing: bool
    committed: bool = False  # the client was answered with the job: it is the proxy's
    decided: asyncio.Future | None = None  # the probe's verdict, for the create waiting on it
    events: int = 0
    size: int = 0
    reader: SSEReader = field(default_factory=SSEReader)
    body_seen: bytearray = field(default_factory=bytearray)
    streamed: bool = False
    tapped: bool = False  # the answer came from upstream through our tap (not made by an addon of ours)
    native: bool | None = None  # a probe's stream: the upstream ran it in its own background mode
    pending: list = field(default_factory=list)  # a probe's events before the job was committed
    task: asyncio.Task | None = None
    handler: object | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False

    @property
    def stored(self) -> bool:
        return self.body.get("store") is not False


class Background:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, upstreams: Upstreams,
                 state: StateAccess, jobs: Jobs) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.upstreams = upstreams
        self.state = state
        self.jobs = jobs
        self.loopback = Loopback(self._serve)
        self._streams: dict[str, tuple[Tenant, str, int]] = {}  # token -> (tenant, job id, starting_after)
        self._runs: dict[bytes, Run] = {}  # by job key
        self._by_flow: PerFlow[Run] = PerFlow()
        self.answers = BackgroundAnswers(self)
        self.replica = b""  # this proxy, across its restarts (``jobs.replica_id``)

    def running(self) -> None:
        listen = f"{ctx.options.listen_host}:{ctx.options.listen_port}:{','.join(ctx.options.mode)}"
        self.replica = core.replica_id(socket.gethostname(), os.path.expanduser(ctx.options.confdir), listen)

    def done(self) -> None:
        self.loopback.close()
        for run in list(self._runs.values()):
            if run.task is not None:
                run.task.cancel()

    # -- requests ----------------------------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        s = self.config.settings
        if not s.enabled or s.background == "off" or flow.response is not None \
                or JOB in flow.metadata or flow.metadata.get(RETRY_OF) is not None:
            return
        match = ROUTE.match(urlsplit(flow.request.url).path)
        if match is None or not s.url_matches(flow.request.url):
            return
        try:
            response_id = match["id"]
            if response_id is None and flow.request.method == "POST":
                await self._create(flow)
            elif response_id is not None and core.is_ours(response_id):
                await self._endpoint(flow, response_id, match["action"])
        except StorageError:
            flow.response = _unavailable()
        except Exception:
            internal_error(self.counters, "answering a background response")

    async def _create(self, flow: http.HTTPFlow) -> None:
        content = flow.request.get_content(strict=False) or b""  # undecodable: its bytes, which ask nothing
        if not MAY_CONCERN_US.search(content):  # most requests: no full parse of a long history on the event loop
            return
        try:
            body = json.loads(content)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        await self.state.ready()  # the store's secret names the tenant's keys
        credential = credential_material(request_of(flow))
        tenant = Tenant.under(self.tenancy, credential)
        previous = body.get("previous_response_id")
        if core.is_ours(previous):  # a continuation of a job: the upstream knows its answer by its own id
            job = await self._read(tenant, previous)
            if job is None or job.outcome != "completed" or not job.upstream_id:
                flow.response = _json(400, {"error": {
                    "message": f"Previous response with id '{previous}' not found.", "type": "invalid_request_error",
                    "param": "previous_response_id", "code": "previous_response_not_found"}})
                return
            body["previous_response_id"] = job.upstream_id
            flow.request.content = json.dumps(body).encode()
        if body.get("background") is not True or not isinstance(body.get("model"), str):
            return
        base = f"{urlsplit(flow.request.url).scheme}://{urlsplit(flow.request.url).netloc}" \
               f"{ROUTE.match(urlsplit(flow.request.url).path)['base']}"
        scope, label = self.tenancy.scope(base, credential)
        if self.upstreams.has("native_background", scope) or not self.config.settings.model_matches(body["model"]):
            return
        if await self._jobs_at_once(tenant, credential) >= self.config.settings.background_jobs_per_credential:
            self._debug("background: %s has as many jobs running as it may; passed", label)
            return
        job_id = core.mint_id()
        key = Jobs.key(tenant, job_id)[0]
        queued = core.queued_response(body, job_id, int(time.time()))
        probing = not self.upstreams.has("lacks_background", scope)
        run = Run(job_id, key, tenant, credential, scope, body, flow.copy(), queued, Relabel(queued), probing)
        self._runs[key] = run
        if probing:
            run.decided = asyncio.get_running_loop().create_future()
        run.task = asyncio.get_running_loop().create_task(self._run(run))
        if probing:
            await asyncio.wait({run.decided}, timeout=PROBE_WAIT)
            if run.decided.done() and not run.committed:
                verdict, answer = run.decided.result()
                if verdict in ("native", "error"):  # the upstream's own answer is the client's
                    self._runs.pop(key, None)
                    if answer is not None:
                        flow.response = _whole(answer)
                    self._debug("background: %s answered the create itself (%s)", label, verdict)
                    return
        if run.ended:  # the run broke before the proxy took the job: the request goes as the client sent it
            self._runs.pop(key, None)
            return
        await self._commit(run)
        self._debug("background: %s job %s run by the proxy", label, job_id)
        self.counters.requests += 1
        if body.get("stream") is True:
            await self._stream_to(flow, tenant, job_id, -1)
        else:
            flow.response = _json(200, queued)

    async def _commit(self, run: Run) -> None:
        """The job is the proxy's: its head and lease are in the store before the client has its id."""
        if run.committed:
            return
        run.committed = True
        created = {"type": "response.created", "response": run.queued}
        head = Entry([created, {"type": "response.queued", "response": run.queued}],
                     head={"response": run.queued, "stream": run.body.get("stream") is True})
        run.size += self.jobs.append(run.tenant, run.key, head, start=True, stored=run.stored)
        run.events += 2
        self.jobs.lease(run.key, self.config.settings.background_lease_s, self.replica)
        self.jobs.started(run.tenant, run.key)
        pending, run.pending = run.pending, []
        self.log(run, pending)
        await self.state.written(self.state.flush(), WRITE_WAIT, through_outage=True)

    async def _endpoint(self, flow: http.HTTPFlow, response_id: str, action: str | None) -> None:
        await self.state.ready()
        tenant = Tenant.under(self.tenancy, _credential_without_api_query(flow))
        job = await self._read(tenant, response_id)
        if job is None:
            flow.response = _not_found(response_id)
            return
        method = flow.request.method
        query = dict(parse_qsl(urlsplit(flow.request.url).query))
        if action is None and method == "GET":
            if query.get("stream") == "true":
                after = query.get("starting_after")
                await self._stream_to(flow, tenant, response_id,
                                      int(after) if after is not None and after.lstrip("-").isdigit() else -1)
            else:
                flow.response = _json(200, job.response)
        elif action == "cancel" and method == "POST":
            flow.response = _json(200, (await self._cancel(tenant, response_id, job)).response)
        elif action == "input_items" and method == "GET" and job.upstream_id:
            flow.request.path = flow.request.path.replace(response_id, job.upstream_id, 1)
        elif action is None and method == "DELETE":
            if job.outcome is None:
                await self._cancel(tenant, response_id, job)
            self.jobs.drop(Jobs.key(tenant, response_id)[0])
            await self.state.written(self.state.flush(), WRITE_WAIT, through_outage=True)
            if job.upstream_id:
                flow.request.path = flow.request.path.replace(response_id, job.upstream_id, 1)
            else:
                flow.response = _json(200, {"id": response_id, "object": "response", "deleted": True})
        else:
            flow.response = _not_found(response_id)

    async def _cancel(self, tenant: Tenant, job_id: str, job: JobView) -> JobView:
        """Cancel: a finished job is returned as it is; an unfinished one gets a
        cancel mark (first in its log wins against a late end), and its run, on
        this replica or (at its next heartbeat) another, is abandoned."""
        if job.outcome is not None:
            return job
        key = Jobs.key(tenant, job_id)[0]
        self.jobs.append(tenant, key, Entry(cancelled=True), stored=job.stored)
        await self.state.written(self.state.flush(), WRITE_WAIT, through_outage=True)
        if (run := self._runs.get(key)) is not None:
            self._abandon(run)
        return await self._read(tenant, job_id) or job

    # -- reading a job -----------------------------------------------------------------------------------------

    async def _read(self, tenant: Tenant, job_id: str) -> JobView | None:
        """The job as its log says, failed first if its process is gone."""
        for key in Jobs.key(tenant, job_id):
            length = core.length_of(await self.state.get_strict(JOBS, [key]), key)
            if not length:
                continue
            indexes = core.tail_indexes(length)
            records = await self.state.get_strict(JOBS, [log_entry(key, i) for i in indexes])
            job = core.view(core.opened(tenant, key, records, indexes), length)
            if job is None:
                continue
            if job.outcome is None and key not in self._runs and await self._orphaned(key):
                self.jobs.append(tenant, key, Entry([core.failed_event(
                    job.head["response"], "The proxy running this background response stopped before it finished.")]),
                    stored=job.stored)
                await self.state.written(self.state.flush(), WRITE_WAIT, through_outage=True)
                return await self._read(tenant, job_id)
            return job
        return None

    async def _jobs_at_once(self, tenant: Tenant, credential: bytes) -> int:
        """The tenant's jobs running now on every replica: those of its
        ledger's latest whose lease is alive (this process's own, if the store
        cannot say)."""
        here = sum(r.credential == credential for r in self._runs.values())
        ledger = Jobs.ledger_key(tenant)
        try:
            length = core.length_of(await self.state.get_strict(JOBS, [ledger]), ledger)
            indexes = range(max(0, length - 2 * self.config.settings.background_jobs_per_credential), length)
            listed = await self.state.get_strict(JOBS, [log_entry(ledger, i) for i in indexes])
            keys = list(listed.values())
            leases = await self.state.get_strict(LEASES, keys) if keys else {}
        except StorageError:
            return here
        now = time.time()
        return max(here, sum(core.lease_alive(leases.get(key), now, self.replica, key in self._runs)
                             for key in keys))

    async def _orphaned(self, key: bytes) -> bool:
        leases = await self.state.get_strict(LEASES, [key])
        return not core.lease_alive(leases.get(key), time.time(), self.replica, key in self._runs)

    async def _entries(self, tenant: Tenant, key: bytes, start: int) -> tuple[int, list[Entry]]:
        length = core.length_of(await self.state.get_strict(JOBS, [key]), key)
        indexes = list(range(start, min(length, start + 256)))
        records = await self.state.get_strict(JOBS, [log_entry(key, i) for i in indexes]) if indexes else {}
        opened = core.opened(tenant, key, records, indexes)
        entries = []
        for index in indexes:  # up to the first entry not readable yet
            if index not in opened:
                break
            entries.append(opened[index])
        return length, entries

    # -- serving a job's events --------------------------------------------------------------------------------

    async def _stream_to(self, flow: http.HTTPFlow, tenant: Tenant, job_id: str, after: int) -> None:
        """Point the flow at the loopback server, which streams the job's log."""
        await self.loopback.start()
        token = secrets.token_urlsafe(24)
        self._streams[token] = (tenant, job_id, after)
        flow.metadata[SERVED] = job_id
        where = f"127.0.0.1:{self.loopback.port}"
        flow.request.data = http.Request.make("GET", f"http://{where}{PATH_PREFIX}{token}", b"",
                                              {"host": where, "content-length": "0"}).data

    async def _serve(self, token: str, answer: Answer) -> None:
        stream = self._streams.pop(token, None)
        if stream is None:
            await answer.json(404, b'{"error": {"message": "Not found.", "type": "invalid_request_error"}}')
            return
        tenant, job_id, after = stream
        keys = Jobs.key(tenant, job_id)
        key, index, number, deadline = keys[0], 0, 0, time.monotonic() + core.MAX_RUN_S
        try:
            while time.monotonic() < deadline and not answer.abandoned:
                length, entries = await self._entries(tenant, key, index)
                for entry in entries:
                    for event, last in core.numbered([entry], number):
                        if event:
                            number = event["sequence_number"] + 1
                            if event["sequence_number"] > after:
                                await answer.event(event["type"], json.dumps(event).encode())
                        if last:
                            await self._end(answer)
                            return
                index += len(entries)
                if index < length:
                    continue
                if index >= length and key not in self._runs:
                    job = await self._read(tenant, job_id)  # fails an orphan: its end comes next
                    if job is not None and job.outcome == "cancelled" and index >= job.length:
                        await self._end(answer)
                        return
                run = self._runs.get(key)
                if run is not None:
                    run.wake.clear()
                    await asyncio.wait({asyncio.ensure_future(run.wake.wait())}, timeout=1.0)
                else:
                    await asyncio.sleep(POLL_S)
        except StorageError:
            answer.drop()
            return
        answer.drop()

    @staticmethod
    async def _end(answer: Answer) -> None:
        if not answer.started:
            await answer.whole(200, (("content-type", "text/event-stream; charset=utf-8"),), b"")
        else:
            await answer.end_stream()

    # -- running a job -----------------------------------------------------------------------------------------

    async def _run(self, run: Run) -> None:
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(run))
        try:
            await asyncio.wait_for(self._attempts(run), core.MAX_RUN_S)
        except asyncio.CancelledError:
            pass
        except asyncio.TimeoutError:
            await self._finish(run, [run.relabel.failure({"message": "The background response ran too long."})])
        except Exception:
            internal_error(self.counters, "running a background response")
            await self._finish(run, [run.relabel.failure(None)])
        finally:
            heartbeat.cancel()
            if not run.committed:
                run.ended = True
            self._decide(run, "emulate", None)
            if run.committed and not run.ended:
                run.ended = True
                self.jobs.release(run.key)
                self.state.flush()
            self._runs.pop(run.key, None)
            run.wake.set()

    async def _attempts(self, run: Run) -> None:
        if run.probing:
            child = await self._replay(run, run.body)
            verdict = self._judge(run, child)
            if verdict == "native":
                self.upstreams.mark("native_background", run.scope)
                self.state.flush()
                if run.streamed:  # cancelled upstream as soon as its first event showed it
                    if not run.committed:
                        return
                else:
                    assert child is not None
                    if run.committed:
                        await self._cancel_upstream(run, child)
                    self._decide(run, "native", child.response)
                    if not run.committed:
                        return
            elif verdict == "refused":
                self.upstreams.mark("lacks_background", run.scope)
                self.state.flush()
            elif verdict == "answered":
                self.upstreams.mark("lacks_background", run.scope)
                self.state.flush()
                self._decide(run, "emulate", None)
                await self._wait_committed(run)
                if not run.ended:
                    await self._take_answer(run, child)
                return
            else:  # an error that teaches nothing: the client's own answer, or the job's end
                assert child is not None
                self._decide(run, "error", child.response)
                if run.committed:
                    await self._finish(run, [run.relabel.failure(_error_of(child.response))])
                return
            self._decide(run, "emulate", None)
        await self._wait_committed(run)
        run.probing = False  # the job's own run: nothing of the probe was logged
        run.reader, run.body_seen, run.streamed, run.tapped = SSEReader(), bytearray(), False, False
        run.relabel = Relabel(run.queued)
        child = await self._replay(run, core.run_body(run.body))
        if not run.ended:
            await self._take_answer(run, child)

    async def _wait_committed(self, run: Run) -> None:
        while not run.committed:
            await asyncio.sleep(0.01)

    def _decide(self, run: Run, verdict: str, answer: http.Response | None) -> None:
        if run.decided is not None and not run.decided.done():
            run.decided.set_result((verdict, answer))

    def _judge(self, run: Run, child: http.HTTPFlow | None) -> str:
        """What the probe's answer says of the upstream: native, refused (a
        4xx about ``background``), answered (synchronously: it ignored the
        field), or error (anything that teaches nothing)."""
        if child is None or child.response is None:
            return "error"
        response = child.response
        if child.server_conn.timestamp_start is None:  # answered by an addon of ours, not the upstream: no verdict
            return "error"
        if run.streamed:
            return "native" if run.relabel.native else "answered"
        status = response.status_code
        if status in TRANSIENT_STATUSES or status in UNAVAILABLE_STATUSES or status >= 500 or status in (401, 403):
            return "error"
        try:
            answer = json.loads(response.get_content() or b"")
        except ValueError:
            return "error"
        if 400 <= status < 500:
            return "refused" if "background" in json.dumps(answer).lower() else "error"
        if not isinstance(answer, dict) or answer.get("object") != "response":
            return "error"
        return "native" if answer.get("background") is True else "answered"

    async def _take_answer(self, run: Run, child: http.HTTPFlow | None) -> None:
        """The run's answer, once it is whole: its end (a streamed one was logged as it came)."""
        if run.ended:
            return
        if child is None or child.response is None or (child.error is not None and not run.streamed):
            await self._finish(run, [run.relabel.failure({"message": f"The upstream failed to answer: "
                                                                     f"{child.error if child else 'no answer'}"})])
            return
        if run.streamed:
            if not run.relabel.finished:
                await self._finish(run, [run.relabel.failure({"message": "The upstream's stream ended early."})])
            else:
                await self._finish(run, [])
            return
        try:
            answer = json.loads(child.response.get_content() or b"")
        except ValueError:
            answer = None
        if child.response.status_code >= 300 or not isinstance(answer, dict) or answer.get("object") != "response":
            await self._finish(run, [run.relabel.failure(_error_of(child.response))])
            return
        await self._finish(run, run.relabel.answered(answer))

    async def _replay(self, run: Run, body: dict) -> http.HTTPFlow | None:
        from mitmproxy.addons.clientplayback import ReplayHandler

        child = run.template.copy()
        child.request.content = json.dumps(body).encode()
        if "content-encoding" in child.request.headers:
            del child.request.headers["content-encoding"]
        child.response = child.error = None
        child.metadata = {key: run.template.metadata[key] for key in ("proxyauth",) if key in run.template.metadata}
        child.metadata[JOB] = run.job_id
        child.is_replay = "request"
        child.comment = f"background response {run.job_id}"
        self._by_flow.put(child, run)
        handler = run.handler = ReplayHandler(child, ctx.options)
        try:
            await handler.replay()
        except asyncio.CancelledError:
            self._close(handler)
            raise
        if child.response is not None and run.tapped and not run.streamed:  # streamed to our tap: its bytes
            child.response.raw_content = bytes(run.body_seen)
        return child

    @staticmethod
    def _close(handler: object) -> None:
        for io in getattr(handler, "transports", {}).values():
            if io.handler is not None:
                io.handler.cancel()

    def _abandon(self, run: Run) -> None:
        """Stop the run: its upstream request is closed, nothing more is logged, its lease is given up."""
        if not run.ended and run.committed:
            self.jobs.release(run.key)
            self.state.flush()
        run.ended = True
        if run.handler is not None:
            self._close(run.handler)
        if run.task is not None:
            run.task.cancel()

    async def _cancel_upstream(self, run: Run, child: http.HTTPFlow | None) -> None:
        """A probe the upstream ran in its own background mode after the proxy
        took the job (or whose stream the client does not get): cancelled there."""
        upstream_id = run.relabel.upstream_id
        if upstream_id is None and child is not None and child.response is not None:
            try:
                upstream_id = json.loads(child.response.get_content() or b"").get("id")
            except (ValueError, AttributeError):
                upstream_id = None
        if run.handler is not None:
            self._close(run.handler)
        if not isinstance(upstream_id, str):
            return
        from mitmproxy.addons.clientplayback import ReplayHandler

        cancel = run.template.copy()
        cancel.request.method = "POST"
        cancel.request.path = f"{ROUTE.match(urlsplit(cancel.request.url).path)['base']}/responses/{upstream_id}/cancel"
        cancel.request.content = b""
        cancel.response = cancel.error = None
        cancel.metadata = {JOB: run.job_id, RETRY_OF: run.template.id}
        cancel.is_replay = "request"
        try:
            await asyncio.wait_for(ReplayHandler(cancel, ctx.options).replay(), 10)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - best effort
            pass

    async def _heartbeat(self, run: Run) -> None:
        """Renew the lease while the run lives; abandon it when another replica cancelled the job."""
        period = max(0.5, self.config.settings.background_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            if not run.committed:
                continue
            self.jobs.lease(run.key, self.config.settings.background_lease_s, self.replica)
            self.state.flush()
            try:
                job = await self._read(run.tenant, run.job_id)
            except StorageError:
                continue
            if job is not None and job.outcome == "cancelled":
                self._abandon(run)
                return

    # -- the log -----------------------------------------------------------------------------------------------

    def log(self, run: Run, events: list[dict]) -> None:
        """Append the events one chunk gave (a committed job's); its end ends the run."""
        if not events or run.ended:
            return
        run.events += len(events)
        too_large = run.events > core.MAX_EVENTS or run.size > core.MAX_BYTES
        if too_large:
            events = [run.relabel.failure({"message": "The response is larger than the proxy keeps for a "
                                                      "background response."})]
        finished = run.relabel.finished
        run.size += self.jobs.append(run.tenant, run.key,
                                     Entry(events, upstream_id=run.relabel.upstream_id if finished else None),
                                     stored=run.stored)
        if finished:
            run.ended = True
            self.jobs.release(run.key)
        self.state.flush()
        run.wake.set()
        if too_large:
            self._abandon(run)

    async def _finish(self, run: Run, events: list[dict]) -> None:
        if run.ended or not run.committed:
            return
        self.log(run, events)
        await self.state.written(self.state.flush(), WRITE_WAIT, through_outage=True)

    def _debug(self, message: str, *args: object) -> None:
        if self.config.settings.debug:
            logger.info(message, *args)


def _whole(answer: http.Response) -> http.Response:
    """The probe's answer, made anew for the client's flow: its body whole, its framing mitmproxy's."""
    try:
        body, dropped = answer.get_content() or b"", ("content-length", "transfer-encoding", "content-encoding")
    except ValueError:  # not decodable: as it came, with its encoding named
        body, dropped = answer.raw_content or b"", ("content-length", "transfer-encoding")
    headers = [(k, v) for k, v in answer.headers.items(multi=True) if k.lower() not in dropped]
    response = http.Response.make(answer.status_code, body, headers)
    response.reason = answer.reason
    return response


API_QUERY = frozenset({"stream", "starting_after", "include", "include[]", "include_obfuscation"})


def _credential_without_api_query(flow: http.HTTPFlow) -> bytes:
    """The tenant of a GET of a job: its query's API parameters are no
    credential (a gateway's key in the query still is)."""
    request = request_of(flow)
    parts = urlsplit(request.url)
    kept = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in API_QUERY]
    url = parts._replace(query=urlencode(kept)).geturl()
    return credential_material(dataclasses.replace(request, url=url))


def _error_of(response: http.Response | None) -> dict:
    if response is None:
        return {"message": "The upstream failed to answer."}
    try:
        error = json.loads(response.get_content() or b"").get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    return {"message": f"The upstream answered {response.status_code}."}


class BackgroundAnswers:
    """A job's answer, tapped (late in the hook order: around every other
    tap): each chunk's events go to the job's log as they come."""

    def __init__(self, background: Background) -> None:
        self.background = background

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if SERVED in flow.metadata and flow.response is not None and not flow.response.stream:
            flow.response.stream = True  # each event on to the client as it comes
        run = self.background._by_flow.get(flow) if JOB in flow.metadata else None
        if run is None or flow.response is None:
            return
        sse = "text/event-stream" in flow.response.headers.get("content-type", "") and \
            flow.response.status_code == 200 and not flow.response.headers.get("content-encoding")
        downstream = flow.response.stream
        background = self.background
        run.tapped = True

        def tap(chunk: bytes) -> bytes:
            try:
                if sse:
                    run.streamed = True
                    self._events(run, run.reader.feed(chunk))
                else:
                    run.body_seen.extend(chunk)
            except Exception:
                internal_error(background.counters, "logging a background response")
            return downstream(chunk) if callable(downstream) else chunk

        flow.response.stream = tap

    def _events(self, run: Run, upstream: list[dict]) -> None:
        background = self.background
        if run.probing:
            if run.native is None and upstream:
                first = upstream[0].get("response") if isinstance(upstream[0], dict) else None
                run.native = isinstance(first, dict) and first.get("background") is True
                if run.native:  # the upstream's own background stream: the client's request goes there itself
                    run.relabel.upstream_id = first.get("id") if isinstance(first.get("id"), str) else None
                    background.upstreams.mark("native_background", run.scope)
                    background._decide(run, "native", None)
                    asyncio.get_running_loop().create_task(background._cancel_upstream(run, None))
                else:
                    background.upstreams.mark("lacks_background", run.scope)
                    background._decide(run, "emulate", None)
            if run.native:
                return
        events = run.relabel.events(upstream)
        if run.committed:
            background.log(run, events)
        else:
            run.pending += events
