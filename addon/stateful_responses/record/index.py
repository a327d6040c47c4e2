"""One continuation record per LLM API call, whatever its protocol (seed 003).

Every flow gets the seed's record: which chain it belongs to, which turn it
continues, where it resumes from, how sticky its routing is, what tool calls
it answers or leaves pending; and an audit of what the lift (and the addon's
own changes) kept, lost, dropped or could not carry.

Chains come from one prefix-hash logic for every protocol: a request whose
conversation messages extend an earlier turn's messages + its answer continues
that turn's chain; a ``previous_response_id`` continues the chain of the turn
that produced it; anything else starts a chain. A turn that continues a turn
that is no longer its chain's tip is a fork: it starts its own chain and names
where it left (``resumeFrom``). Pure: no mitmproxy, no I/O; the index leaves
through an outbox and misses are looked up by the glue (as ``planner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from ..bounded import Bounded
from ..entropy import random_bytes
from ..items import Ambiguous, ItemSequence, canonical_json
from ..settings import Config
from ..state.outbox import Outbox, Write
from .protocols import AuditEntry, LiftedAnswer, LiftedRequest

CHAIN_TURNS = "chain-turns"  # digest of a turn's messages + answer -> TurnRef
CHAIN_RESPONSES = "chain-responses"  # a response id, per credential -> TurnRef
CHAIN_TIPS = "chain-tips"  # chain id -> the turn id at its tip
DISPOSITIONS = ("preserved", "lossy", "dropped", "unsupported")


class TurnRef(msgspec.Struct, array_like=True, frozen=True):
    """What the index keeps of a turn: enough to continue, route and name it."""

    turn_id: str
    chain_id: str
    protocol: str
    flow_id: str
    response_id: str | None
    upstream: str  # who answered it: the router keeps a chain there


_TURN = msgspec.msgpack.Decoder(TurnRef)
_ENCODE = msgspec.msgpack.Encoder().encode


def _decode_turn(data: bytes) -> TurnRef | None:
    try:
        return _TURN.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def new_id(prefix: str) -> str:
    return f"{prefix}_{random_bytes(8).hex()}"


def chain_tag(chain_id: str) -> str:
    """The flow comment's first word: ``~comment TAG`` filters one conversation."""
    return "chain:" + chain_id.rsplit("_", 1)[-1][:8]


@dataclass
class Turn:
    """One flow's turn, from its request to its answer."""

    turn_id: str
    flow_id: str
    protocol: str
    upstream: str
    root: bytes
    request: LiftedRequest
    sequence: ItemSequence  # rolling digests of the request's messages
    responses_key: Callable[[str], bytes]
    previous: TurnRef | None = None
    chain_id: str = ""
    fork: bool = False
    unresolved: list[bytes] = field(default_factory=list)  # index keys memory did not know
    answer: LiftedAnswer | None = None
    changes: list[AuditEntry] = field(default_factory=list)  # the addon's own, on top of the lift's
    restored: bool = False

    def record(self) -> dict[str, Any]:
        """The seed's ``continuation`` record, with this flow's ``turnId``."""
        request, answer, previous = self.request, self.answer, self.previous
        resume: dict[str, Any] | None = None
        if previous is not None or request.previous_response_id:
            resume = {
                "protocol": previous.protocol if previous else request.protocol,
                "requestId": previous.flow_id if previous else None,
                "responseId": previous.response_id if previous else request.previous_response_id,
                "previousResponseId": request.previous_response_id,
                "turnId": previous.turn_id if previous else None,
            }
        submitted = [r.call_id for r in request.submitted_tool_results]
        pending = list(answer.pending_tool_calls) if answer else []
        upstream_state = bool(request.previous_response_id) or any(
            c.field == "input" and c.disposition == "preserved" for c in self.changes)
        sticky = "request_chain" if upstream_state else "conversation" if previous and not self.fork else "request"
        mode = "tool_outputs" if submitted else "tool_calls" if pending else None
        continuation: dict[str, Any] = {
            "chainId": self.chain_id,
            "turnId": self.turn_id,
            "previousTurnId": previous.turn_id if previous else None,
            "resumeFrom": resume,
            "stickyScope": sticky,
            "stateOrigin": "tool-loop" if submitted else request.protocol,
            "restored": self.restored,
            "toolContinuation": {
                "mode": mode,
                "pendingToolCallIds": pending,
                "submittedToolCallIds": submitted,
                # The results themselves are prompt content: never in a record.
                "resumeOutputs": [{"callId": r.call_id, "name": r.name, "bytes": r.output_bytes,
                                   "digest": r.digest} for r in request.submitted_tool_results],
            },
            "protocolHints": {**request.hints, **(answer.hints if answer else {})},
        }
        return continuation

    def audit(self) -> dict[str, list[dict[str, Any]]]:
        """``protocolMapping``: every entry of the lift and of the addon's changes, by disposition."""
        entries = list(self.request.audit) + (list(self.answer.audit) if self.answer else []) + self.changes
        mapping: dict[str, list[dict[str, Any]]] = {d: [] for d in DISPOSITIONS}
        for e in entries:
            mapping[e.disposition].append({"field": e.field, "disposition": e.disposition, "reason": e.reason,
                                           "sourceProtocol": e.sourceProtocol, "targetProtocol": e.targetProtocol,
                                           "source": e.source})
        return mapping


