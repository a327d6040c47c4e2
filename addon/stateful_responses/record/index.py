"""One continuation record per LLM API call, whatever its protocol (seed 003).

Every flow gets the seed's record: which chain it belongs to, which turn it
continues, where it resumes from, how sticky its routing is, what tool calls
it answers or leaves pending; and an audit of what the lift (and the addon's
own changes) kept, lost, dropped or could not carry.

Chains come from one prefix-hash logic for every protocol: a request whose
conversation messages extend an earlier turn's messages + its answer continues
that turn's chain; a ``previous_response_id`` continues the chain of the turn
that produced it; a response made in a stored conversation (``conversation``)
is on that conversation's chain, named alike by every proxy of one store, and
continues its newest turn (never a fork: responses on one conversation at once
all join it); anything else starts a chain. A turn that continues a turn
that is no longer its chain's tip is a fork: it starts its own chain and names
where it left (``resumeFrom``).

The record follows what the client got. A turn claims its chain's tip while
it is on its way, and gives it back when it gets no answer the client can
continue from (an error status, a failed or refused answer, a broken
connection, a stream that stopped before its end): a dead end, not a branch,
so the client's retry of the same request continues the same chain. An
answer that ended early with a reason (out of tokens) keeps the tip, and the
same request sent again after it is a retry too. Two turns that end alike (identical conversations) are told apart
by the item ids a client echoes, else the one still at its chain's tip is the
one continued. Tool outputs a client puts right after each call they answer
still continue the answer that made the calls.

Every key of the index starts with its credential's shard tag
(``state.storage.shard_tag``) in place of its digest's first bytes: on a
Redis Cluster one credential's index is in one slot, so that a turn's entries
and its chain's tip are written in one script and a reader never sees a turn
without the tip it set; other credentials land elsewhere. (Keys made before
tags are not read again: the first turn of a conversation after the change
starts a new chain in the record, continuing nothing for the client.)

Pure: no mitmproxy, no I/O; the index leaves through an outbox and misses are
looked up by the glue (as ``planner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from ..bounded import Bounded
from ..entropy import random_bytes
from ..items import SEQUENCE_DIGEST_SIZE, Ambiguous, ItemSequence, canonical_json
from ..settings import Config
from ..state.outbox import Outbox, Write
from ..state.storage import SHARD_TAG_SIZE, shard_tag
from .protocols import AuditEntry, LiftedAnswer, LiftedRequest, ToolResult

CHAIN_TURNS = "chain-turns"  # digest of a turn's messages + answer -> the TurnRefs that end so
CHAIN_RESPONSES = "chain-responses"  # a response id, or a conversation's newest turn, per credential -> TurnRef
CHAIN_TIPS = "chain-tips"  # chain id (after its credential's shard tag) -> its Tip
DISPOSITIONS = ("preserved", "lossy", "dropped", "unsupported")
# Answers a client can echo and go on from: finished, or ended early with a reason (out of tokens, a paused
# server tool loop). An answer that never ended (no stop reason), an error or a refusal is a dead end.
CONTINUABLE = frozenset({"completed", "incomplete"})
SAME_ENDING = 8  # turns kept per digest: identical conversations that are not one
MAX_TAIL = 128  # items read back to find an answer whose calls have their outputs between them
CONTEXTS = 8192  # turns whose whole conversation's hash memory keeps, for the turns continued from them by id


class TurnRef(msgspec.Struct, array_like=True, frozen=True):
    """What the index keeps of a turn: enough to continue, route and name it."""

    turn_id: str
    chain_id: str
    protocol: str
    flow_id: str
    response_id: str | None
    upstream: str  # who answered it: the router keeps a chain there
    answer_len: int = 0  # messages the answer added
    answer_ids: tuple[str | None, ...] = ()  # their own ids, which a client may echo (Responses); () without
    pending: tuple[str, ...] = ()  # the client tool calls it left pending
    paused: bool = False  # a server tool loop paused in it: the client resends to let it go on


class Tip(msgspec.Struct, array_like=True, frozen=True):
    """A chain's newest turn, and whether it is still waiting for its answer."""

    turn_id: str
    parent: str | None = None  # the turn it continues
    attempt: bytes = b""  # its request's key: a retry of the same request has the same
    open: bool = False  # on its way: no answer yet


