"""Store emulation's mitmproxy glue: clients that send ``previous_response_id``
keep working where the upstream stores nothing, forgets, or silently ignores
the field.

``stateful_emulate``:

* ``off``: nothing recorded, nothing changed.
* ``auto``: every completed answer of a matched flow is recorded. A client's
  ``previous_response_id`` goes upstream as it is while that upstream +
  credential has proved it reads stored responses back and the turn was
  stored there; otherwise the proxy expands the chain into full history. A
  refusal that names the id is retried invisibly with the chain expanded,
  streams included; a failure of the expansion, with the client's own body.
* ``always``: the proxy is the store for what it recorded: such a
  ``previous_response_id`` never reaches the upstream, ``item_reference``s to
  recorded items are expanded, and retrieve / input_items / delete of a
  recorded response are answered from the record. Ids it never recorded go
  upstream untouched.

In either mode a DELETE of a recorded response deletes the record's copy and
goes upstream too (the upstream may hold one); it is answered as done only
once the store took it, and in ``auto`` mode only where the upstream did not
refuse it (then its copy stays, and the client gets its answer).

A turn is recorded only if the client did not send ``store: false``, and its
answer reaches the client whole only once the record is written (bounded by
``RECORD_WAIT``). An expanded request then goes through forward mode like any
full-history one (an upstream that stores may still be sent only a delta).
Listed before ForwardMode, so that it plans the expanded body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
from mitmproxy import exceptions, http
from mitmproxy.proxy import mode_specs

from ..bounded import Bounded
from ..counters import Counters
from ..items import without_triggers
from ..flows import (
    ANSWERED,
    CLIENT_BODY,
    CONVERSATION,
    DECISION,
    EMULATION,
    HELD,
    RETRY_OF,
    ROUTED,
    WITHHELD,
    PerFlow,
    client_flow,
    end_still_to_come,
    hold,
    internal_error,
    keep_end_for_hooks,
    request_of,
)
from ..proofs import Proofs, same_as_unknown_route
from ..request_reader import Reader, Reading, Skip, splice, upstream_of
from ..replays import Replays
from ..settings import Config
from ..answer_reader import AnswerReader
from ..state.access import StateAccess
from ..state.storage import StorageError
from ..tenancy import Tenancy, credential_material
from ..upstreams import TRANSIENT_STATUSES, UNAVAILABLE_STATUSES, Upstreams, echo_verdict, item_kinds
from .conversations import (
    ApiError,
    Call,
    Conversation,
    Conversations,
    Echo,
    background_refused,
    echoed_conversations,
    listed,
    mutually_exclusive,
    named,
    named_in,
    not_found,
    refuse_duplicates,
    route,
    too_large,
)
from .history import History, Turn, listed_items, response_json, string_input_item, without_unreadable_reasoning
from .turns import Tenant, seal_key
from .walk import ChainError

logger = logging.getLogger(__name__)

NOT_FOUND_RETRY = 0.1  # a turn another proxy has just written may take this long to be visible
RECORD_WAIT = 1.0  # an answer's end waits this long at most for its turn to be written
ANSWER_WAIT = 10.0  # an answer the proxy makes itself waits this long at most to know its writes are durable
CHANGES = frozenset({"create", "update", "delete", "add_items", "delete_item"})  # the endpoints that change something
RENEWALS = 2  # chains renewed at once in the background
# An upstream that has not shown it honours previous_response_id and refused one by its id (forgotten, or
# never stored) gets chains expanded this long, not the time to live: the next turn would be refused alike.
FORGOTTEN_ID_PERIOD = 3600.0
RECOGNIZE_AGAIN = 600.0  # a host that showed it is no OpenAI-compatible API is asked again after this
RECOGNIZE_RETRY = 30.0  # one that did not answer the question, after this
LIST_PARAMETERS = frozenset({"limit", "order", "after", "before", "include", "include[]"})
_RESOURCE = re.compile(r"^(?P<base>.*)/responses/(?P<id>[^/]+)(?P<items>/input_items)?/?$")
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass
class _Flow:
    """What emulation keeps about a flow between its request and its answer."""

    tenant: Tenant
    credential: bytes
    scope: str
    label: str
    upstream: str  # the base URL
    previous_response_id: str | None  # the client's
    raw_input: list[bytes]  # the client's input items, byte for byte (references resolved)
    client: http.Request  # the client's request
    record_turn: bool = True  # False: the client sent store: false
    moved: bool = False  # routed away from the upstream that holds the chain
    expanded: bytes | None = None  # the body sent instead, chain expanded
    deleting: str | None = None  # a DELETE of this id, which the record holds or may hold, sent upstream too
    deletion_queued: bool = False  # the record's deletion went to the store (``written``)
    reader: AnswerReader | None = None
    recorded: bool = False
    written: asyncio.Future | None = field(default=None, repr=False)


def _json_response(status: int, payload: object) -> http.Response:
    return http.Response.make(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})


def _not_found(response_id: str) -> http.Response:
    return _json_response(404, {"error": {"message": f"Response with id '{response_id}' not found.",
                                          "type": "invalid_request_error", "param": None, "code": None}})


def _deleted(response_id: str) -> http.Response:
    return _json_response(200, {"id": response_id, "object": "response", "deleted": True})


def _not_deleted(response_id: str) -> http.Response:
    return _json_response(503, {"error": {"message": f"Response with id '{response_id}' could not be deleted: the "
                                          "proxy's store is unavailable. Try again.", "type": "server_error",
                                          "param": None, "code": None}})


def _names_the_refusal(body: bytes, response_id: str) -> bool:
    """A 4xx that is about the previous response: it names the field or the id
    (OpenAI's previous_response_not_found, vLLM's 404, "not supported")."""
    text = body.decode("utf-8", "replace").lower()
    return "previous_response" in text or "previous response" in text or response_id.lower() in text


def _forgot_the_id(body: bytes, response_id: str) -> bool:
    """A refusal about that one id, not the field: OpenAI's and smg's
    ``previous_response_not_found``, or an error naming the id (vLLM's
    "Response with id … not found."). The upstream restarted or expired it: a
    fact about the id, which says nothing about whether the upstream honours
    the field ("does not support 'previous_response_id'" does)."""
    return b"previous_response_not_found" in body or response_id.encode() in body


class StoreEmulation:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, upstreams: Upstreams,
                 state: StateAccess, history: History, replays: Replays, proofs: Proofs) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.upstreams = upstreams
        self.state = state
        self.history = history
        self.replays = replays
        self.proofs = proofs
        self._flows: PerFlow[_Flow] = PerFlow()
        self._own_answers: PerFlow[http.Response] = PerFlow()  # the proxy's answer to a withheld body
        self._renewals = asyncio.Semaphore(RENEWALS)
        self._keyless_said = False

    @property
    def mode(self) -> str:
        return self.config.settings.emulate

    def configure(self, updated: set[str]) -> None:
        if "stateful_seal_key_file" in updated:
            try:
                self.tenancy.seal_key = seal_key(self.config.settings.seal_key_file)
            except OSError as e:
                raise exceptions.OptionsError(f"stateful_seal_key_file: cannot read it ({e.strerror})") from None
            except ValueError as e:
                raise exceptions.OptionsError(f"stateful_seal_key_file: {e}") from None
        if updated & {"stateful_emulate", "stateful_seal_key_file"}:
            self._say_if_keyless()

    def _say_if_keyless(self) -> None:
        if self.mode != "off" and not self.tenancy.seal_key and not self._keyless_said:
            self._keyless_said = True
            logger.warning("stateful-responses: store emulation seals conversations with each request's credential "
                           "and the store's secret, which lives in the store: tenants without a credential, or with "
                           "a placeholder key everyone knows, are not protected at rest. Set "
                           "stateful_seal_key_file (or STATEFUL_RESPONSES_SEAL_KEY) to protect them.")

    # -- requests ------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        await self._request(flow)
        if _withheld(flow) and flow.response is not None:
            # mitmproxy streamed this body: the upstream's answer to what it was sent will take this one's place
            self._own_answers.put(flow, flow.response)

    async def _request(self, flow: http.HTTPFlow) -> None:
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
        previous = reading.previous if isinstance(reading.previous, str) else None
        record = _Flow(Tenant.under(self.tenancy, reading.credential), reading.credential, reading.scope,
                       reading.label, reading.upstream, previous, raw_input, client,
                       record_turn=reading.client_store is not False,
                       moved=bool((flow.metadata.get(ROUTED) or {}).get("moved")))
        self._flows.put(flow, record)
        if previous is None:
            if self.mode == "always":  # references to what the proxy recorded: the upstream has none of it
                await self._resolve_references(flow, reading, record)
            if record.record_turn:
                await self.history.forget_gone_bases(record.tenant, record.raw_input, self.state.get)
            return
        stored_upstream = self.mode == "auto" and not await self._upstream_cannot_have(record)
        if stored_upstream and not await self._chain_in_doubt(record):
            flow.metadata[EMULATION] = {"previous_response_id": previous, "expanded": False}
            return  # sent as it is; a refusal naming it is retried expanded
        try:
            record.expanded, dropped = await self._expand(reading, record)
        except StorageError:
            return  # the record is out of reach: the request goes as the client sent it
        except ChainError as e:
            unknown_here = e.code == "previous_response_not_found" and e.previous_response_id is None
            if self.mode == "always" and not (unknown_here and not await self._deleted_here(record)
                                              and await self._upstream_holds(flow, record)):
                flow.response = _json_response(400, e.body)
                flow.comment = f"emulated: {e.code} for {previous}"
                flow.metadata[EMULATION] = {"previous_response_id": previous, "error": e.code}
            return  # an id the record does not know, for an upstream that may: it goes as it is
        flow.metadata[CLIENT_BODY] = client.raw_content
        flow.metadata[EMULATION] = {"previous_response_id": previous, "expanded": True, "reasoning_dropped": dropped}
        if stored_upstream and not dropped:
            # The upstream holds the client's chain: forward mode may continue the expansion from the client's own
            # id (only the client's input goes), held and compared with the turn sent whole.
            flow.metadata[EMULATION]["stored_chain"] = [previous, len(record.raw_input)]
        flow.comment = f"emulated: {previous} expanded"
        flow.request.content = record.expanded
        self._debug("expanded %s", previous)

    async def _upstream_holds(self, flow: http.HTTPFlow, record: _Flow) -> bool:
        """In always mode, an id the record does not know: whether the
        upstream can continue from it. Where the upstream + credential has not
        proved it reads stored responses back yet, one ``GET`` of that very id
        settles it (and proves it)."""
        if self.upstreams.continuable(record.scope):
            return True
        if self.upstreams.cannot_continue(record.scope) or record.moved:
            return False
        assert record.previous_response_id is not None
        return await self.proofs.holds(flow, record.scope, record.upstream, record.previous_response_id) \
            and self.upstreams.continuable(record.scope)

    async def _upstream_cannot_have(self, record: _Flow) -> bool:
        """In auto mode: whether the upstream cannot continue from the client's
        id (so sending it would fail or, worse, be ignored): it has not proved
        it reads stored responses back, or it showed it does not store or
        refuses the field, or the turn is not stored there."""
        await self.proofs.settled(record.scope)
        if not self.upstreams.continuable(record.scope) or record.moved:
            return True
        assert record.previous_response_id is not None
        try:
            turn = await self.history.turn(record.tenant, record.previous_response_id, self.state.get_strict)
        except StorageError:
            return False
        return turn is not None and not turn.header.stored_upstream

    async def _chain_in_doubt(self, record: _Flow) -> bool:
        """In auto mode: whether the upstream's stored chain may not feed the
        model what this turn holds: an item kind it was found to drop, or one
        it has not yet shown it keeps (``Upstreams.unverified``). Such a turn
        is expanded: forward mode then sends it whole, or continues it held and
        compared with the turn sent whole. A chain the record cannot read
        yet (written a moment ago) is in doubt too: the expansion waits for it
        once, and sends the turn as it is if it still cannot."""
        assert record.previous_response_id is not None
        try:
            context = await self.history.context(record.tenant, record.previous_response_id, self.state.get_strict)
        except (StorageError, ChainError):
            return True
        kinds = item_kinds(context + record.raw_input)
        return any(self.upstreams.drops(record.scope, kind) for kind in kinds) \
            or bool(self.upstreams.unverified(record.scope, kinds))

    async def _expand(self, reading: Reading, record: _Flow) -> tuple[bytes, int]:
        """The client's body with the chain its previous_response_id names in
        front of its input, that field dropped, every other byte its own; how
        many reasoning items were dropped (see ``history.without_unreadable_reasoning``)."""
        assert record.previous_response_id is not None
        get = self.state.get_strict
        try:
            context = await self.history.context(record.tenant, record.previous_response_id, get)
        except ChainError as e:
            if e.code != "previous_response_not_found":
                raise
            await asyncio.sleep(NOT_FOUND_RETRY)  # written by another proxy a moment ago?
            if await self.state.learn_secrets():  # under a secret new to this replica?
                record.tenant = Tenant.under(self.tenancy, record.credential)
            context = await self.history.context(record.tenant, record.previous_response_id, get)
        items = await self._referenced(record.tenant, context + record.raw_input)
        dropped = 0
        if not (self.upstreams.has("reads_back", record.scope) and reading.client_store is not False):
            items, dropped = without_unreadable_reasoning(items)
        body = splice(record.client.raw_content or b"", reading.fields,
                      {"input": b"[" + b",".join(items) + b"]", "previous_response_id": None})
        return body, dropped

    async def _referenced(self, tenant: Tenant, items: list[bytes]) -> list[bytes]:
        return await self.history.resolve_references(tenant, items, self.state.get_strict)

    async def _resolve_references(self, flow: http.HTTPFlow, reading: Reading, record: _Flow) -> None:
        try:
            resolved = await self._referenced(record.tenant, record.raw_input)
        except (StorageError, ChainError):
            return
        if resolved == record.raw_input:
            return
        flow.metadata.setdefault(CLIENT_BODY, record.client.raw_content)  # a conversation expanded may have set it
        flow.metadata[EMULATION] = {"references_expanded": True}
        flow.request.content = splice(record.client.raw_content or b"", reading.fields,
                                      {"input": b"[" + b",".join(resolved) + b"]"})
        record.raw_input = resolved

    async def full_history(self, flow: http.HTTPFlow, client: http.Request) -> bytes | None:
        """The client's request as full history (its chain expanded), for a
        turn that must move to another upstream; None when it already is full
        history, or when the record cannot expand it."""
        record = self._flows.get(flow)
        if record is not None and record.expanded is not None:
            return record.expanded
        if self.mode == "off":
            return None
        chained = self._chained(flow, client)
        if chained is None:
            return None
        reading, fresh = chained
        record = record or fresh
        try:
            return (await self._expand(reading, record))[0]
        except (ChainError, StorageError):
            return None

    async def compact_history(self, flow: http.HTTPFlow) -> bytes | None:
        """A ``POST …/responses/compact`` body with its ``previous_response_id``
        expanded, as any request of that chain would be (the upstream cannot
        have the chain, or the proxy is the store); None to send it as it is.
        What it answers is a new window, never a turn of the chain: nothing is
        recorded."""
        if self.mode == "off":
            return None
        await self.state.ready()
        client = flow.request.copy()
        path, _, query = client.path.partition("?")
        client.path = path.rstrip("/").removesuffix("/compact") + (f"?{query}" if query else "")
        try:
            fields = _FIELDS.decode(client.get_content(strict=False) or b"")
            if bytes(fields.get("input", b"null")) == b"null":  # compact takes a chain alone: read it as no input
                client.content = splice(client.raw_content or b"", fields, {"input": b"[]"})
        except (msgspec.DecodeError, ValueError):
            return None
        chained = self._chained(flow, client)
        if chained is None:
            return None
        reading, record = chained
        try:
            if self.mode == "auto" and not await self._upstream_cannot_have(record):
                return None
            return (await self._expand(reading, record))[0]
        except (ChainError, StorageError):
            return None  # a chain the record does not hold is the upstream's

    def _chained(self, flow: http.HTTPFlow, client: http.Request) -> tuple[Reading, _Flow] | None:
        """``client``'s reading and a fresh record of it, where it names a ``previous_response_id``."""
        reading = self.reader.read(request_of(flow, client), count=False)
        if isinstance(reading, Skip) or not isinstance(reading.previous, str):
            return None
        raw_input = reading.raw_items if reading.raw_items is not None \
            else [string_input_item(bytes(reading.fields["input"]))]
        return reading, _Flow(Tenant.under(self.tenancy, reading.credential), reading.credential, reading.scope,
                              reading.label, reading.upstream, reading.previous, raw_input, client)

    # -- retrieve, input_items, delete --------------------------------------------------

    async def _resource(self, flow: http.HTTPFlow, method: str) -> None:
        url = urlsplit(flow.request.url)
        match = _RESOURCE.match(url.path)
        if match is None or not self.config.settings.url_matches(flow.request.url):
            return
        response_id, listing = match["id"], bool(match["items"])
        if method == "DELETE" and listing:
            return
        # The query string is credential material (gateways take keys there),
        # except the list's own parameters.
        query = [(k, v) for k, v in parse_qsl(url.query, keep_blank_values=True) if k not in LIST_PARAMETERS]
        reading = dataclasses.replace(request_of(flow), url=urlunsplit(url._replace(query=urlencode(query))))
        credential = credential_material(reading)
        tenant = Tenant.under(self.tenancy, credential)
        upstream = f"{url.scheme}://{url.netloc}{match['base']}"
        scope, label = self.tenancy.scope(upstream, credential)
        record = _Flow(tenant, credential, scope, label, upstream, response_id, [], flow.request.copy())
        if method == "DELETE":
            await self._delete(flow, record)
            return
        if self.mode != "always" and not self.upstreams.cannot_continue(scope):
            return
        try:
            turn = await self._target(record)
            if turn is None and not (self.mode == "always" and await self._deleted_here(record)):
                return  # never recorded here: the upstream's to answer
            if turn is None or turn.header.status != "completed":
                answer = _not_found(response_id)  # deleted through the proxy
            elif listing:
                answer = await self._input_items(record.tenant, turn, dict(parse_qsl(url.query)))
            else:
                output = await self.history.output_items(record.tenant, turn, self.state.get_strict)
                answer = http.Response.make(200, response_json(turn, output), {"Content-Type": "application/json"})
        except StorageError:
            return  # the record is out of reach: ask the upstream
        flow.response = answer
        flow.comment = f"emulated: {method} {response_id} answered from the record"

    async def _target(self, record: _Flow) -> Turn | None:
        """The recorded turn a GET or DELETE names, as the store has it (None:
        never recorded, or gone); StorageError when the store cannot say."""
        assert record.previous_response_id is not None
        turn = await self.history.turn(record.tenant, record.previous_response_id, self.state.get_strict, fresh=True)
        if turn is None and await self.state.learn_secrets():  # written under a secret new to this replica?
            record.tenant = Tenant.under(self.tenancy, record.credential)
            turn = await self.history.turn(record.tenant, record.previous_response_id, self.state.get_strict,
                                           fresh=True)
        return turn

    async def _deleted_here(self, record: _Flow) -> bool:
        """Whether the client deleted the id through the proxy (False when
        the store cannot say)."""
        assert record.previous_response_id is not None
        try:
            return await self.history.deleted_lately(record.tenant, record.previous_response_id, self.state.get_strict)
        except StorageError:
            return False

    async def _delete(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """Delete a response wherever it may live, in either mode: the record's
        copy, and the upstream's (every recorded turn went there with store on,
        so the DELETE goes on whatever its answer said). Where the store took
        the deletion, the client's answer is the record's ("deleted"), else
        see ``_answer_delete``. A DELETE of a response deleted through the
        proxy lately (``History.deleted_lately``: an SDK retrying the proxy's
        503 once the store took the deletion after all) is answered as done
        too. An id never recorded is the upstream's alone."""
        response_id = record.previous_response_id
        assert response_id is not None
        try:
            turn = await self._target(record)
            if turn is not None and turn.header.status == "completed":
                await self.history.delete(record.tenant, response_id, self.state.get_strict)
            elif not await self.history.deleted_lately(record.tenant, response_id, self.state.get_strict):
                if turn is not None:
                    flow.response = _not_found(response_id)  # deleted through the proxy long ago
                    flow.comment = f"emulated: DELETE {response_id} answered from the record"
                return
            record.written, record.deletion_queued = self.state.flush(), True
        except StorageError:
            pass  # the store cannot say whether it holds the response: it may
        record.deleting = response_id
        self._flows.put(flow, record)
        flow.comment = f"emulated: DELETE {response_id} sent upstream too"

    async def _answer_delete(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """The client's answer to a DELETE the record holds, or may hold: the
        record's own once its deletion is durable (ANSWER_WAIT at most), where
        the upstream deleted it too or never had it (404), and in ``always``
        mode, where the proxy serves the only copy it answers for (it never
        serves that id again). In ``auto`` mode an upstream that refused
        (agentic-api's 405) still serves its copy: the client gets its answer.
        A deletion the store did not take is never answered as done: an
        upstream's "deleted" or "not found" becomes the proxy's 503 (SDKs
        retry it); any other answer is the upstream's own."""
        assert flow.response is not None and record.deleting is not None
        response_id, status = record.deleting, flow.response.status_code
        if self.mode != "always" and status >= 300 and status != 404:
            flow.metadata[EMULATION] = {"deleting": response_id, "upstream_refused": status}
            flow.comment = f"emulated: DELETE {response_id}: the upstream refused it ({status}), as the client learns"
        elif record.deletion_queued and await self.state.written(record.written, ANSWER_WAIT, through_outage=True):
            flow.response = _deleted(response_id)
            flow.metadata[EMULATION] = {"deleted": response_id}
            flow.comment = f"emulated: DELETE {response_id} deleted from the record (the upstream answered {status})"
        elif status < 300 or status == 404:
            flow.response = _not_deleted(response_id)
            flow.metadata[EMULATION] = {"not_deleted": response_id}
            flow.comment = f"emulated: DELETE {response_id} not taken by the store (the upstream answered {status})"

    async def _input_items(self, tenant: Tenant, turn: Turn, query: dict[str, str]) -> http.Response:
        """The API's list: every item the response was generated from (its
        chain's too), newest first unless asked otherwise, a page at a time."""
        get = self.state.get_strict
        try:
            items: list[bytes] = []
            if turn.body.previous_response_id is not None:  # its chain, even where a response of it was deleted
                items = await self.history.context(tenant, turn.body.previous_response_id, get, as_target=False)
            items += await self.history.input_items(tenant, turn, get)
        except ChainError as e:
            return _json_response(404, {"error": {"message": str(e), "type": "invalid_request_error",
                                                  "param": None, "code": None}})
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
        if _withheld(flow) and flow.response is not None:
            hold(flow)  # the answer to an empty body: the response hook replaces it
            return
        record = self._flows.get(client_flow(flow))
        if record is None or flow.response is None:
            return
        try:
            status = flow.response.status_code
            if record.deleting is not None or self._falls_back(flow, record) or \
                    self._retryable(flow, record) and 400 <= status < 500 and status not in TRANSIENT_STATUSES:
                hold(flow)  # the response hook may replace it
                return
            if status >= 300 or record.recorded or not record.record_turn or flow.metadata.get(HELD):
                return
            reader = record.reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                                  flow.response.headers.get("content-encoding", ""),
                                                  _length(flow.response))
            keep_end_for_hooks(flow)  # the client holds the whole answer only once its turn is written
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
        if _withheld(flow):
            await self._send_withheld(flow)
            self._flows.pop(flow)
            return
        client = client_flow(flow)
        record = self._flows.get(client)
        if record is None or flow.response is None:
            return
        retried_here = False
        try:
            if self._retryable(flow, record) and _refused(flow, record):
                retried_here = True
                await self._retry_expanded(flow, record)
            elif self._falls_back(flow, record):
                retried_here = True
                await self._retry_as_sent(flow, record)
            elif record.deleting is not None:
                await self._answer_delete(flow, record)
            elif not record.recorded and flow.response.status_code < 300 and record.record_turn:
                if flow.response.raw_content is not None:
                    record.reader = None  # buffered: read it whole
                self._record(flow, record)
        except StorageError:
            pass  # the record is out of reach: what the upstream did stands
        except Exception:
            internal_error(self.counters, "emulating the store")
        if client is not flow or retried_here or not flow.metadata.get(HELD) or record.deleting is not None:
            self._flows.pop(client)  # else another addon retries it next, and its retry records
        if end_still_to_come(flow):
            await self.state.written(record.written, RECORD_WAIT)

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(RETRY_OF) is None:
            self._flows.pop(flow)

    async def _send_withheld(self, flow: http.HTTPFlow) -> None:
        """A body mitmproxy streamed, held back from the upstream until the
        request hooks had read the store (``WITHHELD``): the request goes now,
        as they left it (a conversation or chain expanded, planned by forward
        mode), and its answer, whole, is the client's; the answer the proxy
        made itself, where it made one. The retry's hooks record and join it."""
        own = self._own_answers.pop(flow)
        if own is not None:
            flow.response = own
            return
        try:
            request = flow.request.copy()
            request.headers.pop("transfer-encoding", None)  # streamed chunked; sent whole now
            request.headers["content-length"] = str(len(request.raw_content or b""))
            flow.response, _ = await self.replays.send(flow, request, "a streamed body sent once expanded")
        except Exception:
            internal_error(self.counters, "sending a withheld body")

    def _retryable(self, flow: http.HTTPFlow, record: _Flow) -> bool:
        """A client's own previous_response_id sent as it is (auto mode)."""
        return (flow.metadata.get(RETRY_OF) is None and record.expanded is None
                and record.previous_response_id is not None and flow.request.method.upper() == "POST")

    def _falls_back(self, flow: http.HTTPFlow, record: _Flow) -> bool:
        """A failure answer (a 500 too; not a "not now" or "unavailable") to a chain the
        proxy expanded, which forward mode did not change further (it retries
        its own changes, and the client's body last): the client's own body
        goes again, so that no error the expansion caused reaches it (forward
        mode's rule for a request it changed, on every transport). Not to an
        upstream + credential known to refuse or ignore the field (it would
        answer without the history); one not yet proven either way (its proof
        still running) gets the client's own body, as it would without the
        proxy, and the answer's echo is judged."""
        assert flow.response is not None
        status = flow.response.status_code
        decision = flow.metadata.get(DECISION) or {}
        forward_changed = decision.get("action") == "continue" or decision.get("forced_store") is True
        return (flow.metadata.get(RETRY_OF) is None and record.expanded is not None and not forward_changed
                and status >= 400 and status not in TRANSIENT_STATUSES | UNAVAILABLE_STATUSES
                and not self.upstreams.cannot_continue(record.scope))

    async def _retry_as_sent(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """The expanded chain failed: send the client's own body, whose
        answer (recorded as any) is the client's."""
        assert flow.response is not None
        failed = flow.response.status_code
        record.expanded = None  # the retry carries the client's previous_response_id: its echo is judged
        answer, failure = await self.replays.send(flow, record.client, f"the client's own body after {failed}")
        flow.response = answer
        flow.marked = ":warning:"
        flow.metadata[EMULATION] = {"previous_response_id": record.previous_response_id, "expanded": False,
                                    "retried_after": failed}
        flow.comment = (f"emulated: upstream answered {failed} to {record.previous_response_id} expanded; "
                        + ("retried with the client's own body" if failure is None else
                           f"the retry failed ({failure}): answered 502"))

    async def _retry_expanded(self, flow: http.HTTPFlow, record: _Flow) -> None:
        """The upstream refused the client's previous_response_id (it forgot
        it, never stored it, or refuses the field): send the chain expanded."""
        assert record.previous_response_id is not None and flow.response is not None
        reading = self.reader.read(request_of(flow, record.client), count=False)
        if isinstance(reading, Skip):
            return
        try:
            record.expanded, dropped = await self._expand(reading, record)
        except (ChainError, StorageError):
            return  # not in the record: the refusal is the client's own answer
        refused = flow.response.status_code
        forgot = _forgot_the_id(flow.response.get_content(strict=False) or b"", record.previous_response_id)
        if forgot and self.upstreams.has("honours_previous", record.scope):
            self._debug("%s forgot %s (%d): expanded once", reading.label, record.previous_response_id, refused)
        elif self.upstreams.mark("refuses_previous", record.scope, FORGOTTEN_ID_PERIOD if forgot else None):
            logger.info("stateful-responses: %s refused a previous_response_id the record holds (%d); "
                        "expanding chains for it from now on%s", reading.label, refused,
                        " (for an hour: it may have forgotten that one id)" if forgot else "")
        record.written = self.state.flush()
        retry = record.client.copy()
        retry.content = record.expanded
        answer, failure = await self.replays.send(flow, retry, f"chain expanded after {refused}")
        flow.response = answer
        flow.marked = ":warning:"
        flow.metadata[EMULATION] = {"previous_response_id": record.previous_response_id, "expanded": True,
                                    "retried_after": refused, "reasoning_dropped": dropped}
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
        if (conversation := client_flow(flow).metadata.get(CONVERSATION)) is not None:
            response = {**response, "conversation": {"id": conversation["id"]}}  # as the API keeps it
        # An answer the proxy made itself (ANSWERED) says nothing of what the upstream does with the field.
        sent_previous = record.previous_response_id if record.expanded is None and not flow.metadata.get(ANSWERED) \
            else None
        stored = response.get("store")
        verdict = None
        if sent_previous is not None:
            verdict = echo_verdict(sent_previous, response.get("previous_response_id"), response,
                                   record.client.raw_content or b"", len(record.raw_input),
                                   self.upstreams.has("honours_previous", record.scope))
            # An answer to a continuation made without its chain (or that says it
            # stores nothing: then it cannot have continued one either): from now
            # on the chain goes expanded.
            if (verdict == "ignored" or stored is False) and self.upstreams.mark("refuses_previous", record.scope):
                logger.info("stateful-responses: an upstream answered a previous_response_id without its chain; "
                            "expanding chains for it from now on")
            elif verdict == "honoured":
                self.upstreams.mark("honours_previous", record.scope)
            elif verdict == "undecided":
                self.proofs.start_echo(flow, record.scope, record.label, record.upstream, response["id"],
                                       len(record.raw_input))
        # An answer that does not say (agentic-api's) was stored where its request asked for it (or did not say:
        # the API's default), or where it continued a chain, over HTTP or a socket alike: the GET of the proof
        # below shows whether the upstream really keeps it.
        stored_upstream = stored is True or (stored is None and (verdict == "honoured" or _asks_to_store(flow)))
        # A compaction trigger is a control signal, never content: a later expansion never replays it.
        due = self.history.record(record.tenant, response=response, previous_response_id=record.previous_response_id,
                                  raw_input=without_triggers(record.raw_input), stored_upstream=stored_upstream)
        record.written = self.state.flush()
        if stored_upstream:
            self.proofs.start(flow, record.scope, record.label, record.upstream, response["id"])
        for dependency in due:
            asyncio.get_running_loop().create_task(self._renew(record.tenant, dependency))
        self._debug("recorded %s", response["id"])

    async def _renew(self, tenant: Tenant, response_id: str) -> None:
        """Keep what a new turn relies on as long as it lives (in the
        background: the client never waits for it)."""
        async with self._renewals:
            try:
                await self.history.renew(tenant, response_id, self.state.get_strict)
                self.state.flush()
            except (ChainError, StorageError):
                pass  # tried again when the next turn finds it due
            except Exception:
                internal_error(self.counters, "renewing a recorded chain")

    def _debug(self, msg: str, *args) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _withheld(flow: http.HTTPFlow) -> bool:
    """A client's flow whose streamed body was held back from the upstream
    (``WITHHELD``): store emulation sends its request in its place."""
    return bool(flow.metadata.get(WITHHELD)) and flow.metadata.get(RETRY_OF) is None


def _length(response: http.Response) -> int | None:
    length = response.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


class _Store(msgspec.Struct):
    store: object = None


_STORE = msgspec.json.Decoder(_Store)


def _asks_to_store(flow: http.HTTPFlow) -> bool:
    """Whether the body the upstream was sent asks to store: says ``store:
    true``, or nothing (the API's default; a bridged turn's socket message is
    the client's body, which a full-history client sends without it)."""
    try:
        store = _STORE.decode(flow.request.get_content(strict=False) or b"").store
    except (msgspec.DecodeError, ValueError):
        return False
    return store is True or store is None


def _refused(flow: http.HTTPFlow, record: _Flow) -> bool:
    assert flow.response is not None and record.previous_response_id is not None
    status = flow.response.status_code
    return (400 <= status < 500 and status not in TRANSIENT_STATUSES
            and _names_the_refusal(flow.response.raw_content or b"", record.previous_response_id))



# -- conversations -------------------------------------------------------------------


@dataclass
class _InConversation:
    """What conversation emulation keeps about a flow between its hooks: a
    response in a conversation the proxy keeps (``conversation``), or a
    request passed upstream whose answer shows whether the upstream has the
    API (``judged``)."""

    tenant: Tenant
    credential: bytes
    scope: str
    label: str
    conversation_id: str
    conversation: Conversation | None = None
    listed_input: list[bytes] = field(default_factory=list)  # the client's input, references resolved, as listed
    expanded: bytes | None = None  # the body sent instead
    judged: Call | None = None  # an endpoint's call, or a response's (endpoint "response")
    reader: AnswerReader | None = None
    joined: bool = False
    written: asyncio.Future | None = field(default=None, repr=False)


def _names_an_unknown_item(body: bytes) -> bool:
    """The API's 404 for an item id it does not hold: in the conversation
    (``No item found with id …``), or referenced (``Item with id … not found.``)."""
    return b"No item found with id '" in body or (b"Item with id '" in body and b"' not found." in body)


def _api_answer(status: int, body: bytes) -> http.Response:
    return http.Response.make(status, body, {"Content-Type": "application/json"})


def _not_saved() -> dict:
    return {"error": {"message": "The change could not be saved: the proxy's store is unavailable. Try again.",
                      "type": "server_error", "param": None, "code": None}}


def _api_error(error: ApiError) -> http.Response:
    return _json_response(error.status, error.body)


class ConversationEmulation:
    """OpenAI's Conversations API where the upstream lacks it: the
    ``/conversations…`` endpoints answered from the record, and a response's
    ``conversation`` expanded into the conversation's items + its input (which
    it joins once it completes, before its answer's end reaches the client).

    ``always``: the proxy is the API, and never sends ``conversation``
    upstream. ``auto``: a conversation the proxy keeps is the proxy's; any
    other request passes upstream until that upstream + credential shows it
    lacks the API (a 404/405 from an endpoint, a refusal naming
    ``conversation``, an answer whose echo names no conversation), and from
    then on every request is the proxy's; a failure answer that showed it is
    replaced by the proxy's own, invisibly, an answer that succeeded stands.
    Listed before StoreEmulation, which then records the expanded request as
    any full-history one (retrieve, input_items and ``previous_response_id``
    work on it), and ForwardMode, which may send it as a delta."""

    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, upstreams: Upstreams,
                 state: StateAccess, history: History, conversations: Conversations, proofs: Proofs,
                 emulation: StoreEmulation) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.upstreams = upstreams
        self.state = state
        self.history = history
        self.conversations = conversations
        self.proofs = proofs
        self.emulation = emulation
        self._flows: PerFlow[_InConversation] = PerFlow()
        self._responses_to: PerFlow[str] = PerFlow()  # a Responses API request's base URL, until it is answered
        self._recognized = Bounded(1024)  # host -> when it may be asked again whether it is an OpenAI-compatible API

    @property
    def mode(self) -> str:
        return self.config.settings.emulate

    def _proxy_is_the_api(self, scope: str) -> bool:
        return self.mode == "always" or self.upstreams.has("lacks_conversations", scope)

    # -- requests ------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if self.mode == "off" or not self.config.settings.enabled or flow.metadata.get(RETRY_OF) is not None \
                or flow.response is not None:
            return
        try:
            url = urlsplit(flow.request.url)
            routed = route(flow.request.method, url.path)
            if routed is not None and self.config.settings.url_matches(flow.request.url):
                base = f"{url.scheme}://{url.netloc}{routed[0]}"
                if not self._serves_responses(flow, base):
                    await self.state.ready()  # the store's secret names the host's scope
                    await self._recognize(flow, base)
                if self._serves_responses(flow, base):
                    await self.state.ready()
                    await self._endpoint(flow, *routed)
            elif flow.request.method.upper() == "POST" and url.path.rstrip("/").endswith("/responses"):
                self._responses_to.put(flow, upstream_of(flow.request.url) or "")
                await self.state.ready()
                await self._response(flow)
        except StorageError:
            pass  # the record is out of reach: the request goes as the client sent it
        except Exception:
            internal_error(self.counters, "emulating a conversation")

    def _serves_responses(self, flow: http.HTTPFlow, upstream: str) -> bool:
        """Whether ``upstream`` is a Responses API host, the only kind whose
        ``/conversations`` the proxy may answer: a configured one
        (``stateful_base_urls``, ``stateful_upstreams``, reverse mode's), one
        that answered a Responses request through the proxy, or one that lists
        models as an OpenAI-compatible API does (``_recognize``). In regular
        or transparent mode any other host's ``/conversations`` (a helpdesk's
        own API) is its own, never touched."""
        settings = self.config.settings
        if settings.base_urls or isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            return True  # the flow's URL matched a configured base URL, or reverse mode's upstream is the only one
        url = flow.request.url
        if any(url.startswith(configured.rstrip("/") + "/") for configured in settings.upstreams):
            return True
        return self.upstreams.has("serves_responses", self.tenancy.scope(upstream, b"")[0])

    async def _recognize(self, flow: http.HTTPFlow, base: str) -> None:
        """A host not yet known as a Responses API host, asked for its
        ``/conversations`` (openai-agents' session starts there, before any
        ``/responses``): it is one if ``GET {base}/models`` lists models as an
        OpenAI-compatible API does. Asked once per host; again after
        ``RECOGNIZE_AGAIN`` when it answered otherwise (a helpdesk's own API
        stays its own), after ``RECOGNIZE_RETRY`` when it did not answer."""
        host, label = self.tenancy.scope(base, b"")
        now = self.config.clock()
        if now < self._recognized.get(host, float("-inf")):
            return
        self._recognized.put(host, now + RECOGNIZE_AGAIN)
        compatible = await self.proofs.openai_compatible(flow, base)
        self._debug("%s lists models as an OpenAI-compatible API: %s", label, compatible)
        if compatible is None:
            self._recognized.put(host, now + RECOGNIZE_RETRY)
        elif compatible and self.upstreams.mark("serves_responses", host):
            self.state.flush()

    def _note_served(self, flow: http.HTTPFlow) -> None:
        """A host that answered a Responses request (a response, as JSON or
        a stream) is a Responses API host."""
        upstream = self._responses_to.get(client_flow(flow))
        assert flow.response is not None
        content_type = flow.response.headers.get("content-type", "").lower()
        if upstream and flow.response.status_code < 300 and ("json" in content_type or "event-stream" in content_type):
            if self.upstreams.mark("serves_responses", self.tenancy.scope(upstream, b"")[0]):
                self.state.flush()

    async def _endpoint(self, flow: http.HTTPFlow, base: str, call: Call) -> None:
        url = urlsplit(flow.request.url)
        pairs = parse_qsl(url.query, keep_blank_values=True)
        # The query string is credential material (gateways take keys there), except the list's own parameters.
        request = dataclasses.replace(request_of(flow), url=urlunsplit(url._replace(query=urlencode(
            [(k, v) for k, v in pairs if k not in LIST_PARAMETERS]))))
        credential = credential_material(request)
        scope, label = self.tenancy.scope(f"{url.scheme}://{url.netloc}{base}", credential)
        call = dataclasses.replace(call, body=flow.request.get_content(strict=False) or b"",
                                   query=tuple((k, v) for k, v in pairs if k in LIST_PARAMETERS))
        record = _InConversation(Tenant.under(self.tenancy, credential), credential, scope, label,
                                 call.conversation_id)
        proxy_is_the_api = self._proxy_is_the_api(scope)
        if call.endpoint != "create":
            record.conversation = await self._find(record, learn_secrets=proxy_is_the_api)
        if record.conversation is None and not proxy_is_the_api:
            self._judge_answer(flow, record, call)
            return
        await self._answer(flow, record, call)

    async def _answer(self, flow: http.HTTPFlow, record: _InConversation, call: Call) -> None:
        """Answer ``call`` as the API. A change is answered once it is durable,
        waiting through a short outage of the store (ANSWER_WAIT at most) as a
        DELETE of a response does, so that it is answered once and lands once;
        one the store did not take in that time is the proxy's 503 (SDKs retry
        it): the client must never hold an id or an answer the store does not,
        nor be sent to an upstream that lacks the API."""
        resolve = lambda ids: self.history.referenced(record.tenant, ids, self.state.get_strict)  # noqa: E731
        status, body = await self.conversations.answer(record.tenant, call, record.conversation, resolve,
                                                       self.state.get_strict)
        if status == 200 and call.endpoint == "delete" and record.conversation is not None:
            # Its items are erased: a reference to one resolves nowhere, though the responses made in it stay.
            self.history.forget_item_ids(record.tenant, (item.id for item in record.conversation.items))
        change = status == 200 and call.endpoint in CHANGES
        durable = await self.state.written(self.state.flush(), ANSWER_WAIT, through_outage=change)
        if change and not durable:
            self.conversations.clear()  # what memory holds of the change is not stored yet
            status, body = 503, json.dumps(_not_saved()).encode()
        flow.response = _api_answer(status, body)
        flow.metadata[CONVERSATION] = {"endpoint": call.endpoint, "status": status}
        flow.comment = f"emulated: conversations {call.endpoint} answered by the proxy ({status})"
        self._debug("answered conversations %s: %d", call.endpoint, status)

    async def _find(self, record: _InConversation, *, learn_secrets: bool) -> Conversation | None:
        """The conversation the request names, if the proxy keeps it for this
        tenant (StorageError when the store cannot say)."""
        conversation = await self.conversations.find(record.tenant, record.conversation_id, self.state.get_strict)
        if conversation is None and learn_secrets and await self.state.learn_secrets():
            record.tenant = Tenant.under(self.tenancy, record.credential)  # made under a secret new to this replica?
            conversation = await self.conversations.find(record.tenant, record.conversation_id,
                                                         self.state.get_strict)
        return conversation

    def _judge_answer(self, flow: http.HTTPFlow, record: _InConversation, call: Call) -> None:
        """Pass the request upstream; unless that upstream + credential has
        shown it has the API, its answer is held and judged (``_judge``)."""
        if not self.upstreams.has("has_conversations", record.scope):
            record.judged = call
            self._flows.put(flow, record)

    async def _response(self, flow: http.HTTPFlow) -> None:
        client = flow.request.copy()
        reading = self.reader.read(request_of(flow, client), count=False, conversations=True)
        if isinstance(reading, Skip) or reading.conversation is None:
            return
        record = _InConversation(Tenant.under(self.tenancy, reading.credential), reading.credential, reading.scope,
                                 reading.label, "")
        proxy_is_the_api = self._proxy_is_the_api(reading.scope)
        # A model outside stateful_models is left alone unless its conversation is one the proxy keeps.
        kept_only = not self.config.settings.model_matches(reading.model)
        if reading.previous is not None:
            if not kept_only:
                self._refuse(flow, mutually_exclusive())  # the API refuses it, whoever keeps the conversation
            return
        try:
            record.conversation_id = named(reading.conversation)
        except ApiError as e:
            if proxy_is_the_api and not kept_only:
                self._refuse(flow, e)
            return
        record.conversation = await self._find(record, learn_secrets=proxy_is_the_api)
        conversation = record.conversation
        if conversation is None:
            if kept_only:
                return
            if proxy_is_the_api:
                self._refuse(flow, not_found(record.conversation_id))
            else:
                self._judge_answer(flow, record, Call("response", record.conversation_id))
            return
        if reading.fields.get("background") is not None and bytes(reading.fields["background"]) == b"true":
            self._refuse(flow, background_refused())
            return
        if conversation.full:
            self._refuse(flow, too_large(conversation.id, "conversation"))
            return
        raw_input = reading.raw_items if reading.raw_items is not None \
            else [string_input_item(bytes(reading.fields["input"]))]
        resolved = await self.history.resolve_references(record.tenant, raw_input, self.state.get_strict)
        record.listed_input = listed(resolved)
        try:
            refuse_duplicates(conversation, record.listed_input)
            await self.conversations.admit(record.tenant, self.state.get_strict, param="conversation")
        except ApiError as e:
            self._refuse(flow, e)
            return
        record.expanded, dropped = await self._expansion(reading, client, record)
        await self.conversations.renew(conversation)
        self.state.flush()
        flow.request.content = record.expanded
        if reading.fields.get("stream") is not None and bytes(reading.fields["stream"]) == b"true":
            flow.request.headers["accept-encoding"] = "identity"  # a compressed stream's events could not name it
        flow.metadata[CLIENT_BODY] = client.raw_content
        flow.metadata[CONVERSATION] = {"id": conversation.id, "items": len(conversation.items),
                                       "reasoning_dropped": dropped}
        flow.comment = f"emulated: conversation {conversation.id} expanded ({len(conversation.items)} items)"
        self._flows.put(flow, record)
        self._debug("expanded conversation %s: %d items", conversation.id, len(conversation.items))

    async def _expansion(self, reading: Reading, client: http.Request, record: _InConversation) -> tuple[bytes, int]:
        """The client's body with the conversation's items in front of its
        input and without ``conversation``, every other byte its own; how many
        reasoning items an upstream that persists nothing could not read were
        left out (see ``history.without_unreadable_reasoning``)."""
        assert record.conversation is not None
        await self.proofs.settled(record.scope)
        items = [item.raw for item in record.conversation.items]
        dropped = 0
        if not (self.upstreams.has("reads_back", record.scope) and reading.client_store is not False):
            items, dropped = without_unreadable_reasoning(items)
        body = splice(client.raw_content or b"", reading.fields,
                      {"input": b"[" + b",".join(items + record.listed_input) + b"]", "conversation": None})
        return body, dropped

    def _refuse(self, flow: http.HTTPFlow, error: ApiError) -> None:
        flow.response = _api_error(error)
        flow.metadata[CONVERSATION] = {"error": error.body["error"]["code"] or error.status}
        flow.comment = f"emulated: conversation refused ({error.status})"

    async def full_history(self, flow: http.HTTPFlow, client: http.Request) -> bytes | None:
        """The client's request as full history, for a turn that must move to
        another upstream: its conversation or its chain expanded; None when it
        already is full history, or when the record cannot expand it."""
        record = self._flows.get(flow)
        if record is not None and record.expanded is not None:
            return record.expanded
        reading = self.reader.read(request_of(flow, client), count=False, conversations=True)
        if isinstance(reading, Skip) or reading.conversation is None:
            return await self.emulation.full_history(flow, client)
        if self.mode == "off" or reading.previous is not None:
            return None
        try:
            record = _InConversation(Tenant.under(self.tenancy, reading.credential), reading.credential, reading.scope,
                                     reading.label, named(reading.conversation))
            record.conversation = await self._find(record, learn_secrets=False)
            if record.conversation is None:
                return None
            record.listed_input = listed(reading.raw_items if reading.raw_items is not None
                                         else [string_input_item(bytes(reading.fields["input"]))])
            return (await self._expansion(reading, client, record))[0]
        except (ApiError, StorageError):
            return None

    # -- answers -------------------------------------------------------------------

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and self._responses_to.get(client_flow(flow)) is not None:
            try:
                self._note_served(flow)
            except Exception:
                internal_error(self.counters, "noting a Responses API host")
        if _withheld(flow):
            return  # the answer to an empty body: its request is sent in its place, and that answer judged or joined
        record = self._flows.get(client_flow(flow))
        if record is None or flow.response is None:
            return
        try:
            if record.judged is not None:
                if flow.metadata.get(RETRY_OF) is None:
                    hold(flow)  # the response hook may answer instead
                return
            if flow.response.status_code >= 300 or record.joined or flow.metadata.get(HELD):
                return
            content_type = flow.response.headers.get("content-type", "")
            streamed = "text/event-stream" in content_type.lower()
            if not streamed and flow.metadata.get(RETRY_OF) is None:
                hold(flow)  # read whole in the response hook, which also names the conversation in it
                return
            encoding = flow.response.headers.get("content-encoding", "")
            reader = record.reader = AnswerReader(content_type, encoding, _length(flow.response))
            keep_end_for_hooks(flow)  # the client holds the whole answer only once the conversation has it
            assert record.conversation is not None
            echo = Echo(record.conversation.id) if streamed and encoding in ("", "identity") else None
            downstream = flow.response.stream

            def tap(chunk: bytes) -> bytes | list[bytes]:
                nonlocal echo
                if not record.joined:
                    reader.feed(chunk)  # never raises
                    if reader.complete:
                        self._join(record, reader)  # before these last bytes reach the client
                passed = downstream(chunk) if callable(downstream) else chunk
                if echo is None:
                    return passed
                data = passed if isinstance(passed, bytes | bytearray) else b"".join(passed)
                try:
                    named = echo.feed(bytes(data)) if data else []  # never an empty chunk: it would end the body
                    return named + echo.feed(b"") if not chunk else named
                except Exception:
                    internal_error(self.counters, "naming a conversation in an answer")
                    rest, echo = echo.feed(b""), None
                    return rest + [bytes(data)]

            flow.response.stream = tap
        except Exception:
            internal_error(self.counters, "tapping an answer to a conversation")

    async def response(self, flow: http.HTTPFlow) -> None:
        client = client_flow(flow)
        record = self._flows.get(client)
        if record is None or flow.response is None or _withheld(flow):
            return
        try:
            if record.judged is not None:
                if client is flow:
                    await self._judge(flow, record, record.judged)
            elif flow.response.status_code < 300 and record.conversation is not None:
                if not record.joined:  # a retry of ours joined already: its answer is this one
                    reader = AnswerReader(flow.response.headers.get("content-type", ""),
                                          flow.response.headers.get("content-encoding", ""))
                    reader.feed(flow.response.raw_content or b"")  # held or buffered: read it whole
                    self._join(record, reader)
                if client is flow and flow.metadata.get(HELD) and "event-stream" not in \
                        flow.response.headers.get("content-type", ""):
                    named = named_in(flow.response.get_content(strict=False) or b"", record.conversation.id)
                    if named is not None:
                        flow.response.content = named  # as the API's answer names its conversation
        except StorageError:
            pass
        except Exception:
            internal_error(self.counters, "emulating a conversation")
        # A held answer's record stays for its own hook (a retry made before it, by a checked continuation, was
        # joined: the client's hook names it) or for another addon's retry after it, which joins.
        if not client.metadata.get(HELD) or (client is flow and record.judged is not None):
            self._flows.pop(client)
        if end_still_to_come(flow):
            await self.state.written(record.written, RECORD_WAIT)

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(RETRY_OF) is None:
            self._flows.pop(flow)

    def _join(self, record: _InConversation, reader: AnswerReader) -> None:
        """A completed response joins its conversation (a failed or
        incomplete one adds nothing)."""
        record.joined = True
        response = reader.finish()
        if record.conversation is None or not isinstance(response, dict) or response.get("status") != "completed":
            return
        self.conversations.join(record.tenant, record.conversation, without_triggers(record.listed_input),
                                response.get("output") or [])
        record.written = self.state.flush()
        self._debug("appended a response to conversation %s", record.conversation.id)

    async def _judge(self, flow: http.HTTPFlow, record: _InConversation, call: Call) -> None:
        """The upstream's answer to a request about a conversation the proxy
        does not keep: does that upstream + credential have the API? If it
        lacks it, the proxy takes over: a failure answer is replaced by the
        proxy's own, an answer that succeeded stands."""
        assert flow.response is not None
        status = flow.response.status_code
        if status in TRANSIENT_STATUSES or status >= 500:
            return  # says nothing about the API
        body = flow.response.get_content(strict=False) or b""
        if call.endpoint == "response" and status < 300:
            reader = AnswerReader(flow.response.headers.get("content-type", ""), "")
            reader.feed(body)
            answer = reader.finish()
            if not isinstance(answer, dict):
                return  # no response to read (a gateway's page, a stream cut short): says nothing about the API
            has = call.conversation_id in echoed_conversations(answer)  # none, or null: the field was dropped
        elif status < 300:
            has = True
        elif status == 404 and (f"Conversation with id '{call.conversation_id}'".encode() in body
                                or _names_an_unknown_item(body)):
            has = True  # the API's own not found, of the conversation or of an item
        elif status == 400 and b'"conversation_locked"' in body:
            has = True  # the API's own: another response is being made in the conversation
        elif status == 404 and call.endpoint == "response":
            has = True  # a conversation looked up and not found (smg's "No conversation found with id …")
        elif status == 404 and call.endpoint != "create":
            # About one id, or about the route? Only the route says the upstream lacks the API: its 404 must be
            # the one it answers for a path no API has, and an API's own not found (smg's "Conversation not
            # found", "Item not found in this conversation") is not.
            path = urlsplit(flow.request.url).path
            routed = route(flow.request.method, path)
            unknown = await self.proofs.unknown_route(flow, routed[0]) if routed is not None else None
            if unknown is None:
                return  # no answer: nothing learned
            has = not same_as_unknown_route(status, body, flow.request.method, path, unknown)
        elif status in (404, 405) or (call.endpoint == "response" and b"conversation" in body.lower()):
            has = False
        else:
            return  # the request's own error
        if has:
            self.upstreams.mark("has_conversations", record.scope)
            self.state.flush()
            return
        if self.upstreams.mark("lacks_conversations", record.scope):
            logger.info("stateful-responses: %s lacks the Conversations API (%d); the proxy keeps conversations "
                        "for it from now on", record.label, status)
        self.state.flush()
        if status < 300:
            return  # an answer that succeeded stands: only later requests are the proxy's
        if call.endpoint == "create":
            await self._answer(flow, record, call)
        else:
            flow.response = _api_error(not_found(call.conversation_id))  # nobody keeps it
        flow.metadata[CONVERSATION] = {"taken_over_after": status}
        flow.comment = f"emulated: the upstream lacks the Conversations API ({status}); answered by the proxy"

    def _debug(self, msg: str, *args) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)
