"""Store emulation's mitmproxy glue: clients that send
``previous_response_id`` keep working where the upstream stores nothing,
forgets, or silently ignores the field.

``stateful_emulate``:

* ``off``: nothing recorded, nothing changed.
* ``auto``: every completed answer of a matched flow is recorded. A client's
  ``previous_response_id`` goes upstream as it is, unless the record shows the
  upstream cannot have it (its answer did not say it stored it, or that
  upstream + credential refused one before, or does not store at all): then
  the proxy expands the chain into full history. A refusal that names the id
  is retried invisibly with the chain expanded, streams included.
* ``always``: the proxy is the store: ``previous_response_id`` never reaches
  the upstream, an unknown id gets the API's error from the proxy itself, and
  retrieve / input_items / delete are answered from the record.

An expanded request then goes through forward mode like any full-history one
(an upstream that stores may still be sent only a delta). Listed before
ForwardMode, so that it plans the expanded body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from mitmproxy import http

from ..counters import Counters
from ..flows import CLIENT_BODY, EMULATION, HELD, RETRY_OF, ROUTED, end_still_to_come, hold, internal_error, \
    request_of
from ..reading import Reader, Reading, Skip, splice
from ..replays import Replays
from ..settings import Config
from ..sse import AnswerReader
from ..state.access import StateAccess
from ..state.storage import StorageError
from ..tenancy import Tenancy, credential_material
from ..upstreams import TRANSIENT_STATUSES, Upstreams
from .history import History, Turn, listed_items, response_json, string_input_item
from .turns import Tenant
from .walk import ChainError

logger = logging.getLogger(__name__)

MAX_FLOWS = 10_000
NOT_FOUND_RETRY = 0.1  # a turn another proxy has just written may take this long to be visible
LIST_PARAMETERS = frozenset({"limit", "order", "after", "before", "include", "include[]"})
_RESOURCE = re.compile(r"^(?P<base>.*)/responses/(?P<id>[^/]+)(?P<items>/input_items)?/?$")


@dataclass
class _Flow:
    """What emulation keeps about a flow between its request and its answer."""

    tenant: Tenant
    scope: str
    previous_response_id: str | None  # the client's
    raw_input: list[bytes]  # the client's input items, byte for byte
    client: http.Request  # the client's request
    moved: bool = False  # routed away from the upstream that holds the chain
    expanded: bytes | None = None  # the body sent instead, chain expanded
    reader: AnswerReader | None = None
    recorded: bool = False
    written: asyncio.Future | None = field(default=None, repr=False)


def _json_response(status: int, payload: object) -> http.Response:
    return http.Response.make(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})


def _not_found(response_id: str) -> http.Response:
    return _json_response(404, {"error": {"message": f"Response with id '{response_id}' not found.",
                                          "type": "invalid_request_error", "param": None, "code": None}})


def _names_the_refusal(body: bytes, response_id: str) -> bool:
    """A 4xx that is about the previous response: it names the field or the id
    (OpenAI's previous_response_not_found, vLLM's 404, "not supported")."""
    text = body.decode("utf-8", "replace").lower()
    return "previous_response" in text or "previous response" in text or response_id.lower() in text


class StoreEmulation:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, upstreams: Upstreams,
                 state: StateAccess, history: History, replays: Replays) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.upstreams = upstreams
        self.state = state
        self.history = history
        self.replays = replays
        self._flows: OrderedDict[str, _Flow] = OrderedDict()

    @property
    def mode(self) -> str:
        return self.config.settings.emulate

    # -- requests ------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if self.mode == "off" or flow.metadata.get(RETRY_OF) is not None or flow.response is not None:
            return
        await self.state.ready()
        try:
            method = flow.request.method.upper()
            if method == "POST":
                await self._create(flow)
            elif method in ("GET", "DELETE"):
                await self._resource(flow, method)
        except Exception:
            internal_error(self.counters, "emulating the store")

    async def _create(self, flow: http.HTTPFlow) -> None:
        client = flow.request.copy()
        reading = self.reader.read(request_of(flow, client), count=False)
        if isinstance(reading, Skip):
            return
        raw_input = reading.raw_items
        if raw_input is None:  # a string input is one user message
            raw_input = [string_input_item(bytes(reading.fields["input"]))]
        tenant = Tenant.of(self.tenancy.secret, reading.credential)
        previous = reading.previous if isinstance(reading.previous, str) else None
        moved = bool((flow.metadata.get(ROUTED) or {}).get("moved"))
        record = _Flow(tenant, reading.scope, previous, raw_input, client, moved)
        self._remember(flow.id, record)
        if previous is None:
            return  # full history: only recorded
        if self.mode == "auto" and not await self._upstream_cannot_have(record):
            flow.metadata[EMULATION] = {"previous_response_id": previous, "expanded": False}
            return  # sent as it is; a refusal naming it is retried expanded
        try:
            record.expanded = await self._expand(reading, record)
        except StorageError:
            return  # the record is out of reach: the request goes as the client sent it
        except ChainError as e:
            if self.mode == "always":
                flow.response = _json_response(400, e.body)
                flow.comment = f"emulated: {e.code} for {previous}"
                flow.metadata[EMULATION] = {"previous_response_id": previous, "error": e.code}
            return  # auto: the upstream may know an id the record does not
        flow.metadata[CLIENT_BODY] = client.raw_content
        flow.metadata[EMULATION] = {"previous_response_id": previous, "expanded": True}
        flow.comment = f"emulated: {previous} expanded"
        flow.request.content = record.expanded
        self._debug("expanded %s", previous)

    async def _upstream_cannot_have(self, record: _Flow) -> bool:
        """In auto mode: whether the record shows the upstream cannot continue
        from the client's id (so sending it would fail or, worse, be ignored)."""
        if self.upstreams.has("unsupported", record.scope) or self.upstreams.has("refuses_previous", record.scope):
            return True
        if record.moved:
            return True  # the router sent the turn away from the upstream that holds its chain
        assert record.previous_response_id is not None
        try:
            turn = await self.history.turn(record.tenant, record.previous_response_id, self.state.get_strict)
        except StorageError:
            return False
        return turn is not None and not turn.header.stored_upstream

    async def _expand(self, reading: Reading, record: _Flow) -> bytes:
        """The client's body with the chain its previous_response_id names in
        front of its input, that field dropped, every other byte its own."""
        assert record.previous_response_id is not None
        try:
            context = await self.history.context(record.tenant, record.previous_response_id, self.state.get_strict)
        except ChainError as e:
            if e.code != "previous_response_not_found":
                raise
            await asyncio.sleep(NOT_FOUND_RETRY)  # written by another proxy a moment ago?
            context = await self.history.context(record.tenant, record.previous_response_id, self.state.get_strict)
        items = b"[" + b",".join(context + record.raw_input) + b"]"
        return splice(record.client.raw_content or b"", reading.fields, {"input": items, "previous_response_id": None})

    async def full_history(self, flow: http.HTTPFlow, client: http.Request) -> bytes | None:
        """The client's request as full history (its chain expanded), for a
        turn that must move to another upstream; None when it already is full
        history, or when the record cannot expand it."""
        record = self._flows.get(flow.id)
        if record is not None and record.expanded is not None:
            return record.expanded
        if record is None or record.previous_response_id is None:
            return None
        reading = self.reader.read(request_of(flow, client), count=False)
        if isinstance(reading, Skip):
            return None
        try:
            return await self._expand(reading, record)
        except (ChainError, StorageError):
            return None

    # -- retrieve, input_items, delete --------------------------------------------------

    async def _resource(self, flow: http.HTTPFlow, method: str) -> None:
        url = urlsplit(flow.request.url)
        match = _RESOURCE.match(url.path)
        settings = self.config.settings
        if match is None or not settings.url_matches(flow.request.url):
            return
        response_id, listing = match["id"], bool(match["items"])
        if method == "DELETE" and listing:
            return
        # The query string is credential material (gateways take keys there),
        # except the list's own parameters.
        query = [(k, v) for k, v in parse_qsl(url.query, keep_blank_values=True) if k not in LIST_PARAMETERS]
        reading = request_of(flow)
        reading = dataclasses.replace(reading, url=urlunsplit(url._replace(query=urlencode(query))))
        credential = credential_material(reading)
        tenant = Tenant.of(self.tenancy.secret, credential)
        upstream = f"{url.scheme}://{url.netloc}{match['base']}"
        scope, _ = self.tenancy.scope(upstream, credential)
        answer_here = self.mode == "always" or self.upstreams.has("unsupported", scope) \
            or self.upstreams.has("refuses_previous", scope)
        if method == "DELETE" and not answer_here:
            # The upstream deletes its copy; ours must go too, or a later
            # refusal would bring the deleted response back from the record.
            self._remember(flow.id, _Flow(tenant, scope, response_id, [], flow.request.copy()))
            flow.metadata[EMULATION] = {"delete": response_id}
            return
        if not answer_here:
            return
        try:
            turn = await self.history.turn(tenant, response_id, self.state.get_strict)
        except StorageError:
            return  # the record is out of reach: ask the upstream
        if turn is None:
            flow.response = _not_found(response_id)
        elif method == "DELETE":
            self.history.forget(tenant, response_id)
            flow.metadata[EMULATION] = {"deleted": response_id}
            await self.state.written(self.state.flush())
            flow.response = _json_response(200, {"id": response_id, "object": "response", "deleted": True})
        elif listing:
            flow.response = await self._input_items(tenant, turn, dict(parse_qsl(url.query)))
        else:
            output = await self.history.output_items(tenant, turn, self.state.get_strict)
            flow.response = http.Response.make(200, response_json(turn, output), {"Content-Type": "application/json"})
        flow.comment = f"emulated: {method} {response_id} answered from the record"

    async def _input_items(self, tenant: Tenant, turn: Turn, query: dict[str, str]) -> http.Response:
        """The API's list: every item the response was generated from (its
        chain's too), newest first unless asked otherwise, a page at a time."""
        items: list[bytes] = []
        if turn.body.previous_response_id is not None:
            items = await self.history.context(tenant, turn.body.previous_response_id, self.state.get_strict)
        items += await self.history.input_items(tenant, turn, self.state.get_strict)
        listed = listed_items(items, turn.body.response_id)
        limit_text, order = query.get("limit", "20"), query.get("order", "desc")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100 or order not in ("asc", "desc"):
            return _json_response(400, {"error": {"message": "Invalid 'limit' or 'order'.",
                                                  "type": "invalid_request_error", "param": None, "code": None}})
        if order == "desc":
            listed.reverse()
        ids = [item["id"] for item in listed]
        start, end = 0, len(listed)
        for cursor in ("after", "before"):
            if cursor in query and query[cursor] not in ids:
                return _json_response(404, {"error": {"message": f"Item with id '{query[cursor]}' not found.",
                                                      "type": "invalid_request_error", "param": cursor,
                                                      "code": None}})
        if "after" in query:
            start = ids.index(query["after"]) + 1
        if "before" in query:
            end = ids.index(query["before"])
        window = listed[start:end]
        limit = int(limit_text)
        page = window[-limit:] if "before" in query and "after" not in query else window[:limit]
        return _json_response(200, {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                    "last_id": page[-1]["id"] if page else None,
                                    "has_more": len(window) > len(page)})

    # -- answers -------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        record = self._record_of(flow)
        if record is None or flow.response is None:
            return
        try:
            status = flow.response.status_code
            if self._retryable(flow, record) and 400 <= status < 500 and status not in TRANSIENT_STATUSES:
                hold(flow)  # the response hook may replace it
                return
            if status >= 300 or record.recorded or flow.metadata.get(HELD) \
                    or "delete" in flow.metadata.get(EMULATION, {}):
                return
            reader = record.reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                                  flow.response.headers.get("content-encoding", ""),
                                                  _length(flow.response))
            downstream = flow.response.stream

            def tap(chunk: bytes) -> bytes:
                if not record.recorded:
                    reader.feed(chunk)  # never raises
                    if reader.complete:
                        self._record(flow, record)  # before these last bytes reach the client
                return downstream(chunk) if callable(downstream) else chunk

            flow.response.stream = tap
        except Exception:
            internal_error(self.counters, "tapping an answer to record")

    async def response(self, flow: http.HTTPFlow) -> None:
        record = self._record_of(flow)
        if record is None or flow.response is None:
            return
        retried_here = False
        try:
            if self._retryable(flow, record) and _refused(flow, record):
                retried_here = True
                await self._retry_expanded(flow, record)
            elif "delete" in flow.metadata.get(EMULATION, {}) and flow.response.status_code < 300:
                self.history.forget(record.tenant, flow.metadata[EMULATION]["delete"])
                record.written = self.state.flush()
            elif not record.recorded and flow.response.status_code < 300 and flow.response.raw_content is not None:
                record.reader = None  # buffered: read it whole
                self._record(flow, record)
        except Exception:
            internal_error(self.counters, "emulating the store")
        retry_of = flow.metadata.get(RETRY_OF)
        if retry_of is not None:
            self._flows.pop(retry_of, None)  # the client's flow is answered by this retry
        elif retried_here or not flow.metadata.get(HELD):
            self._flows.pop(flow.id, None)  # else another addon retries it next, and its retry records
        if end_still_to_come(flow.response):
            await self.state.written(record.written)

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(RETRY_OF) is None:
            self._flows.pop(flow.id, None)

    def _retryable(self, flow: http.HTTPFlow, record: _Flow) -> bool:
        """A client's own previous_response_id sent as it is (auto mode)."""
        return (flow.metadata.get(RETRY_OF) is None and record.expanded is None
                and record.previous_response_id is not None and "delete" not in flow.metadata.get(EMULATION, {}))

    async def _retry_expanded(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """The upstream refused the client's previous_response_id (it forgot
        it, never stored it, or refuses the field): send the chain expanded."""
        assert record.previous_response_id is not None and flow.response is not None
        reading = self.reader.read(request_of(flow, record.client), count=False)
        if isinstance(reading, Skip):
            return
        try:
            record.expanded = await self._expand(reading, record)
        except (ChainError, StorageError):
            return  # not in the record: the refusal is the client's own answer
        refused = flow.response.status_code
        if self.upstreams.mark("refuses_previous", record.scope):
            logger.info("stateful-responses: %s refused a previous_response_id the record holds (%d); "
                        "expanding chains for it from now on", reading.label, refused)
        record.written = self.state.flush()
        retry = record.client.copy()
        retry.content = record.expanded
        answer, failure = await self.replays.send(flow, retry, f"chain expanded after {refused}")
        flow.response = answer
        flow.marked = ":warning:"
        flow.metadata[EMULATION] = {"previous_response_id": record.previous_response_id, "expanded": True,
                                    "retried_after": refused}
        flow.metadata.setdefault(CLIENT_BODY, record.client.raw_content)
        flow.comment = (f"emulated: upstream answered {refused} to {record.previous_response_id}; "
                        + ("retried with the chain expanded" if failure is None else
                           f"the retry failed ({failure}): answered 502"))

    def _record(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """Record a completed answer as a turn (and note an upstream that
        ignored the client's previous_response_id)."""
        assert flow.response is not None
        reader = record.reader
        if reader is None:
            reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                  flow.response.headers.get("content-encoding", ""))
            reader.feed(flow.response.raw_content or b"")
        record.recorded = True
        response = reader.finish()
        if not isinstance(response, dict) or response.get("status") != "completed":
            return
        if not isinstance(response.get("id"), str) or not response["id"]:
            return
        sent_previous = record.previous_response_id if record.expanded is None else None
        echoed = response.get("previous_response_id")
        stored = response.get("store")
        # An answer to a continuation that names another parent, or says it
        # stores nothing (then it cannot have continued one either), was made
        # without the chain: from now on the chain goes expanded.
        if sent_previous is not None and (echoed != sent_previous or stored is False) \
                and self.upstreams.mark("refuses_previous", record.scope):
            logger.info("stateful-responses: an upstream answered a previous_response_id without its chain; "
                        "expanding chains for it from now on")
        stored_upstream = stored is True or (stored is None and sent_previous is not None and echoed == sent_previous)
        self.history.record(record.tenant, response=response, previous_response_id=record.previous_response_id,
                             raw_input=record.raw_input, stored_upstream=stored_upstream)
        record.written = self.state.flush()
        self._debug("recorded %s", response["id"])

    def _record_of(self, flow: http.HTTPFlow) -> _Flow | None:
        """A flow's record, or for our own retry, the client's flow's."""
        retry_of = flow.metadata.get(RETRY_OF)
        return self._flows.get(retry_of if retry_of is not None else flow.id)

    def _remember(self, flow_id: str, record: _Flow) -> None:
        self._flows[flow_id] = record
        while len(self._flows) > MAX_FLOWS:
            self._flows.popitem(last=False)

    def _debug(self, msg: str, *args) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _length(response: http.Response) -> int | None:
    length = response.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def _refused(flow: http.HTTPFlow, record: _Flow) -> bool:
    assert flow.response is not None and record.previous_response_id is not None
    status = flow.response.status_code
    return (400 <= status < 500 and status not in TRANSIENT_STATUSES
            and _names_the_refusal(flow.response.raw_content or b"", record.previous_response_id))