@dataclass
class ChainIndex:
    """Which turn a request continues, and which chain that makes it."""

    config: Config = field(default_factory=Config)
    turns: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # digest -> TurnRef
    responses: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # key -> TurnRef
    tips: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # chain id -> turn id
    homes: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # turn id -> who answered it
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {CHAIN_TURNS: 1_000_000, CHAIN_RESPONSES: 1_000_000, CHAIN_TIPS: 1_000_000}

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self.turns.clear()
        self.responses.clear()
        self.tips.clear()
        self.homes.clear()
        self._outbox.clear()

    def begin(self, request: LiftedRequest, credential: bytes, secret: bytes, *, flow_id: str,
              upstream: str) -> Turn:
        """A request's turn, continued from what memory knows; ``unresolved``
        names what the backing store may know better (``resolve``). Keyed
        with the store's secret: every proxy sharing the store names alike.
        Ambiguous when a message reads differently in other parsers."""
        root = blake3(b"chains\x00" + credential, key=secret).digest()
        digests = request.digests if request.digests is not None else \
            [blake3(canonical_json(m)).digest(16) for m in request.messages]
        sequence = ItemSequence(root, digests)

        def responses_key(response_id: str) -> bytes:
            return blake3(root + b"\x00response\x00" + response_id.encode("utf-8", "surrogatepass"),
                          key=secret).digest(16)

        turn = Turn(new_id("turn"), flow_id, request.protocol, upstream, root, request, sequence, responses_key)
        self._continue(turn, {})
        return turn

    def resolve(self, turn: Turn, found: Mapping[bytes, bytes]) -> None:
        """Continue again, now with what the backing store had."""
        self._continue(turn, {k: t for k, v in found.items() if (t := _decode_turn(v)) is not None})

    @staticmethod
    def table_of(turn: Turn) -> str:
        """Where a turn's unresolved keys live."""
        return CHAIN_RESPONSES if turn.request.previous_response_id else CHAIN_TURNS

    def unknown_tip(self, turn: Turn) -> bytes | None:
        """The chain whose tip memory does not know (the backing store may)."""
        if turn.previous is None or self.tips.hit(turn.previous.chain_id) is not None:
            return None
        return turn.previous.chain_id.encode()

    def learn_tips(self, turn: Turn, found: Mapping[bytes, bytes]) -> None:
        for chain, tip in found.items():
            self.tips.put(chain.decode(errors="replace"), tip.decode(errors="replace"))
        self._decide_chain(turn)

    def _continue(self, turn: Turn, stored: Mapping[bytes, TurnRef]) -> None:
        request, prefixes = turn.request, turn.sequence.digests
        previous, unresolved = None, []
        if request.previous_response_id:
            key = turn.responses_key(request.previous_response_id)
            previous = self.responses.hit(key) or stored.get(key)
            if previous is None:
                unresolved.append(key)
        else:
            for k in range(len(prefixes) - 1, 0, -1):
                previous = self.turns.hit(prefixes[k - 1]) or stored.get(prefixes[k - 1])
                if previous is not None:
                    break
                unresolved.append(prefixes[k - 1])
        turn.unresolved = unresolved if not stored else []
        turn.previous = previous
        if previous is not None:
            self.homes.put(previous.turn_id, previous.upstream)
        self._decide_chain(turn)

    def _decide_chain(self, turn: Turn) -> None:
        previous = turn.previous
        if previous is None:
            turn.chain_id, turn.fork = turn.chain_id or new_id("chain"), False
            return
        tip = self.tips.hit(previous.chain_id)
        turn.fork = tip is not None and tip != previous.turn_id
        turn.chain_id = new_id("chain") if turn.fork else previous.chain_id

    def upstream_of(self, turn_id: str | None) -> str | None:
        """The upstream that answered a turn this process has met (read from
        the store when another process or a restart recorded it)."""
        return self.homes.get(turn_id) if turn_id else None

    def claim(self, turn: Turn) -> None:
        """The turn is on its way upstream: it is its chain's tip now, so a
        second request continuing the same turn is a fork."""
        self.tips.put(turn.chain_id, turn.turn_id)
        self._outbox.append(Write(CHAIN_TIPS, turn.chain_id.encode(), turn.turn_id.encode(), self.config.ttl))

    def finish(self, turn: Turn, answer: LiftedAnswer | None) -> None:
        """The answer arrived: a completed one makes the turn continuable."""
        turn.answer = answer
        if answer is None or answer.status != "completed":
            return
        try:
            digests = [blake3(canonical_json(m)).digest(16) for m in answer.messages]
        except (Ambiguous, RecursionError):
            return  # an answer other clients would read differently: nothing continues from it
        ref = TurnRef(turn.turn_id, turn.chain_id, turn.protocol, turn.flow_id, answer.response_id, turn.upstream)
        self.homes.put(turn.turn_id, turn.upstream)
        value = _ENCODE(ref)
        if digests:
            key = turn.sequence.extended(digests).digests[-1]
            self.turns.put(key, ref)
            self._outbox.append(Write(CHAIN_TURNS, key, value, self.config.ttl))
        if answer.response_id:
            key = turn.responses_key(answer.response_id)
            self.responses.put(key, ref)
            self._outbox.append(Write(CHAIN_RESPONSES, key, value, self.config.ttl))



def audit_entry(field_name: str, disposition: str, reason: str, protocol: str,
                target: str | None = None) -> AuditEntry:
    """An entry for a change the addon itself made (source: "proxy")."""
    return AuditEntry(field_name, disposition, reason, protocol, target, "proxy")  # type: ignore[arg-type]
