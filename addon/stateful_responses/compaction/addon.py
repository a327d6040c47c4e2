"""Compaction's mitmproxy glue (``stateful_compaction``, docs/compaction.md).

Listed after the emulations (a chain or conversation they expand may hold the
proxy's own compaction items) and before the WebSocket bridge and forward
mode (which plan and send what it leaves: the summaries in place of the
items). For every Responses request, whatever transport then carries it, a
compaction item the proxy made becomes its summary as a message; one it made
but cannot open, or another server's on an upstream that lacks compaction,
is refused by name. Where an upstream + credential lacks compaction (a
verdict in ``upstreams.py``: 404/405 on ``/responses/compact``, a compaction
item or trigger refused as unknown, a trigger answered with no compaction
item), the proxy answers ``/responses/compact`` and a ``compaction_trigger``
itself; until the verdict is known the request goes upstream, and a refusal
that teaches it is replaced by the proxy's answer. A compaction request with a
``previous_response_id`` the proxy keeps is expanded by store emulation
(``expand_compact``) wherever it goes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http

from ..answer_reader import AnswerReader
from ..counters import Counters
from ..flows import ANSWERED, CLIENT_BODY, DECISION, HELD, RETRY_OF, PerFlow, client_flow, hold, internal_error, request_of
from ..items import is_compaction_trigger, strict_loads
from ..replays import Replays
from ..request_reader import Reader, Skip, splice
from ..settings import Config
from ..state.access import StateAccess
from ..store_emulation.turns import Tenant
from ..tenancy import Tenancy, credential_material
from ..upstreams import Upstreams
from . import core

logger = logging.getLogger(__name__)

COMPACTION = "stateful_compaction"  # what the proxy did about compaction in this flow
OWN = "stateful_compaction_summary"  # the proxy's own summary request: every addon leaves it alone
SUMMARY_TIMEOUT = 600.0  # a summary of a long window takes a model as long as a long answer


@dataclass
class _Pending:
    """A request sent upstream whose answer teaches whether the upstream has compaction."""

    kind: str  # "compact", "trigger" or "items"
    scope: str
    label: str
    tenant: Tenant
    model: str
    items: list[bytes]  # the window, as the upstream was sent it
    retained: list[Any] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    previous_response_id: str | None = None  # a chain the proxy does not keep: the upstream's to expand
    reader: AnswerReader | None = None


def _json_response(status: int, payload: object, content_type: str = "application/json") -> http.Response:
    return http.Response.make(status, json.dumps(payload).encode(), {"Content-Type": content_type})


class Compaction:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, upstreams: Upstreams,
                 state: StateAccess, replays: Replays,
                 expand_compact: Callable[[http.HTTPFlow], Awaitable[bytes | None]]) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.upstreams = upstreams
        self.state = state
        self.replays = replays
        self.expand_compact = expand_compact
        self._pending: PerFlow[_Pending] = PerFlow()

    @property
    def provides(self) -> bool:
        return self.config.settings.compaction == "auto"

    # -- requests ------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        s = self.config.settings
        if not s.enabled or flow.response is not None or OWN in flow.metadata \
                or flow.request.method.upper() != "POST" or flow.request.raw_content is None:
            return
        path = urlsplit(flow.request.url).path.rstrip("/")
        try:
            if path.endswith("/responses/compact") and s.url_matches(flow.request.url):
                if flow.metadata.get(RETRY_OF) is None:
                    await self._compact(flow)
            elif path.endswith("/responses"):
                await self._create(flow)
        except Exception:
            internal_error(self.counters, "handling compaction")

    async def _compact(self, flow: http.HTTPFlow) -> None:
        await self.state.ready()
        expanded = await self.expand_compact(flow)
        if expanded is not None:
            flow.metadata.setdefault(CLIENT_BODY, flow.request.raw_content)
            flow.request.content = expanded
            flow.comment = "compaction: the chain expanded for /responses/compact"
        try:
            body = strict_loads(flow.request.get_content(strict=False) or b"")
        except (ValueError, RecursionError):
            return
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return
        base = flow.request.url.split("?")[0].rstrip("/").removesuffix("/compact").removesuffix("/responses")
        credential = credential_material(request_of(flow))
        scope, label = self.tenancy.scope(base, credential)
        raw_input = body.get("input")
        items = [raw_input] if isinstance(raw_input, str) else raw_input if isinstance(raw_input, list) else []
        items = [{"role": "user", "content": i} if isinstance(i, str) else i for i in items]
        raw_items = [json.dumps(i).encode() for i in items]
        tenant = Tenant.under(self.tenancy, credential)
        try:
            window = core.substitute(raw_items, tenant)
        except core.ApiError as e:
            self._refuse(flow, e)
            return
        if window.replaced:  # the upstream gets the summaries, whether it compacts or the proxy does
            flow.metadata.setdefault(CLIENT_BODY, flow.request.raw_content)
            body["input"] = [json.loads(i) for i in window.items]
            flow.request.content = json.dumps(body).encode()
        previous = body.get("previous_response_id")
        pending = _Pending("compact", scope, label, tenant, body["model"], window.items,
                           retained=core.retained_user_messages(raw_items),
                           previous_response_id=previous if isinstance(previous, str) else None)
        if self.upstreams.has("lacks_compaction", scope) and self.provides:
            if window.foreign:
                self._refuse(flow, core.foreign(window.foreign[0]))
                return
            await self._answer(flow, pending)
        elif not self.upstreams.has("has_compaction", scope):
            self._pending.put(flow, pending)

    async def _create(self, flow: http.HTTPFlow) -> None:
        raw = flow.request.raw_content or b""
        if b"compaction" not in raw and b"context_management" not in raw:
            return  # nothing of compaction here: no reading at all
        await self.state.ready()
        reading = self.reader.read(request_of(flow), count=False, conversations=True)
        if isinstance(reading, Skip) or not reading.raw_items:
            return
        items = reading.raw_items
        # A conversation the proxy does not keep is the upstream's: the proxy could not summarize it.
        triggered = bool(items) and is_compaction_trigger(items[-1]) and reading.conversation is None
        tenant = Tenant.under(self.tenancy, reading.credential)
        lacks = self.upstreams.has("lacks_compaction", reading.scope)
        try:
            window = core.substitute(items, tenant)
            if window.foreign and lacks:
                raise core.foreign(window.foreign[0])
            threshold = core.compact_threshold(_field(reading.fields, "context_management"))
            if threshold is not None and lacks and self.provides \
                    and (estimated := core.estimated_tokens(window.items)) >= threshold:
                raise core.context_management_refused(threshold, estimated)
        except core.ApiError as e:
            if flow.metadata.get(RETRY_OF) is None:
                self._refuse(flow, e)
            return
        if window.replaced:
            flow.metadata.setdefault(CLIENT_BODY, flow.request.raw_content)
            flow.request.content = splice(raw, reading.fields, {"input": b"[" + b",".join(window.items) + b"]"})
            flow.metadata[COMPACTION] = {"summaries": window.replaced}
            flow.comment = f"compaction: {window.replaced} compaction item(s) sent as their summary"
        if flow.metadata.get(RETRY_OF) is not None:
            return
        # Every answer to a trigger or to another server's item is judged, even where the upstream had
        # compaction: one that lost it (moved, reconfigured) shows it in the next refusal.
        if triggered:
            fields = {k: _field(reading.fields, k) for k in ("tools", "parallel_tool_calls")}
            pending = _Pending("trigger", reading.scope, reading.label, tenant, reading.model, window.items,
                               fields=fields, stream=_field(reading.fields, "stream") is True,
                               previous_response_id=reading.previous if isinstance(reading.previous, str) else None)
            if lacks and self.provides:
                await self._answer(flow, pending)
            else:
                self._pending.put(flow, pending)
        elif window.foreign and not lacks:
            self._pending.put(flow, _Pending("items", reading.scope, reading.label, tenant, reading.model, []))

    def _refuse(self, flow: http.HTTPFlow, error: core.ApiError) -> None:
        _answered_here(flow)
        flow.response = _json_response(error.status, error.body)
        flow.metadata[COMPACTION] = {"refused": error.body["error"]["code"]}
        flow.comment = f"compaction: refused ({error.body['error']['code']})"

    # -- the proxy's own compaction --------------------------------------------------

    async def _answer(self, flow: http.HTTPFlow, pending: _Pending, upstream_status: int | None = None) -> None:
        """Compact the window with the upstream's own model and answer in the
        API's shape; the summary request's failure is the client's answer."""
        _answered_here(flow)
        request = flow.request.copy()
        path, _, query = request.path.partition("?")
        path = path.rstrip("/").removesuffix("/compact")
        request.path = path + (f"?{query}" if query else "")
        request.headers.pop("content-encoding", None)
        request.headers["content-type"] = "application/json"
        request.headers["accept-encoding"] = "identity"
        request.content = core.summary_request(pending.model, pending.items, pending.previous_response_id)
        answer, failure = await self.replays.send(
            flow, request, "the summary of a compaction", kind="proof", timeout=SUMMARY_TIMEOUT,
            metadata={OWN: True, DECISION: {"action": "pass", "reason": "the proxy's own compaction summary"}})
        summary, usage = None, None
        if failure is None and answer.status_code < 300:
            try:
                parsed = strict_loads(answer.get_content(strict=False) or b"")
            except (ValueError, RecursionError):
                parsed = None
            summary = core.summary_of(parsed)
            usage = parsed.get("usage") if isinstance(parsed, dict) else None
        if summary is None:
            flow.response = answer if answer.status_code >= 400 else _json_response(502, {"error": {
                "message": "The upstream gave no summary for the compaction the proxy makes for it.",
                "type": "server_error", "param": None, "code": None}})
            flow.metadata[COMPACTION] = {"summary_failed": answer.status_code}
            flow.comment = f"compaction: the summary request failed ({answer.status_code})"
            return
        item = core.compaction_item(core.seal(pending.tenant, summary))
        if pending.kind == "compact":
            flow.response = _json_response(200, core.compacted_response(pending.retained, item, usage))
        else:
            response = core.trigger_response(pending.model, item, usage, pending.fields)
            if pending.stream:
                flow.response = http.Response.make(200, core.trigger_events(response),
                                                   {"Content-Type": "text/event-stream; charset=utf-8"})
            else:
                flow.response = _json_response(200, response)
        flow.metadata[COMPACTION] = {"made_by_proxy": pending.kind, "upstream_answered": upstream_status}
        flow.comment = f"compaction: made by the proxy ({pending.kind}) with the upstream's model"
        self._debug("compacted %s for %s", pending.kind, pending.label)

    # -- answers: what they teach ---------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        pending = self._pending.get(client_flow(flow))
        if pending is None or flow.response is None or flow.metadata.get(RETRY_OF) is not None:
            return
        status = flow.response.status_code
        if pending.kind == "compact" or (400 <= status < 500 and pending.kind == "trigger"):
            hold(flow)  # small: the response hook may answer instead
        elif pending.kind == "trigger" and status < 300 and not flow.metadata.get(HELD):  # held: read whole later
            reader = pending.reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                                   flow.response.headers.get("content-encoding", ""))
            downstream = flow.response.stream

            def tap(chunk: bytes) -> bytes:
                reader.feed(chunk)  # never raises, never holds a byte back
                return downstream(chunk) if callable(downstream) else chunk

            flow.response.stream = tap

    async def response(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(RETRY_OF) is not None:
            return
        pending = self._pending.pop(flow)
        if pending is None or flow.response is None:
            return
        try:
            await self._judge(flow, pending)
        except Exception:
            internal_error(self.counters, "judging a compaction answer")

    async def _judge(self, flow: http.HTTPFlow, pending: _Pending) -> None:
        assert flow.response is not None
        status = flow.response.status_code
        body = flow.response.get_content(strict=False) or b"" if flow.response.raw_content is not None else b""
        if pending.kind == "compact":
            has = core.endpoint_verdict(status, body)
        elif status < 300:
            reader = pending.reader
            if reader is None:
                reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                      flow.response.headers.get("content-encoding", ""))
                reader.feed(flow.response.raw_content or b"")
            has = core.has_compaction_item(reader.finish()) if pending.kind == "trigger" else True
        else:
            has = False if core.refuses_compaction(status, body) else None
        if has is None:
            return  # a transient failure, or the request's own error: nothing learned
        if has:
            self.upstreams.mark("has_compaction", pending.scope)
            self.state.flush()
            return
        if self.upstreams.mark("lacks_compaction", pending.scope):
            logger.info("stateful-responses: %s lacks compaction (%d); %s", pending.label, status,
                        "the proxy compacts for it from now on" if self.provides else "stateful_compaction is off")
        self.state.flush()
        if self.provides and pending.kind != "items" and status >= 400:
            await self._answer(flow, pending, upstream_status=status)

    def _debug(self, msg: str, *args) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _answered_here(flow: http.HTTPFlow) -> None:
    """The proxy answers this flow: forward mode and the bridge have nothing to plan or send."""
    flow.metadata.setdefault(DECISION, {"action": "pass", "reason": "answered by the proxy's compaction"})
    flow.metadata[ANSWERED] = True


def _field(fields: dict, name: str) -> Any:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return json.loads(bytes(raw))
    except ValueError:
        return None