@dataclass(frozen=True)
class Attempt:
    """A request on its way or left without an answer: its retry takes its chain."""

    turn_id: str
    chain_id: str
    parent: str | None
    fork: bool


_REFS = msgspec.msgpack.Decoder(list[TurnRef])
_REF = msgspec.msgpack.Decoder(TurnRef)
_TIP = msgspec.msgpack.Decoder(Tip)
_ENCODE = msgspec.msgpack.Encoder().encode


def _decode_refs(data: bytes) -> list[TurnRef]:
    """The turns a stored value names (a chain-responses value is one turn)."""
    for decoder in (_REFS, _REF):
        try:
            found = decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        return found if isinstance(found, list) else [found]
    return []


def _decode_tip(data: bytes) -> Tip | None:
    try:
        return _TIP.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = data.decode(errors="replace")
        return Tip(text) if text.startswith("turn_") else None  # written as a bare turn id before tips had state


def new_id(prefix: str) -> str:
    return f"{prefix}_{random_bytes(8).hex()}"


def chain_tag(chain_id: str) -> str:
    """The flow comment's first word: ``~comment TAG`` filters one conversation."""
    return "chain:" + chain_id.rsplit("_", 1)[-1][:8]


def keyed_digest(secret: bytes, digest: str) -> str:
    """A tool result's digest as the record file shows it: keyed with the
    store's secret, so that it compares equal across every proxy of one store
    and nobody without the secret can confirm a guess of a small result."""
    return blake3(b"tool-result\x00" + bytes.fromhex(digest), key=secret).hexdigest(16)


