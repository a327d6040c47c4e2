"""What the addon has learned about each upstream as seen by one credential
(a scope, ``Tenancy.scope``): one view every capability reads and writes, so
that what one learns holds for all the others at once.

Marks: ``reads_back`` (the upstream returned a stored response when asked
for it by id: the proof every continuation needs, since an answer's
``store: true`` can be an echo of the request), ``unsupported`` (does not
store responses), ``no_forced_store`` (refuses a forced ``store: true``),
``honours_previous`` (answered a ``previous_response_id`` with its chain: it
echoed the id, or billed more input than it was sent), ``refuses_previous``
(refused or ignored a ``previous_response_id``), ``has_conversations`` (it
answered the Conversations API as the API does), ``lacks_conversations``
(it answered a Conversations endpoint 404/405, refused the ``conversation``
field or echoed another conversation, or none, in its place), ``serves_responses`` (of a host, its scope made without
a credential: it answered a Responses request, so its ``/conversations`` are
the Responses API's), ``refuses_websocket`` (its sockets are no use:
it refused the WebSocket upgrade or never answered it, closed sockets
before their first event, or a socket refused or did not continue what it
was asked to), ``lacks_websocket`` (it refused the upgrade with a 4xx: it
has no WebSocket mode; only this one lets forward mode force ``store`` on a
``store: false`` turn, never a verdict drawn from faults), ``has_compaction`` / ``lacks_compaction`` (it answered
``/responses/compact`` or a compaction trigger as the API does / answered the
endpoint 404/405, refused a compaction item or trigger as unknown, or answered
a trigger with no compaction item: see ``compaction/``), ``native_background`` (it answered a
``background: true`` create in its own background mode) and ``lacks_background`` (it refused the field or
answered such a create synchronously: the proxy runs its background responses), ``keeps_items`` and
``drops_items`` (of a scope and an item kind, ``kind_scope``: a continuation whose chain held that kind of
item was, or was not, fed to the model as the same history sent whole; see ``chain_fell_short`` and
``same_context``). Each expires (a verdict drawn from faults sooner than the
time to live: see ``mark``); setting one queues the write that shares it
with every process using the store.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from .bounded import Bounded
from .settings import Config
from .state.outbox import Outbox, Write
from .tenancy import Tenancy

MARKS = "marks"  # kind + scope -> when it expires

MarkKind = Literal["reads_back", "unsupported", "no_forced_store", "honours_previous", "refuses_previous",
                   "has_conversations", "lacks_conversations", "refuses_websocket", "serves_responses",
                   "lacks_websocket", "has_compaction", "lacks_compaction", "native_background", "lacks_background",
                   "keeps_items", "drops_items"]
MARK_KINDS = frozenset(MarkKind.__args__)  # type: ignore[attr-defined]

# Answers that say "not now", not "not this": the client's SDK retries them and
# the same answer would have come without the addon, so they teach nothing.
TRANSIENT_STATUSES = frozenset({408, 425, 429})
# Answers that say the upstream (or a gateway before it) is unavailable, whatever the body: no retry of ours with
# another body can help there (the router fails over, the client's SDK retries).
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})


# Input that costs tokens without bytes on the wire: a file or an image by reference.
_TOKENS_WITHOUT_BYTES = (b'"input_image"', b'"input_file"', b'"file_id"', b'"input_audio"', b'"file_url"')
# Tokens a server may add around what it was sent: a chat template's per-message markers, tool formatting.
_TEMPLATE_TOKENS, _TEMPLATE_TOKENS_PER_ITEM = 64, 16
EchoVerdict = Literal["honoured", "ignored", "undecided"]
DROPS_PERIOD = 24 * 3600.0  # a lossy chain's verdict holds a day, then one continuation is compared again


def echo_verdict(sent_id: str, echoed: object, answer: Mapping, sent: bytes, items_sent: int,
                 honoured_before: bool) -> EchoVerdict:
    """Whether the answer to a request that carried ``previous_response_id``
    was made from its chain, judged from what the upstream cannot fake.

    The id echoed back decides when it is the one sent, or when it cannot be
    one (null, empty, a chat completion's id: a gateway that bridged the
    request and dropped the field). Gateways re-encode the ids they hand out
    (LiteLLM echoes the upstream's raw id), so another spelling proves nothing
    by itself: the upstream honoured the field if it billed more input tokens
    than the bytes ``sent`` could make (a token is at least one byte), or if
    it already showed it does (``honoured_before``)."""
    if echoed == sent_id:
        return "honoured"
    if not isinstance(echoed, str) or not echoed or echoed.startswith("chatcmpl"):
        return "ignored"
    if _billed_more_than_sent(answer, sent, items_sent) or honoured_before:
        return "honoured"
    return "undecided"


def _billed_more_than_sent(answer: Mapping, sent: bytes, items_sent: int) -> bool:
    usage = answer.get("usage")
    tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) \
            or any(marker in sent for marker in _TOKENS_WITHOUT_BYTES):
        return False
    return tokens > len(sent) + _TEMPLATE_TOKENS + _TEMPLATE_TOKENS_PER_ITEM * items_sent


def names_store(refusal: bytes) -> bool:
    """Whether an error answer says it is about the ``store`` field: its
    ``param`` is ``store``, or its message or code names it (OpenAI's
    zero-data-retention refusal: "Store must be false for this organization",
    ``param: "store"``)."""
    try:
        error = json.loads(refusal).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    if error.get("param") == "store":
        return True
    said = " ".join(str(error.get(key) or "") for key in ("message", "code"))
    return re.search(r"\bstore\b", said, re.IGNORECASE) is not None


@dataclass(frozen=True)
class Usage:
    """An answer's token counts: what the model was fed, what it wrote, and
    how much of that was reasoning no server feeds back."""

    input: int
    output: int
    reasoning: int


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(answer: Mapping) -> Usage | None:
    """``usage`` of a Responses answer, or None where it is absent or odd."""
    usage = answer.get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("output_tokens_details")
    reasoning = _count(details.get("reasoning_tokens", 0)) if isinstance(details, Mapping) else 0
    taken, given = _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    if taken is None or given is None or reasoning is None:
        return None
    return Usage(taken, given, min(reasoning, given))


# What a faithful server may bill less than its chain holds: the end-of-turn marker an answer's output counts and
# its next context renders otherwise, per output item, and a little for rounding.
_CHAIN_SLACK, _CHAIN_SLACK_PER_OUTPUT_ITEM = 2, 2
# Two runs of one context billed this far apart are the same context (a server counting in rounded units).
SAME_CONTEXT_SLACK = 2


def chain_fell_short(parent: Usage, answer: Usage, parent_output_items: int) -> bool:
    """Whether a continuation's answer was fed less than its chain holds: the
    parent's input and its output (less the reasoning tokens, which OpenAI
    does not feed back) are in every continued context, whatever the new items
    add. Only a shortfall shows: the new items' tokens are unknown."""
    floor = parent.input + parent.output - parent.reasoning
    return answer.input < floor - _CHAIN_SLACK - _CHAIN_SLACK_PER_OUTPUT_ITEM * parent_output_items


