"""The continuation record's mitmproxy glue (seed 003).

Every flow that is an LLM API call (OpenAI Responses, Chat Completions,
Anthropic Messages, Gemini) gets ``flow.metadata["continuation"]`` and
``flow.metadata["audit"]["protocolMapping"]``; its comment starts with a
chain tag (``~comment chain:ab12cd34`` filters one conversation in mitmweb);
with ``stateful_record_file`` each flow is also one JSON line there, once its
answer is complete or failed. Listed right after the state store: it lifts the
client's own request, before any addon of ours changes it, and what the other
addons did is read back from the flow when the answer is in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from mitmproxy import ctx, http

from ..bounded import Bounded
from ..counters import Counters
from ..flows import (
    AUDIT,
    BRIDGED,
    CONTINUATION,
    CONVERSATION,
    DECISION,
    Call,
    EMULATION,
    HELD,
    RETRY_OF,
    ROUTED,
    SERVED_SOCKET,
    SOCKET_TURN,
    PerFlow,
    internal_error,
    request_of,
)
from ..items import Ambiguous
from ..request_reader import Reader, Reading, upstream_of
from ..settings import Config
from ..answer_reader import TERMINAL_EVENTS, LiftReader
from ..state.access import StateAccess
from ..tenancy import Tenancy, credential_material
from .index import CHAIN_TIPS, ChainIndex, Turn, audit_entry, chain_tag
from .protocols import AnswerLifter, LiftedAnswer, LiftedRequest, detect, lift_request, responses

logger = logging.getLogger(__name__)

SPANS = frozenset({"input", "tools", "metadata", "text", "include", "reasoning"})  # big or irrelevant: not decoded


class RecordFile:
    """One JSON line per flow, appended by a thread of its own (never on the
    event loop); one writer, so concurrent flows never interleave in a line."""

    def __init__(self) -> None:
        self.path = ""
        self._lines: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def configure(self, path: str) -> None:
        self.path = os.path.expanduser(path)
        if self.path and self._thread is None:
            self._thread = threading.Thread(target=self._write, name="stateful-responses-record", daemon=True)
            self._thread.start()

    def append(self, line: dict) -> None:
        if self.path:
            self._lines.put((self.path, json.dumps(line, separators=(",", ":")) + "\n"))

    def close(self) -> None:
        if self._thread is not None:
            self._lines.put(None)
            self._thread.join(5)
            self._thread = None

    def _write(self) -> None:
        while (item := self._lines.get()) is not None:
            path, line = item
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError as e:
                logger.warning("stateful-responses: cannot append to the record file (%s)", e.strerror)


class _Error(msgspec.Struct):
    code: object = None


class _Message(msgspec.Struct):
    """What the record reads of a WebSocket message: its type, its lane, whether
    it is part of a response's stream, and an error's code."""

    type: object = None
    stream_id: object = None
    sequence_number: object = None
    error: _Error | None = None
    previous_response_id: object = None  # a response.steer's target


class _Created(msgspec.Struct):
    id: object = None
    model: object = None
    previous_response_id: object = None


class _CreatedEvent(msgspec.Struct):
    response: _Created | None = None


class _Steer(msgspec.Struct):
    input: object = None


def _message(content: bytes) -> _Message:
    """The message read; a lane or a target that is not a string reads as none."""
    try:
        message = msgspec.json.decode(content, type=_Message)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Message()
    if not isinstance(message.stream_id, str):
        message.stream_id = None
    if not isinstance(message.previous_response_id, str):
        message.previous_response_id = None
    return message


# A socket's refusal of a ``response.create`` because a response still runs on its lane: the refused request is
# not the one running.
BUSY_ERRORS = frozenset({"response_already_in_flight", "conversation_already_has_active_response"})
SOCKET_MEMORY = 64  # response ids (and their lanes) a socket's record remembers


@dataclass(eq=False)
class _SocketTurn:
    turn: Turn
    lifter: AnswerLifter
    n: int  # its place on the socket
    lane: object  # the ``stream_id`` of its lane (None: the default lane)
    started: bool = False  # its ``response.created`` came
    began: float = field(default_factory=time.time)


@dataclass
class _SocketTurns:
    """A client's own WebSocket to a Responses endpoint: its ``response.create``
    turns still unanswered, oldest first. A lane (``stream_id``) runs one
    response at a time; events name their lane and belong to its oldest
    started turn. Steering input waits, per lane, for the successor response
    the server makes with it."""

    credential: bytes
    upstream: str
    count: int = 0
    open: list[_SocketTurn] = field(default_factory=list)
    lanes: Bounded = field(default_factory=lambda: Bounded(SOCKET_MEMORY))  # response id -> its lane
    latest: dict = field(default_factory=dict)  # lane -> (its latest response id, model)
    steers: dict = field(default_factory=dict)  # lane -> the steering input accepted for its next successor


class ContinuationRecord:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, reader: Reader, state: StateAccess,
                 index: ChainIndex) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.reader = reader
        self.state = state
        self.index = index
        self.file = RecordFile()
        # by flow id: the turn, and the reader tapping the answer as it streams (and which answer)
        self._turns: PerFlow[tuple[Turn, LiftReader | None, http.Response | None]] = PerFlow()
        self._sockets: PerFlow[_SocketTurns] = PerFlow()
        # told of every call once it is recorded (telemetry's traces): counts and ids, never content
        self.listeners: list[Callable[[http.HTTPFlow, Call], None]] = []

    def configure(self, updated: set[str]) -> None:
        if "stateful_record_file" in updated:
            self.file.configure(ctx.options.stateful_record_file)

    def done(self) -> None:
        self.file.close()

    async def request(self, flow: http.HTTPFlow) -> None:
        if not self.config.settings.enabled or flow.metadata.get(RETRY_OF) is not None:
            return
        protocol = detect(flow.request.method, flow.request.url)
        if protocol is None:
            return
        await self.state.ready()
        try:
            credential = credential_material(request_of(flow))
            try:
                lifted = self._lift(protocol, flow)
                turn = None if lifted is None else self.index.begin(lifted, credential, self.tenancy.secret,
                                                                     flow_id=flow.id, upstream=_upstream(flow))
            except (Ambiguous, RecursionError):  # read differently elsewhere, or nested past any sense
                turn = None
            if turn is None:
                flow.metadata[CONTINUATION] = None
                entry = audit_entry("body", "unsupported", "no conversation to record: not this protocol's JSON, "
                                    "or JSON that parsers read differently", protocol)
                flow.metadata[AUDIT] = {"protocolMapping": {"unsupported": [dataclasses.asdict(entry)]}}
                return
            if turn.unresolved:
                self.index.resolve(turn, await self.state.get(self.index.table_of(turn), turn.unresolved))
            if chains := self.index.unknown_tips(turn):
                self.index.learn_tips(turn, await self.state.get(CHAIN_TIPS, chains))
            self.index.claim(turn)
            self.state.flush()
            self._turns.put(flow, (turn, None, None))
            flow.metadata[CONTINUATION] = turn.record()
            flow.metadata[AUDIT] = {"protocolMapping": turn.audit()}
            flow.comment = chain_tag(turn.chain_id)
        except Exception:
            internal_error(self.counters, "lifting a request")

    def _lift(self, protocol: str, flow: http.HTTPFlow) -> LiftedRequest | None:
        """The request lifted; a Responses request through the shared reader's
        reading (its items' digests are cached), never parsed twice."""
        if protocol == "openai-responses":
            reading = self.reader.read(request_of(flow), count=False, conversations=True)
            if isinstance(reading, Reading) and reading.raw_items is not None:
                small = {k: msgspec.json.decode(v) for k, v in reading.fields.items() if k not in SPANS}
                return responses.lift_read(small, reading.raw_items, reading.digests)
        return lift_request(protocol, flow.request.url, flow.request.raw_content or b"")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        entry = self._turns.get(flow)
        if entry is None or flow.response is None or flow.metadata.get(HELD):
            return
        try:
            turn = entry[0]
            reader = LiftReader(AnswerLifter(turn.protocol), flow.response.headers.get("content-type", ""),
                                flow.response.headers.get("content-encoding", ""))
            self._turns.put(flow, (turn, reader, flow.response))
            downstream = flow.response.stream

            def tap(chunk: bytes) -> bytes:
                reader.feed(chunk)  # never raises
                return downstream(chunk) if callable(downstream) else chunk

            flow.response.stream = tap
        except Exception:
            internal_error(self.counters, "tapping an answer to lift")

    # -- a client's own WebSocket (Codex, the openai SDK's responses.connect()): it passes untouched ----------

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Each ``response.create`` a client sends on its own socket is a turn
        with a record of its own; the events that come back are its answer."""
        if not self.config.settings.enabled or flow.websocket is None or flow.request.method != "GET" \
                or upstream_of(flow.request.url) is None or SERVED_SOCKET in flow.metadata:
            return  # a socket the proxy serves itself: each turn is recorded as the HTTP request it became
        message = flow.websocket.messages[-1]
        try:
            if message.from_client:
                await self._socket_request(flow, message.content)
            else:
                await self._socket_event(flow, message.content)
        except Exception:
            internal_error(self.counters, "recording a WebSocket turn")

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        sockets = self._sockets.pop(flow)
        for entry in sockets.open if sockets is not None else ():
            try:
                self._finish_socket_turn(flow, entry.turn, None, entry.n, entry.began)
            except Exception:
                internal_error(self.counters, "recording a WebSocket turn")

    def _socket(self, flow: http.HTTPFlow) -> _SocketTurns:
        sockets = self._sockets.get(flow)
        if sockets is None:
            sockets = _SocketTurns(credential_material(request_of(flow)), _upstream(flow))
            self._sockets.put(flow, sockets)
        return sockets

    async def _socket_request(self, flow: http.HTTPFlow, content: bytes) -> None:
        message = _message(content)
        if message.type == "response.steer":
            sockets = self._socket(flow)
            lane = sockets.lanes.get(message.previous_response_id, None)
            steer = msgspec.json.decode(content, type=_Steer).input
            steered = sockets.steers.setdefault(lane, [])
            steered += steer if isinstance(steer, list) else [{"role": "user", "content": steer}] if steer else []
            del steered[:-SOCKET_MEMORY]
            return
        if message.type != "response.create":
            return
        await self.state.ready()
        sockets = self._socket(flow)
        await self._begin_socket_turn(flow, sockets, content, message.stream_id)

    async def _begin_socket_turn(self, flow: http.HTTPFlow, sockets: _SocketTurns, content: bytes, lane: object,
                                 started: bool = False) -> _SocketTurn | None:
        lifted = lift_request("openai-responses", flow.request.url, content)
        try:
            turn = None if lifted is None else self.index.begin(
                lifted, sockets.credential, self.tenancy.secret, flow_id=f"{flow.id}#{sockets.count}",
                upstream=sockets.upstream)
        except (Ambiguous, RecursionError):
            turn = None
        if turn is None:
            return None
        if turn.unresolved:
            self.index.resolve(turn, await self.state.get(self.index.table_of(turn), turn.unresolved))
        if chains := self.index.unknown_tips(turn):
            self.index.learn_tips(turn, await self.state.get(CHAIN_TIPS, chains))
        self.index.claim(turn)
        self.state.flush()
        entry = _SocketTurn(turn, AnswerLifter(turn.protocol), sockets.count, lane, started)
        sockets.open.append(entry)
        sockets.count += 1
        flow.metadata[CONTINUATION] = turn.record()
        flow.metadata[AUDIT] = {"protocolMapping": turn.audit()}
        flow.comment = chain_tag(turn.chain_id)
        return entry

    async def _socket_event(self, flow: http.HTTPFlow, content: bytes) -> None:
        sockets = self._sockets.get(flow)
        if sockets is None:
            return
        message = _message(content)
        kind, lane = message.type, message.stream_id
        if not isinstance(kind, str) or kind.startswith("response.steer."):
            if kind == "response.steer.failed":
                sockets.steers.pop(lane, None)  # given back to the client, which sends it again itself
            return
        on_lane = [t for t in sockets.open if t.lane == lane]
        waiting = [t for t in on_lane if not t.started]
        if kind == "error" and message.sequence_number is None:  # a request refused, not a stream that broke
            busy = message.error is not None and message.error.code in BUSY_ERRORS
            candidates = [t for t in on_lane[1:] if not t.started] if busy else waiting
            entry = candidates[0] if candidates else on_lane[0] if on_lane else None
        elif kind == "response.created":
            entry = waiting[0] if waiting else await self._successor(flow, sockets, content, lane)
        else:
            entry = next((t for t in on_lane if t.started), on_lane[0] if on_lane else None)
        if entry is None:
            return
        if kind == "response.created":
            entry.started = True
            created = msgspec.json.decode(content, type=_CreatedEvent).response
            if created is not None and isinstance(created.id, str):
                sockets.lanes.put(created.id, lane)
                sockets.latest[lane] = (created.id, created.model)
        entry.lifter.event(kind, content.decode("utf-8", "replace"))
        if kind in TERMINAL_EVENTS:
            sockets.open.remove(entry)
            self._finish_socket_turn(flow, entry.turn, entry.lifter.finish(), entry.n, entry.began)

    async def _successor(self, flow: http.HTTPFlow, sockets: _SocketTurns, content: bytes,
                         lane: object) -> _SocketTurn | None:
        """A response the server made on its own, after the lane's latest one
        (steering): a turn continuing that one by id, with the steering input
        the lane had waiting as its input."""
        created = msgspec.json.decode(content, type=_CreatedEvent).response
        latest_id, model = sockets.latest.get(lane, (None, None))
        parent = created.previous_response_id if created is not None else None
        parent = parent if isinstance(parent, str) else latest_id
        if parent is None:
            return None  # nothing on the lane it could follow
        if created is not None and isinstance(created.model, str):
            model = created.model
        body = {"model": model, "input": sockets.steers.pop(lane, []), "previous_response_id": parent}
        entry = await self._begin_socket_turn(flow, sockets, msgspec.json.encode(body), lane, started=True)
        if entry is not None:
            entry.turn.changes.append(audit_entry(
                "input", "preserved", f"a successor response the server made after {parent} on its own (steering): "
                "its input is the steering input the server accepted for it", entry.turn.protocol, None))
        return entry

    def _finish_socket_turn(self, flow: http.HTTPFlow, turn: Turn, answer: LiftedAnswer | None, n: int,
                            began: float) -> None:
        self.index.finish(turn, answer)
        self.state.flush()
        record, audit = turn.record(), {"protocolMapping": turn.audit()}
        flow.metadata[CONTINUATION] = record
        flow.metadata[AUDIT] = audit
        flow.comment = chain_tag(turn.chain_id)
        self.file.append({"flow": flow.id, "turn": n, "time": time.time(), "protocol": turn.protocol,
                          "model": turn.request.model, "transport": {"client": "websocket", "upstream": "websocket"},
                          "continuation": record, "audit": audit})
        self._tell(flow, turn, answer, None, "websocket", "websocket", began)

    def _tell(self, flow: http.HTTPFlow, turn: Turn, answer: LiftedAnswer | None, status_code: int | None,
              client: str, upstream: str, began: float) -> None:
        """Tell the listeners of a recorded call (never raising into the record)."""
        if not self.listeners:
            return
        usage = answer.usage if answer is not None else None
        call = Call(turn.protocol, turn.request.model, turn.chain_id, answer.response_id if answer else None,
                    answer.status if answer else None, status_code,
                    usage.input_tokens if usage else None, usage.output_tokens if usage else None,
                    client, upstream, began, time.time())
        for listener in self.listeners:
            try:
                listener(flow, call)
            except Exception:
                internal_error(self.counters, "telling a listener of a call")

    @property
    def answers(self) -> RecordAnswers:
        return RecordAnswers(self)

    async def finish_response(self, flow: http.HTTPFlow) -> None:
        entry = self._turns.pop(flow)
        if entry is None or flow.response is None:
            return
        turn, reader, tapped = entry
        try:
            # Read whole what the tap did not see through: an answer held back
            # (another addon's hold drops the tap), one that replaced it (a
            # retry, a failover), one buffered, an error.
            if reader is None or tapped is not flow.response or flow.metadata.get(HELD) \
                    or flow.response.status_code >= 300:
                reader = LiftReader(AnswerLifter(turn.protocol), flow.response.headers.get("content-type", ""),
                                    flow.response.headers.get("content-encoding", ""))
                reader.feed(flow.response.raw_content or b"")
            answer = reader.finish() if flow.response.status_code < 300 else None
            self._finish(flow, turn, answer)
        except Exception:
            internal_error(self.counters, "recording a turn")

    def finish_error(self, flow: http.HTTPFlow) -> None:
        entry = self._turns.pop(flow)
        if entry is not None:
            try:
                self._finish(flow, entry[0], None)
            except Exception:
                internal_error(self.counters, "recording a failed turn")

    def _finish(self, flow: http.HTTPFlow, turn: Turn, answer) -> None:
        changes, turn.continued_upstream, expanded = _changes_made(flow, turn.protocol)
        bridged, routed_away = flow.metadata.get(BRIDGED) or {}, (flow.metadata.get(ROUTED) or {}).get("failed_over_to")
        upstream_transport = "websocket" if bridged.get("transport") == "websocket" and not routed_away else "http"
        turn.changes += changes
        turn.restored = turn.continued_upstream or expanded
        routed = flow.metadata.get(ROUTED) or {}
        turn.upstream = routed.get("failed_over_to") or routed.get("upstream") or turn.upstream
        self.index.finish(turn, answer)
        self.state.flush()
        record, audit = turn.record(), {"protocolMapping": turn.audit()}
        flow.metadata[CONTINUATION] = record
        flow.metadata[AUDIT] = audit
        comment = flow.comment or ""
        if comment.startswith("chain:"):  # the tag the request got: the chain may have changed since
            comment = comment.partition(" ")[2]
        flow.comment = f"{chain_tag(turn.chain_id)} {comment}".strip()
        line = {"flow": flow.id, "time": time.time(), "protocol": turn.protocol, "model": turn.request.model,
                "transport": {"client": "http", "upstream": upstream_transport}, "continuation": record, "audit": audit}
        client_transport = "http"
        if (socket_turn := flow.metadata.get(SOCKET_TURN)) is not None:  # a turn of a socket the proxy serves
            client_transport = "websocket"
            line.update(flow=socket_turn["socket"], turn=socket_turn["turn"],
                        transport={"client": client_transport, "upstream": upstream_transport})
        self.file.append(line)
        self._tell(flow, turn, answer, flow.response.status_code if flow.response is not None else None,
                   client_transport, upstream_transport, flow.request.timestamp_start)


class RecordAnswers:
    """The record's answer side, listed after every addon that may change or
    replace an answer (a retry, a failover), so that it records what the
    client got and everything our addons did."""

    def __init__(self, record: ContinuationRecord) -> None:
        self.record = record

    async def response(self, flow: http.HTTPFlow) -> None:
        await self.record.finish_response(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.record.finish_error(flow)


def _upstream(flow: http.HTTPFlow) -> str:
    return f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"


def _changes_made(flow: http.HTTPFlow, protocol: str) -> tuple[list, bool, bool]:
    """Audit entries for what our own addons did in this flow, as it finally
    went: a continuation the upstream refused, or one a failover took
    elsewhere, did not reach the answer the client got. Also whether the
    answer came from a continuation of the upstream's state, and whether from
    a chain the proxy expanded."""
    changes = []
    decision = flow.metadata.get(DECISION) or {}
    routed = flow.metadata.get(ROUTED) or {}
    continued = decision.get("action") == "continue"
    refused, failed_over = decision.get("retried_after"), routed.get("failed_over_to")
    bridged = flow.metadata.get(BRIDGED) or {}
    over_socket = bridged.get("transport") == "websocket" and not failed_over
    socket_continued = over_socket and bridged.get("action") == "continue"
    if socket_continued:
        changes.append(audit_entry(
            "input", "preserved",
            f"continued over the upstream's WebSocket from {bridged.get('previous_response_id')}: "
            f"{bridged.get('items_sent')} of {bridged.get('items_total')} items sent, the rest from the socket's "
            "memory of its latest response (nothing stored upstream)", protocol))
    if over_socket:
        changes.append(audit_entry("transport", "preserved", "sent as a response.create over the proxy's WebSocket "
                                   "to the upstream, store as the client sent it; the events came back as this HTTP "
                                   "answer", protocol))
    elif bridged:
        retries = "; ".join(bridged.get("retries") or []) or "it failed over elsewhere"
        changes.append(audit_entry("transport", "preserved", f"the upstream's WebSocket could not answer it "
                                   f"({retries}): the client's own request went over HTTP", protocol))
    if refused:
        change = f"continued from {decision.get('previous_response_id')}" if continued else "the changed request"
        why = decision.get("retry_reason") or f"the upstream answered {refused}"
        changes.append(audit_entry("input", "preserved", f"{change}: {why}; the client's own body was sent again "
                                   "instead", protocol))
    elif continued and failed_over:
        changes.append(audit_entry("input", "preserved", f"continued from {decision.get('previous_response_id')} "
                                   f"at {routed['upstream']}; the failover sent the client's own body instead",
                                   protocol))
    elif continued:
        changes.append(audit_entry(
            "input", "preserved",
            f"continued from {decision.get('previous_response_id')}: {decision.get('items_sent')} of "
            f"{decision.get('items_total')} items sent, the rest by reference to what the upstream stored",
            protocol))
    if decision.get("forced_store") and not refused and not failed_over:
        changes.append(audit_entry("store", "lossy", "the client's store choice replaced by store: true "
                                   "(stateful_force_store)", protocol))
    if routed.get("failed_over_to"):
        changes.append(audit_entry(
            "upstream", "lossy", f"{routed['upstream']} answered {routed['failed_after']}; the turn went to "
            f"{routed['failed_over_to']} with full history", protocol, routed["failed_over_to"]))
    if routed.get("reasoning_dropped"):
        changes.append(audit_entry(
            "reasoning.encrypted_content", "dropped", f"{routed['reasoning_dropped']} reasoning items encrypted by "
            f"{routed['upstream']} cannot be read by {routed['failed_over_to']}", protocol, routed["failed_over_to"]))
    emulated = flow.metadata.get(EMULATION) or {}
    if emulated.get("expanded"):
        changes.append(audit_entry("previous_response_id", "dropped",
                                   f"{emulated.get('previous_response_id')} expanded into the recorded chain: "
                                   "the upstream got full history instead", protocol))
        changes.append(audit_entry("instructions", "dropped", "earlier turns' instructions are not carried "
                                   "over (the API does not inherit them)", protocol))
    if emulated.get("reasoning_dropped"):
        changes.append(audit_entry("reasoning", "dropped", f"{emulated['reasoning_dropped']} recorded reasoning items "
                                   "named by id without their encrypted_content: an upstream that persists nothing "
                                   "cannot read them", protocol))
    if emulated.get("references_expanded"):
        changes.append(audit_entry("item_reference", "preserved", "references to recorded items expanded from the "
                                   "record: the upstream stores nothing", protocol))
    conversation = flow.metadata.get(CONVERSATION) or {}
    if conversation.get("id"):
        changes.append(audit_entry("conversation", "dropped", f"{conversation['id']} expanded into its "
                                   f"{conversation.get('items')} items, kept by the proxy: the upstream got full "
                                   "history instead", protocol))
    if conversation.get("reasoning_dropped"):
        changes.append(audit_entry("reasoning", "dropped", f"{conversation['reasoning_dropped']} reasoning items of "
                                   "the conversation named by id without their encrypted_content: an upstream that "
                                   "persists nothing cannot read them", protocol))
    expanded = bool(emulated.get("expanded") or conversation.get("id"))
    upstream_state = (continued and not refused and not failed_over) or socket_continued
    return changes, upstream_state, expanded