@dataclass
class Echo:
    """Where a request echoes earlier turns that end alike: the turns, how
    far into the request they reach, and where their answer sits in it when
    tool outputs stand between its items (None: the answer ends at ``end``)."""

    refs: list[TurnRef]
    end: int
    positions: list[int] | None = None

    def answer_at(self, ref: TurnRef) -> list[int]:
        return self.positions if self.positions is not None else list(range(self.end - ref.answer_len, self.end))


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
    hashed: blake3  # over the root and every message digest: extended by the answer's, it keys the turn
    before_last: bytes  # the digest of every message but the newest
    responses_key: Callable[[str], bytes]
    attempt: bytes  # names the request: a retry sends the same messages on the same chain
    secret: bytes
    shard: bytes  # leads every key of its credential's index
    conversation_key: bytes | None = None  # where its conversation's newest turn is indexed
    own_chain: str = ""  # the chain it starts if it opens one or forks, named once needed
    previous: TurnRef | None = None
    echo: Echo | None = None
    chain_id: str = ""
    fork: bool = False
    unresolved: list[bytes] = field(default_factory=list)  # index keys memory did not know
    submitted: list[ToolResult] = field(default_factory=list)
    answer: LiftedAnswer | None = None
    changes: list[AuditEntry] = field(default_factory=list)  # the addon's own, on top of the lift's
    restored: bool = False
    continued_upstream: bool = False  # the proxy continued it from state the upstream holds

    def tagged(self, digest: bytes) -> bytes:
        """The index key of ``digest``: in its credential's shard."""
        return self.shard + digest[SHARD_TAG_SIZE:]

    def tip_key(self, chain_id: str) -> bytes:
        return self.shard + chain_id.encode()

    def prefix(self, k: int) -> bytes:
        """The key of the request's first ``k`` messages; the newest two
        come from the one pass ``begin`` made."""
        n = len(self.sequence.items)
        return self.tagged(self.hashed.digest(SEQUENCE_DIGEST_SIZE) if k == n else self.before_last if k == n - 1
                           else self.sequence.digests[k - 1])

    def answered_key(self, answer: list[bytes]) -> bytes:
        """The key of the request's messages and then the answer's: what a
        request that echoes this answer has as a prefix."""
        hasher = self.hashed.copy()
        hasher.update(b"".join(answer))
        return self.tagged(hasher.digest(SEQUENCE_DIGEST_SIZE))

    def new_chain(self) -> str:
        self.own_chain = self.own_chain or new_id("chain")
        return self.own_chain

    def record(self) -> dict[str, Any]:
        """The seed's ``continuation`` record, with this flow's ``turnId``."""
        request, answer, previous = self.request, self.answer, self.previous
        resume: dict[str, Any] | None = None
        if previous is not None or request.previous_response_id or request.conversation_id:
            resume = {
                "protocol": previous.protocol if previous else request.protocol,
                "requestId": previous.flow_id if previous else None,
                "responseId": previous.response_id if previous else request.previous_response_id,
                "previousResponseId": request.previous_response_id,
                "turnId": previous.turn_id if previous else None,
            }
            if request.conversation_id:
                resume["conversationId"] = request.conversation_id  # the anchor: state kept under that id
        submitted = [r.call_id for r in self.submitted]
        pending = list(answer.pending_tool_calls) if answer else []
        followup = previous is not None and previous.paused and not submitted
        upstream_state = bool(request.previous_response_id) or self.continued_upstream
        sticky = "conversation" if request.conversation_id else "request_chain" if upstream_state else \
            "conversation" if previous and not self.fork else "request"
        mode = "tool_outputs" if submitted else "servertool_followup" if followup else \
            "tool_calls" if pending else None
        origin = "tool-loop" if submitted else "servertool-followup" if followup else request.protocol
        continuation: dict[str, Any] = {
            "chainId": self.chain_id,
            "turnId": self.turn_id,
            "previousTurnId": previous.turn_id if previous else None,
            "resumeFrom": resume,
            "stickyScope": sticky,
            "stateOrigin": origin,
            "restored": self.restored,
            "toolContinuation": {
                "mode": mode,
                "pendingToolCallIds": pending,
                "submittedToolCallIds": submitted,
                # The results themselves are prompt content: never in a record.
                "resumeOutputs": [{"callId": r.call_id, "name": r.name, "bytes": r.output_bytes,
                                   "digest": keyed_digest(self.secret, r.digest)} for r in self.submitted],
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
    turns: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # digest -> [TurnRef]
    responses: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # key -> TurnRef
    tips: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # chain id -> Tip
    attempts: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # attempt -> Attempt
    homes: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # turn id -> who answered it
    # turn id -> blake3 over its root and its whole conversation, answer included (kept in memory only)
    contexts: Bounded = field(default_factory=lambda: Bounded(CONTEXTS), repr=False)
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {CHAIN_TURNS: 1_000_000, CHAIN_RESPONSES: 1_000_000, CHAIN_TIPS: 1_000_000}

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self.turns.clear()
        self.responses.clear()
        self.tips.clear()
        self.attempts.clear()
        self.homes.clear()
        self.contexts.clear()
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
        hashed = blake3(root)  # one pass: the request's own digest, the one before its newest message
        hashed.update(b"".join(digests[:-1]))
        before_last = hashed.digest(SEQUENCE_DIGEST_SIZE)
        hashed.update(digests[-1] if digests else b"")

        shard = shard_tag(root)

        def responses_key(response_id: str) -> bytes:
            return shard + blake3(root + b"\x00response\x00" + response_id.encode("utf-8", "surrogatepass"),
                                  key=secret).digest(16)[SHARD_TAG_SIZE:]

        previous_id = (request.previous_response_id or "").encode("utf-8", "surrogatepass")
        attempt = blake3(b"attempt\x00" + hashed.digest(SEQUENCE_DIGEST_SIZE) + b"\x00" + previous_id,
                         key=secret).digest(16)
        turn = Turn(new_id("turn"), flow_id, request.protocol, upstream, root, request, ItemSequence(root, digests),
                    hashed, before_last, responses_key, attempt, secret, shard)
        if request.conversation_id:
            conversation = request.conversation_id.encode("utf-8", "surrogatepass")
            turn.conversation_key = turn.tagged(blake3(root + b"\x00conversation\x00" + conversation,
                                                       key=secret).digest(16))
            turn.own_chain = "chain_" + blake3(root + b"\x00conversation chain\x00" + conversation,
                                               key=secret).hexdigest(8)
        self._continue(turn, {})
        return turn

    def resolve(self, turn: Turn, found: Mapping[bytes, bytes]) -> None:
        """Continue again, now with what the backing store had."""
        self._continue(turn, {k: refs for k, v in found.items() if (refs := _decode_refs(v))})

    @staticmethod
    def table_of(turn: Turn) -> str:
        """Where a turn's unresolved keys live."""
        return CHAIN_RESPONSES if turn.request.previous_response_id or turn.conversation_key else CHAIN_TURNS

    def unknown_tips(self, turn: Turn) -> list[bytes]:
        """The chains the turn may continue whose tips memory does not know (the backing store may)."""
        chains = dict.fromkeys(ref.chain_id for ref in turn.echo.refs) if turn.echo else {}
        return [turn.tip_key(chain) for chain in chains if self.tips.hit(chain) is None]

    def learn_tips(self, turn: Turn, found: Mapping[bytes, bytes]) -> None:
        for key, data in found.items():
            if (tip := _decode_tip(data)) is not None:
                self.tips.put(key[len(turn.shard):].decode(errors="replace"), tip)
        self._decide_chain(turn)

    def _continue(self, turn: Turn, stored: Mapping[bytes, list[TurnRef]]) -> None:
        request, unresolved = turn.request, []
        if turn.conversation_key or request.previous_response_id:
            key = turn.conversation_key or turn.responses_key(request.previous_response_id or "")
            ref = self.responses.hit(key)
            refs = [ref] if ref is not None else stored.get(key)
            if not refs:
                unresolved.append(key)
            turn.echo = Echo(refs, 0, []) if refs else None
        else:
            turn.echo = self._echo(turn, stored, unresolved)
        turn.unresolved = unresolved if not stored else []
        self._decide_chain(turn)

    def _refs(self, key: bytes, stored: Mapping[bytes, list[TurnRef]]) -> list[TurnRef]:
        return self.turns.hit(key) or stored.get(key) or []

    def _echo(self, turn: Turn, stored: Mapping[bytes, list[TurnRef]], unresolved: list[bytes]) -> Echo | None:
        """The deepest earlier turn the request's messages extend (all of them:
        a paused answer is resent as it stands, to let it go on)."""
        direct = None
        for k in range(len(turn.sequence.items), 0, -1):
            if refs := self._refs(key := turn.prefix(k), stored):
                direct = Echo(refs, k)
                break
            unresolved.append(key)
        return self._interleaved(turn, direct.end if direct else 0, stored, unresolved) or direct

    def _interleaved(self, turn: Turn, covered: int, stored: Mapping[bytes, list[TurnRef]],
                     unresolved: list[bytes]) -> Echo | None:
        """The newest answer echoed with tool outputs between its items (a
        client that puts each call's output right after the call), when it
        reaches further into the request than ``covered``. Its items are the
        model's from where an answer can start to the last one; only the
        newest items are read, back to the first the client wrote itself."""
        items = turn.request.items
        if items is None:
            return None
        lowest = max(0, len(turn.sequence.items) - MAX_TAIL)
        last = len(turn.sequence.items) - 1
        while last >= max(lowest, covered) and items.kind(last) != "model":
            last -= 1
        if last < max(lowest, covered):
            return None  # no answer, or one the prefixes already reach past
        models: list[int] = []  # the model's items of the newest run, newest first
        starts: list[tuple[int, list[int]]] = []  # where an answer with outputs between its items can start
        i = last
        while i >= lowest and (kind := items.kind(i)) != "other":
            if kind == "model":
                models.append(i)
                if last - i + 1 != len(models) and (i == 0 or items.kind(i - 1) != "model"):
                    starts.append((i, models[::-1]))
            i -= 1
        keys = map(turn.tagged, _sequence_keys(turn.root, turn.sequence.items, starts[::-1]))
        for (start, positions), key in zip(starts[::-1], keys):
            if refs := self._refs(key, stored):
                return Echo(refs, last + 1, positions)
            unresolved.append(key)
        return None

    def upstream_of(self, turn_id: str | None) -> str | None:
        """The upstream that answered a turn this process has met (read from
        the store when another process or a restart recorded it)."""
        return self.homes.get(turn_id) if turn_id else None

    def _decide_chain(self, turn: Turn) -> None:
        previous = turn.previous = self._choose(turn) if turn.echo else None
        if previous is not None:
            self.homes.put(previous.turn_id, previous.upstream)
        turn.submitted = self._submitted(turn)
        attempt = self.attempts.hit(turn.attempt)
        if turn.conversation_key:
            turn.chain_id, turn.fork = turn.new_chain(), False  # its conversation's, whatever else went on it
        elif attempt is not None and attempt.parent == (previous.turn_id if previous else None):
            turn.chain_id, turn.fork = attempt.chain_id, attempt.fork  # a retry of a request left unanswered
        elif previous is None:
            turn.chain_id, turn.fork = turn.new_chain(), False
        else:
            turn.fork = not self._at_tip(previous, turn)
            turn.chain_id = turn.new_chain() if turn.fork else previous.chain_id

    def _choose(self, turn: Turn) -> TurnRef:
        """Of the turns the request's echo ends like, the one it continues: the
        one whose item ids it echoes, else one still at its chain's tip, else
        the oldest (identical conversations answered in turn go on in turn)."""
        assert turn.echo is not None
        refs, items = turn.echo.refs, turn.request.items
        if len(refs) > 1 and items is not None:
            refs = [r for r in refs if _ids_match(r.answer_ids, items.ids(turn.echo.answer_at(r)))] or refs
        if len(refs) > 1:
            refs = [r for r in refs if self._at_tip(r, turn)] or refs
        return refs[0]

    def _at_tip(self, ref: TurnRef, turn: Turn) -> bool:
        """``ref`` is still its chain's tip, or was until this same request
        claimed it on an attempt still on its way (a retry racing it)."""
        tip = self.tips.hit(ref.chain_id)
        return tip is None or tip.turn_id == ref.turn_id or \
            (tip.open and tip.attempt == turn.attempt and tip.parent == ref.turn_id)

    @staticmethod
    def _submitted(turn: Turn) -> list[ToolResult]:
        """The tool results the request submits: every one that answers a call
        the turn it continues left pending, wherever it stands; what the lift
        alone tells when that is unknown."""
        previous, items, echo = turn.previous, turn.request.items, turn.echo
        if previous is None or not previous.pending or items is None or echo is None:
            return list(turn.request.submitted_tool_results)
        positions = echo.answer_at(previous)
        return items.results(positions[0] if positions else echo.end, frozenset(previous.pending))

    def claim(self, turn: Turn) -> None:
        """The turn is on its way upstream: it is its chain's tip for now, so a
        second request continuing the same turn is a fork, unless it is this
        same request again."""
        parent = turn.previous.turn_id if turn.previous else None
        self._put_tip(turn, Tip(turn.turn_id, parent, turn.attempt, open=True))
        self.attempts.put(turn.attempt, Attempt(turn.turn_id, turn.chain_id, parent, turn.fork))

    def finish(self, turn: Turn, answer: LiftedAnswer | None) -> None:
        """The answer arrived (None: none, or an error). One a client can go on
        from makes the turn continuable; anything else is a dead end that
        gives its chain's tip back. Until it is completed, the same request
        sent again is a retry of it, not a second continuation."""
        turn.answer = answer
        if answer is None or answer.status not in CONTINUABLE:
            self._release(turn)
            return
        attempt = self.attempts.get(turn.attempt)
        if answer.status == "completed" and attempt is not None and attempt.turn_id == turn.turn_id:
            del self.attempts[turn.attempt]
        if turn.conversation_key:  # responses on one conversation all join it: none branches off
            self._put_tip(turn, Tip(turn.turn_id, turn.previous.turn_id if turn.previous else None))
        else:
            self._settle_tip(turn)
        try:
            digests = [blake3(canonical_json(m)).digest(16) for m in answer.messages]
        except (Ambiguous, RecursionError):
            return  # an answer other clients would read differently: nothing continues from it
        ref = TurnRef(turn.turn_id, turn.chain_id, turn.protocol, turn.flow_id, answer.response_id, turn.upstream,
                      len(answer.messages), tuple(answer.ids) if any(answer.ids) else (),
                      tuple(answer.pending_tool_calls), answer.paused)
        self.homes.put(turn.turn_id, turn.upstream)
        keys = [turn.answered_key(digests)] if digests else []
        if (whole := self._whole_context(turn, digests)) is not None and digests:
            keys += [key] if (key := turn.tagged(whole.digest(SEQUENCE_DIGEST_SIZE))) not in keys else []
        for key in keys:
            refs = [r for r in self.turns.get(key, ()) if r.turn_id != turn.turn_id][1 - SAME_ENDING:] + [ref]
            self.turns.put(key, refs)
            self._outbox.append(Write(CHAIN_TURNS, key, _ENCODE(refs), self.config.ttl))
        keys = [turn.responses_key(answer.response_id)] if answer.response_id else []
        for key in keys + ([turn.conversation_key] if turn.conversation_key else []):
            self.responses.put(key, ref)
            self._outbox.append(Write(CHAIN_RESPONSES, key, _ENCODE(ref), self.config.ttl))

    def _whole_context(self, turn: Turn, answer: list[bytes]) -> blake3 | None:
        """The hash of the whole conversation up to the turn's answer, kept
        for the turns continued from it by id: a turn continued by id sends
        only its new items, and a client that resends the whole history
        afterwards (a lost socket, a forgotten response) must still find it.
        None when the turn it continues by id was not met here."""
        if turn.conversation_key:
            return None
        if turn.request.previous_response_id:
            before = self.contexts.hit(turn.previous.turn_id) if turn.previous is not None else None
            if before is None:
                return None
            whole = before.copy()
            whole.update(b"".join(turn.sequence.items))
        else:
            whole = turn.hashed.copy()
        whole.update(b"".join(answer))
        self.contexts.put(turn.turn_id, whole)
        return whole

    def _settle_tip(self, turn: Turn) -> None:
        """A continuable answer holds its chain's tip, unless the chain went on
        without it meanwhile (the same request sent twice, the other answered
        first): then it branches off after all."""
        parent = turn.previous.turn_id if turn.previous else None
        tip = self.tips.hit(turn.chain_id)
        if tip is not None and tip.turn_id not in (turn.turn_id, parent) and not tip.open:
            turn.chain_id, turn.fork = new_id("chain"), turn.previous is not None
        self._put_tip(turn, Tip(turn.turn_id, parent, turn.attempt))

    def _release(self, turn: Turn) -> None:
        """A dead end gives its chain's tip back to the turn it continued."""
        tip = self.tips.hit(turn.chain_id)
        if tip is None or tip.turn_id != turn.turn_id:
            return
        if turn.previous is not None and not turn.fork:
            self._put_tip(turn, Tip(turn.previous.turn_id))
        else:  # it opened the chain: nothing on it to continue
            self.tips.pop(turn.chain_id, None)
            self._outbox.append(Write(CHAIN_TIPS, turn.tip_key(turn.chain_id), None))

    def _put_tip(self, turn: Turn, tip: Tip) -> None:
        self.tips.put(turn.chain_id, tip)
        self._outbox.append(Write(CHAIN_TIPS, turn.tip_key(turn.chain_id), _ENCODE(tip), self.config.ttl))


def _sequence_keys(root: bytes, digests: list[bytes], answers: list[tuple[int, list[int]]]) -> list[bytes]:
    """The index keys of each ``(start, positions)`` answer, as ``finish``
    makes them: the messages before ``start``, then the answer's. ``answers``
    in order of start: one pass over the request."""
    hasher, hashed, keys = blake3(root), 0, []
    for start, positions in answers:
        hasher.update(b"".join(digests[hashed:start]))
        hashed = start
        key = hasher.copy()
        key.update(b"".join(digests[p] for p in positions))
        keys.append(key.digest(SEQUENCE_DIGEST_SIZE))
    return keys


def _ids_match(answer_ids: tuple[str | None, ...], echoed: list[str | None]) -> bool:
    """The request echoes this answer's own item ids (at least one, none other)."""
    pairs = [(a, e) for a, e in zip(answer_ids, echoed) if a is not None and e is not None]
    return bool(pairs) and all(a == e for a, e in pairs)


def audit_entry(field_name: str, disposition: str, reason: str, protocol: str,
                target: str | None = None) -> AuditEntry:
    """An entry for a change the addon itself made (source: "proxy")."""
    return AuditEntry(field_name, disposition, reason, protocol, target, "proxy")  # type: ignore[arg-type]