def same_context(continued: Usage, whole: Usage) -> bool:
    """Whether a continuation was fed what the same turn sent whole was."""
    return abs(continued.input - whole.input) <= SAME_CONTEXT_SLACK


# Item kinds every storing upstream seen so far keeps (its text turns): the shortfall check watches them, but a
# continuation is not held to be compared for them. Every other kind is compared once per upstream + credential.
PLAIN_KINDS = frozenset({"message:user", "message:assistant"})


def item_kind(item_type: object, role: object) -> str:
    """The kind a stored chain may keep or drop: an item's type, a message's
    role with it (an item with a role and no type is a message)."""
    kind = item_type if isinstance(item_type, str) else "message" if isinstance(role, str) else "?"
    return f"{kind}:{role}" if kind == "message" and isinstance(role, str) else kind


class _Kind(msgspec.Struct):
    type: object = None
    role: object = None


_KIND = msgspec.json.Decoder(_Kind)


def item_kinds(raw_items: Iterable[bytes]) -> list[str]:
    """Each raw item's kind (``item_kind``; ``?`` for one that does not read)."""
    kinds = []
    for raw in raw_items:
        try:
            probe = _KIND.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            kinds.append("?")
            continue
        kinds.append(item_kind(probe.type, probe.role))
    return kinds


def kind_scope(scope: str, kind: str) -> str:
    """The scope of a verdict about one item kind."""
    return f"{scope}\x00{kind}"


def _mark_key(kind: MarkKind, scope: str) -> bytes:
    return f"{kind}\x00{scope}".encode()


class Upstreams:
    tables = {MARKS: 10_000}
    spread = frozenset(tables)  # keyed by kind and scope: the store's bounds weigh the table whole
    # Marks held in memory, least recently used out first (about a thousand credentials' worth, as the scopes
    # ``Tenancy`` keeps): rotating tokens name new scopes without end. One pushed out is still in the store:
    # the proofs read a scope's there on demand, and the periodic scan brings back what fits.
    in_memory = 4096

    def __init__(self, config: Config, tenancy: Tenancy) -> None:
        self.config = config
        self._expires = Bounded(self.in_memory)  # (kind, scope) -> when it expires
        self._outbox = Outbox()
        tenancy.on_new_secret(self._expires.clear)  # scopes are named anew: the marks are unreachable

    def has(self, kind: MarkKind, scope: str) -> bool:
        expires = self._expires.hit((kind, scope))
        if expires is None:
            return False
        if expires <= self.config.clock():
            del self._expires[(kind, scope)]
            return False
        return True

    def mark(self, kind: MarkKind, scope: str, period: float | None = None) -> bool:
        """Set a mark for ``period`` seconds (the time to live of everything
        remembered when None); False when it was already set."""
        if self.has(kind, scope):
            return False
        ttl = min(period, self.config.ttl) if period is not None else self.config.ttl
        expires = self.config.clock() + ttl
        self._expires.put((kind, scope), expires)
        self._outbox.append(Write(MARKS, _mark_key(kind, scope), struct.pack("!d", expires), ttl))
        return True

    def load(self, records: Mapping[bytes, bytes], *, in_use: bool = False) -> None:
        """Take in the marks other processes set (a scan of the store; with
        ``in_use``, the marks of a scope a request asks about). A mark of a
        scope in use here (asked about, or one memory holds a mark of) counts
        as used; any other only fills room that is free, so that a scan of a
        store larger than memory never pushes out marks in use for marks
        nobody here asked about."""
        now = self.config.clock()
        used = {scope for _, scope in self._expires}
        for key, value in records.items():
            kind, _, scope = key.decode(errors="replace").partition("\x00")
            if kind not in MARK_KINDS or len(value) != 8:
                continue
            expires = struct.unpack("!d", value)[0]
            known = self._expires.get((kind, scope))
            if expires <= now or (known is not None and known >= expires):
                continue
            if in_use or known is not None or scope in used:
                self._expires.put((kind, scope), expires)
            elif len(self._expires) < self._expires.limit:
                self._expires[(kind, scope)] = expires
                self._expires.move_to_end((kind, scope), last=False)

    def continuable(self, scope: str) -> bool:
        """Whether a ``previous_response_id`` may be sent to this upstream +
        credential: it proved it reads stored responses back, and nothing
        since showed it does not store, refuses or ignores the field."""
        return self.has("reads_back", scope) and not self.cannot_continue(scope)

    def cannot_continue(self, scope: str) -> bool:
        """Whether this upstream + credential showed it cannot continue a chain."""
        return self.has("unsupported", scope) or self.has("refuses_previous", scope)

    def drops(self, scope: str, kind: str) -> bool:
        """Whether this upstream + credential's stored chain lost ``kind`` items."""
        return self.has("drops_items", kind_scope(scope, kind))

    def drops_any(self, scope: str) -> bool:
        """Whether this upstream + credential's chain was found to drop any kind."""
        now = self.config.clock()
        return any(kind == "drops_items" and marked.startswith(scope + "\x00") and expires > now
                   for (kind, marked), expires in self._expires.items())

    def unverified(self, scope: str, kinds: Iterable[str]) -> frozenset[str]:
        """The kinds of ``kinds`` a continuation must still be compared for."""
        return frozenset(k for k in kinds if k not in PLAIN_KINDS and not self.has("keeps_items", kind_scope(scope, k)))

    def judge_items(self, scope: str, kinds: Iterable[str], kept: bool) -> list[str]:
        """Mark ``kinds`` kept (for the time to live) or dropped (for
        ``DROPS_PERIOD``: a server is upgraded, and a check costs one turn sent
        twice); the kinds newly marked."""
        if kept:
            return [k for k in kinds if self.mark("keeps_items", kind_scope(scope, k))]
        return [k for k in kinds if self.mark("drops_items", kind_scope(scope, k), DROPS_PERIOD)]

    def unproven(self, scope: str) -> bool:
        """Neither proved to read stored responses back nor known not to store."""
        return not self.has("reads_back", scope) and not self.has("unsupported", scope)

    def proof_keys(self, scope: str) -> list[bytes]:
        """Where the store keeps this scope's proof either way (another
        replica may have proved it a moment ago)."""
        return [_mark_key("reads_back", scope), _mark_key("unsupported", scope)]

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self._expires.clear()
        self._outbox.clear()
