"""The continuation engine's planner: from a client's full-history request
to a decision, and from an answer to what the prefix store learns, whichever
transport (HTTP, an upstream WebSocket) carries them. Pure: no mitmproxy, no
I/O.

The one invariant everything here serves: for every request, the upstream's
context (its stored chain + the input we send) equals the client's input. A
continuation is planned only from an entry that an upstream answer proved
stored, and the items sent are the client's own items beyond that entry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from blake3 import blake3

from ..bounded import Bounded
from ..counters import Counters
from ..items import Ambiguous, ItemSequence, is_compaction_trigger, item_digest
from ..request_reader import Reader, Reading, Request, Skip, splice
from ..settings import Config, Settings
from ..state.outbox import Outbox, Write
from ..tenancy import Tenancy
from ..upstreams import (
    TRANSIENT_STATUSES,
    UNAVAILABLE_STATUSES,
    Upstreams,
    Usage,
    chain_fell_short,
    echo_verdict,
    item_kinds,
    kind_scope,
    names_store,
    usage_of,
)
from .prefixes import ENTRIES, REFS, Match, PrefixStore, StoredEntry, encode_entry

Action = Literal["pass", "full", "continue"]
# How long a 4xx to a forced store that does not say it is about ``store`` keeps store unforced (then one
# forced store is tried again: one more refusal, retried invisibly, if it still holds).
UNNAMED_STORE_REFUSAL_S = 3600.0


@dataclass
class Plan:
    action: Action
    reason: str
    upstream: str = ""
    model: str = ""
    scope: str = ""  # upstream + credential, hashed: what "unsupported" marks apply to
    scope_label: str = ""  # the scope for logs: host and hash tags, never a path or credential
    body: bytes | None = None  # the body to send upstream when it differs
    previous_response_id: str | None = None
    parent: bytes | None = None  # digest of the entry continued from
    sequence: ItemSequence | None = None  # rolling digests of the client's whole input
    items_total: int = 0
    items_sent: int = 0
    asked_store: bool = False  # the body sent upstream says store: true
    store_unsaid: bool = False  # the body sent upstream does not say store (the API's default is to store)
    forced_store: bool = False  # we set store: true where the client had not
    client_bytes: int = 0
    client_previous_response_id: str | None = None  # the client's own continuation, watched for its echo
    # A continuation the upstream + credential has not yet shown it honours, in store emulation's always mode:
    # its answer is held and checked, and the client's full body goes again unless it was made from the chain.
    checked: bool = False
    # Item kinds of the chain continued from that the upstream + credential has not yet shown it feeds back: the
    # held answer is compared with the same turn sent whole (forward mode's check) before the client has it.
    verify: frozenset[str] = frozenset()
    chain_kinds: frozenset[str] = frozenset()  # the item kinds of a continued request, its chain's and new
    context: bytes = b""  # what the count of every turn holds besides its items: instructions, tools
    draft: _Draft | None = field(default=None, repr=False)  # what improving the plan from the store needs
    root: bytes = field(default=b"", repr=False)  # the namespace's root digest
    counted: bool = field(default=True, repr=False)  # in the counters (the transport that carries it counts)

    @property
    def changed(self) -> bool:
        return self.body is not None

    @property
    def tracked(self) -> bool:
        return self.action != "pass"

    @property
    def watched(self) -> bool:
        """An answer worth reading: a tracked request's, or a client's own
        continuation's (its echo proves the upstream honours the field)."""
        return self.tracked or self.client_previous_response_id is not None


@dataclass(frozen=True)
class _Draft:
    """A full or continued plan's parsed request, kept so that a deeper stored
    prefix read from the backing store can still improve it."""

    request_body: bytes
    fields: dict[str, msgspec.Raw]
    raw_items: list[bytes] | None
    force_store: bool
    memory_depth: int  # the length continued from out of memory, 0 for none
    unresolved: list[bytes]  # keys of item references memory could not resolve
    checkable: bool = True  # its answer may be held to be checked (see Plan.checked)


@dataclass(frozen=True)
class Outcome:
    """What one answer taught the store, for logs, counters and the flow."""

    kind: Literal["advanced", "dropped", "unsupported", "ignored", "unverified", "retry", "transient", "pending",
                  "lossy"]
    detail: str
    response_id: str | None = None


_ABSENT = object()
# Fields whose tokens every turn is billed for besides its items: a continuation's count is comparable with its
# parent's only when they are the same (and "truncation": "auto" lets a faithful server drop items).
_CONTEXT_FIELDS = ("instructions", "tools", "truncation")


@dataclass(frozen=True)
class _Counted:
    """An answer's usage, kept so that a continuation of it can be checked."""

    usage: Usage
    output_items: int
    context: bytes


@dataclass
class Planner:
    """The engine's decisions, for every transport; standalone (tests,
    benchmarks) it makes its own shared pieces, in the proxy it is handed the
    ones every addon shares."""

    config: Config = field(default_factory=Config)
    counters: Counters = field(default_factory=Counters)
    tenancy: Tenancy = field(default_factory=Tenancy)
    upstreams: Upstreams | None = None
    reader: Reader | None = None
    store: PrefixStore = field(init=False)
    # Output items by id, per namespace: an item_reference equals the item it names.
    refs: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)
    # Background responses still running: their plans wait for the poll that finds them finished.
    background: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)
    # Answers' usage by response id (this process's memory: a continuation of one it lacks is not checked).
    usages: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {ENTRIES: 1_000_000, REFS: 1_000_000}
    spread = frozenset(tables)  # keyed by digests, whoever's: the store's bounds weigh each table whole

    def __post_init__(self) -> None:
        self.store = PrefixStore(self.config.settings.max_chains)
        self.upstreams = self.upstreams or Upstreams(self.config, self.tenancy)
        self.reader = self.reader or Reader(self.config, self.counters, self.tenancy)
        self.config.on_change(self._reconfigure)
        self.tenancy.on_new_secret(self._forget_learned)

    @property
    def settings(self) -> Settings:
        return self.config.settings

    def _reconfigure(self, old: Settings, new: Settings) -> None:
        if new.max_chains != old.max_chains:
            self.store = PrefixStore(new.max_chains)
        self.reader.forget_last()

    def _forget_learned(self) -> None:
        """What was learned under another secret is unreachable: dropped."""
        self.store.clear()
        self.refs.clear()

    def take_writes(self) -> list[Write]:
        """What must reach the backing store, oldest first (the outbox empties)."""
        return self._outbox.take()

    def namespace(self, upstream: str, model: str, credential: bytes) -> bytes:
        """The root digest that every stored sequence of one namespace hangs from.

        A namespace is upstream + model + credential. It deliberately leaves out
        ``prompt_cache_key``, ``instructions`` and ``tools``: matching is by item
        content, so two requests whose items agree are the same conversation up
        to that point whatever they are called; instructions and tools are resent
        with every request and are not part of the stored context (the API's rule);
        and clients vary ``prompt_cache_key`` freely (openai-agents sends a new
        one on every ``Runner.run``), which would make every turn start over.
        The credential enters only through a keyed hash under the store's secret.
        """
        h = blake3(key=self.tenancy.secret)
        h.update(f"{upstream}\x00{model}\x00".encode("utf-8", "surrogatepass"))
        h.update(credential)
        return h.digest()

    def plan(self, request: Request, *, rewrite: bool = True, checkable: bool = True,
             websocket_mode: bool = False, count: bool = True, keep_store_false: bool = False,
             stored_chain: tuple[str, int] | None = None) -> Plan:
        """Decide what to send. With ``rewrite=False`` (our own retry of a
        client's original body) nothing is changed, only tracked. With
        ``checkable=False`` (an answer that must stream as it comes) a
        continuation that would have to be checked goes full instead.
        ``websocket_mode``: whether the WebSocket bridge runs for the request's
        proxy mode (the glue says; it does not in ``--mode upstream:``).
        ``count=False``: another transport counts what it sends (the bridge).
        ``keep_store_false``: a client that said ``store: false`` on its own
        WebSocket (served by the proxy) is never forced to store, as the mode
        stores nothing. ``stored_chain``: (response id, new items) of a chain store emulation
        expanded that the upstream stores: continued from unless memory holds
        a deeper prefix."""
        reading = self.reader.read(request, count=rewrite and count)
        if isinstance(reading, Skip):
            return Plan("pass", reading.reason, reading.upstream, reading.model)
        s = self.settings
        upstream, model, scope, label = reading.upstream, reading.model, reading.scope, reading.label
        body, client_store = reading.fields, reading.client_store
        raw_items, digests = reading.raw_items, reading.digests
        credential = reading.credential
        if raw_items and any(map(is_compaction_trigger, raw_items)):
            # It must stay the last item of what it compacts, never stored (a forced store is refused by the
            # ChatGPT backend), never split into previous_response_id + a tail; its answer starts a new window
            # (and, made by the proxy where the upstream lacks compaction, says nothing of the upstream's chains).
            return Plan("pass", "a compaction trigger", upstream, model, scope, label)
        if reading.previous is not None:
            plan = Plan("pass", "client sent previous_response_id", upstream, model, scope, label)
            if isinstance(reading.previous, str):
                plan.client_previous_response_id = reading.previous
            return plan
        if not digests:
            return Plan("pass", "input has no items", upstream, model)
        if client_store is False and (not s.force_store or keep_store_false):
            return Plan("pass", "client sent store:false", upstream, model)
        now = self.config.clock()
        if self.upstreams.has("unsupported", scope):
            return Plan("pass", "upstream does not store responses", upstream, model, scope, label)
        if self.upstreams.has("refuses_previous", scope):
            return Plan("pass", "upstream refuses or ignores previous_response_id", upstream, model, scope, label)

        root = self.namespace(upstream, model, credential)
        unresolved = self._resolve_references(root, digests)
        sequence = ItemSequence(root, digests)
        prefixes = sequence.digests
        force = (
            rewrite
            and s.force_store
            and client_store is not True
            and not self.upstreams.has("no_forced_store", scope)
            # the upstream's WebSocket mode may serve the deltas without storage: never force it to store
            # unless it refused the upgrade (it has no WebSocket mode); a verdict drawn from faults (sockets
            # closed, a refused or unechoed continuation, an upgrade never answered) is no licence to store
            # what the client asked not to: it lasts an hour, and may be a fault of that hour
            and not (s.upstream_websocket == "auto" and websocket_mode
                     and not self.upstreams.has("lacks_websocket", scope))
        )
        asked_store = client_store is True or force
        plan = Plan(
            "full",
            "no stored prefix",
            upstream,
            model,
            scope,
            label,
            sequence=sequence,
            items_total=len(digests),
            items_sent=len(digests),
            asked_store=asked_store,
            store_unsaid=client_store is None and not force and rewrite,  # not our retry of the client's body
            forced_store=force,
            client_bytes=len(request.body),
            root=root,
            counted=count,
        )
        if not asked_store:
            plan.reason = "full; the request does not ask to store"
        if not rewrite:
            return plan
        plan.context = blake3(b"\x00".join(bytes(body[name]) if name in body else b"-" for name in _CONTEXT_FIELDS),
                              key=self.tenancy.secret).digest(16)
        dropped = self._dropped_kind(scope, raw_items)
        match = self.store.deepest(prefixes, now) if dropped is None else None
        if stored_chain is not None and dropped is None and 0 < stored_chain[1] < len(digests) \
                and (match is None or match.length < len(digests) - stored_chain[1]):
            length = len(digests) - stored_chain[1]
            match = Match(prefixes[length - 1], stored_chain[0], length)
        if dropped is not None:
            plan.reason = f"full; the upstream's stored chain drops or reshapes {dropped} items"
        if match is not None and not self.upstreams.has("reads_back", scope):
            match, plan.reason = None, "full; the upstream has not yet read a stored response back"
        plan.draft = _Draft(request.body, body, raw_items, force, match.length if match else 0, unresolved, checkable)
        self._shape(plan, match)
        self._count(plan)
        return plan

    def _dropped_kind(self, scope: str, raw_items: list[bytes] | None) -> str | None:
        """An item kind of the request that the upstream's stored chain was
        found to drop or feed otherwise than sent whole: such a conversation is
        never continued (an item of that kind in the chain is lost; sent as a
        new item after it, vLLM renders a function call apart from the
        assistant message before it)."""
        if raw_items is None or not self.upstreams.drops_any(scope):
            return None
        return next((kind for kind in item_kinds(raw_items) if self.upstreams.drops(scope, kind)), None)

    def _ref_key(self, root: bytes, item_id: str) -> bytes:
        return blake3(root + b"\x00ref\x00" + item_id.encode("utf-8", "surrogatepass"),
                      key=self.tenancy.secret).digest(16)

    def _resolve_references(self, root: bytes, digests: list[bytes]) -> list[bytes]:
        """Give each item reference the digest of the output item it names
        (learned from this namespace's answers); the keys of those memory
        does not know (the backing store may)."""
        unresolved = []
        references = self.reader.digests.references
        for i, digest in enumerate(digests):
            item_id = references.get(digest)
            if item_id is not None:
                key = self._ref_key(root, item_id)
                named = self.refs.hit(key)
                if named is not None:
                    digests[i] = named
                else:
                    unresolved.append(key)
        return unresolved

    def unresolved_references(self, plan: Plan) -> list[bytes]:
        return plan.draft.unresolved if plan.draft is not None else []

    def learn_references(self, found: Mapping[bytes, bytes]) -> None:
        """References the backing store resolved: plan the request again."""
        for key, digest in found.items():
            if len(digest) == 16:
                self.refs.put(key, digest)

    def discard(self, plan: Plan) -> None:
        """A plan that will be made again (its counts are taken back)."""
        if plan.draft is not None and plan.counted:
            self._uncount(plan)
            self.counters.requests -= 1

    def _shape(self, plan: Plan, match: Match | None) -> None:
        """Write the plan's body: continued from ``match``, or full."""
        draft = plan.draft
        assert draft is not None
        changes: dict[str, bytes] = {}
        checked = self.settings.emulate == "always" and not self.upstreams.has("honours_previous", plan.scope)
        if match is not None and checked and not draft.checkable:
            match, plan.reason = None, "full; a continuation to check, of an answer that cannot be held"
        if match is not None:
            assert draft.raw_items is not None  # a string input is one item and never extends anything
            plan.chain_kinds = frozenset(item_kinds(draft.raw_items))  # the new items too: how they join the chain
            plan.verify = self.upstreams.unverified(plan.scope, plan.chain_kinds)
            if plan.verify and not draft.checkable:
                match, plan.reason = None, "full; a continuation to compare, of an answer that cannot be held"
                plan.chain_kinds = plan.verify = frozenset()
        if match is not None:
            assert draft.raw_items is not None
            changes["input"] = b"[" + b",".join(draft.raw_items[match.length :]) + b"]"
            changes["previous_response_id"] = json.dumps(match.response_id).encode()
            plan.action = "continue"
            plan.reason = f"extends {match.response_id}"
            plan.previous_response_id = match.response_id
            plan.parent = match.digest
            plan.items_sent = plan.items_total - match.length
            plan.checked = checked or bool(plan.verify)
        if draft.force_store:
            changes["store"] = b"true"
        plan.body = splice(draft.request_body, draft.fields, changes) if changes else None

    def lookups(self, plan: Plan) -> list[bytes]:
        """Entries the backing store may hold that would continue ``plan``
        from deeper than memory can: every prefix deeper than memory's match
        (one round trip). Empty when memory already has the deepest possible."""
        if plan.draft is None or plan.draft.raw_items is None or plan.sequence is None \
                or not self.upstreams.has("reads_back", plan.scope):
            return []
        prefixes = plan.sequence.digests
        return prefixes[plan.draft.memory_depth : len(prefixes) - 1]

    def improve(self, plan: Plan, found: Mapping[bytes, StoredEntry]) -> None:
        """Continue ``plan`` from the deepest entry the backing store had
        (another process learned it, or this one before a restart)."""
        if not found or plan.sequence is None or not self.upstreams.has("reads_back", plan.scope):
            return
        now, prefixes = self.config.clock(), plan.sequence.digests
        if self._dropped_kind(plan.scope, plan.draft.raw_items if plan.draft else None) is not None:
            return
        for k in range(len(prefixes) - 1, 0, -1):
            entry = found.get(prefixes[k - 1])
            if entry is None or entry.length != k or entry.scope != plan.scope or entry.expires <= now:
                continue
            if plan.parent is not None and k <= (plan.draft.memory_depth if plan.draft else 0):
                return  # memory's match is as deep
            self.store.remember(prefixes[k - 1], k, entry.response_id, None, entry.scope, entry.expires)
            self._uncount(plan)
            self._shape(plan, Match(prefixes[k - 1], entry.response_id, k))
            self._count(plan)
            return

    def _count(self, plan: Plan, sign: int = 1) -> None:
        if not plan.counted:
            return
        c = self.counters
        if plan.action == "continue":
            c.continued += sign
            c.delta_items += sign * plan.items_sent
        else:
            c.full_items += sign * plan.items_sent
        if plan.body is not None:
            c.bytes_saved += sign * (plan.client_bytes - len(plan.body))

    def _uncount(self, plan: Plan) -> None:
        self._count(plan, -1)

    def carried(self, plan: Plan, previous_response_id: str | None, items_sent: int, sent: bytes | None) -> None:
        """What another transport sent for ``plan``, which may differ from
        the plan (the WebSocket bridge continues from a socket's own memory,
        or sends the whole history after a refusal): its answer is then
        learned from as if this had been the plan. ``sent``: the bytes that
        carried a continuation (an echo's bill is judged against them)."""
        if previous_response_id is None:
            plan.action, plan.previous_response_id, plan.parent, plan.body = "full", None, None, None
        elif previous_response_id != plan.previous_response_id:
            assert plan.sequence is not None
            length = plan.items_total - items_sent
            plan.action, plan.previous_response_id, plan.body = "continue", previous_response_id, sent
            plan.parent = plan.sequence.digests[length - 1] if 0 < length <= len(plan.sequence.digests) else None
        else:
            plan.body = sent
        plan.items_sent = items_sent

    def settle(self, plan: Plan, status_code: int, response: Any, *, chain_read: bool = False) -> Outcome:
        """Learn from the upstream's answer to a planned request.

        ``response`` is the answer's response object (from the JSON body or the
        SSE terminal event), or None when there was none to read.
        ``chain_read``: a listing of this answer's input items showed the
        upstream made it from the chain, which an echo could not show.
        """
        if status_code in TRANSIENT_STATUSES:
            return Outcome("transient", f"upstream answered {status_code}; nothing learned")
        if not plan.tracked:
            return self._observe(plan, status_code, response)
        if status_code >= 400:
            if status_code < 500:
                self._forget_branch(plan)  # a refusal: the upstream lost the chain (or never had it)
            else:
                self._forget_parent(plan)
            if plan.changed and status_code not in UNAVAILABLE_STATUSES:  # a 500 too: the change may be why
                return Outcome("retry", f"upstream answered {status_code} to a changed request")
            return Outcome("dropped", f"upstream answered {status_code}")
        if not isinstance(response, dict):
            self._forget_parent(plan)
            return Outcome("dropped", "no response object in the answer")
        rid = response.get("id")
        status = response.get("status")
        echoed = response.get("previous_response_id", _ABSENT)
        if plan.action == "continue" and echoed is not _ABSENT:
            assert plan.body is not None and plan.previous_response_id is not None
            verdict = echo_verdict(plan.previous_response_id, echoed, response, plan.body, plan.items_sent,
                                   self.upstreams.has("honours_previous", plan.scope))
            if verdict == "ignored":
                self._mark_unsupported(plan.scope)
                return Outcome("unsupported", "upstream ignored previous_response_id", rid)
            if verdict == "undecided":
                return Outcome("unverified", "the answer echoes previous_response_id in another spelling: nothing "
                               "is built on it until the upstream shows it read the chain", rid)
            self.upstreams.mark("honours_previous", plan.scope)
        if status in ("queued", "in_progress") and response.get("background") is True and isinstance(rid, str):
            self.background.put(rid, plan)
            return Outcome("pending", "a background response: learned from when a poll finds it finished", rid)
        if status != "completed" or not isinstance(rid, str) or not rid:
            self._forget_parent(plan)
            return Outcome("dropped", f"response status {status!r}", rid if isinstance(rid, str) else None)
        if plan.action == "continue" and echoed is _ABSENT and not chain_read:
            # An upstream that ignores the field and echoes nothing looks the same: its input items tell.
            if self.upstreams.has("honours_previous", plan.scope):
                return Outcome("ignored", "the answer does not echo previous_response_id: it proves nothing", rid)
            return Outcome("unverified", "the answer does not echo previous_response_id: nothing is built on it "
                           "until the upstream shows it read the chain", rid)
        usage = usage_of(response)
        if plan.action == "continue" and self._fell_short(plan, usage):
            return Outcome("lossy", "the answer was fed less than its chain holds: the upstream's stored chain drops "
                           f"items ({', '.join(sorted(plan.chain_kinds)) or 'of some kind'})", rid)
        stored = response.get("store")
        if not isinstance(stored, bool):
            # An answer that does not say (agentic-api's) is taken as asked, a request that does not say either
            # by the API's default (stored), on every transport: nothing is continued from it before a GET proves
            # the upstream reads stored responses back, nor trusted before an echo shows the chain read.
            stored = plan.asked_store or plan.store_unsaid
        if not stored:
            if plan.asked_store:
                self._mark_unsupported(plan.scope)
                return Outcome("unsupported", "upstream did not store a response it was asked to", rid)
            return Outcome("ignored", "response not stored", rid)
        output = response.get("output")
        if not isinstance(output, list) or not all(isinstance(i, dict) for i in output):
            self._forget_parent(plan)
            return Outcome("dropped", "response output is not a list of items", rid)
        assert plan.sequence is not None
        try:
            output_digests = [item_digest(item) for item in output]
        except Ambiguous:
            return Outcome("ignored", "the answer's items read differently in other parsers", rid)
        digest = plan.sequence.extended(output_digests).digests[-1]
        for item, item_digest_ in zip(output, output_digests, strict=True):
            if isinstance(item.get("id"), str):
                key = self._ref_key(plan.root, item["id"])
                self.refs.put(key, item_digest_)
                self._outbox.append(Write(REFS, key, item_digest_, self.config.ttl))
        if usage is not None:
            self.usages.put(rid, _Counted(usage, len(output), plan.context))
        length, expires = plan.items_total + len(output), self.config.clock() + self.config.ttl
        self.store.remember(digest, length, rid, plan.parent, plan.scope, expires)
        entry = encode_entry(StoredEntry(rid, length, plan.scope, expires))
        self._outbox.append(Write(ENTRIES, digest, entry, self.config.ttl))
        return Outcome("advanced", f"stores {plan.items_total + len(output)} items", rid)

    def _fell_short(self, plan: Plan, usage: Usage | None) -> bool:
        """Whether a continuation's answer shows the upstream fed the model
        less than the chain it continued holds (``chain_fell_short``), judged
        only against a parent whose usage this process saw, with the same
        instructions and tools. The chain's kinds not yet shown kept are then
        marked dropped (all of them when every one was: the chain is lossy and
        nothing tells which), and its continuations go whole from then on."""
        parent = self.usages.get(plan.previous_response_id)
        if usage is None or parent is None or parent.context != plan.context \
                or not chain_fell_short(parent.usage, usage, parent.output_items):
            return False
        self.judge_chain(plan, kept=False)
        return True

    def judge_chain(self, plan: Plan, kept: bool) -> list[str]:
        """What a continuation showed of the upstream's stored chain: that it
        keeps the kinds ``plan`` was compared for, or that it drops them (or,
        with none compared, what it was not known to keep: the plain kinds
        too); the kinds newly marked."""
        if kept:
            return self.upstreams.judge_items(plan.scope, plan.verify, kept=True)
        suspects = plan.verify or [k for k in plan.chain_kinds
                                   if not self.upstreams.has("keeps_items", kind_scope(plan.scope, k))]
        return self.upstreams.judge_items(plan.scope, suspects or plan.chain_kinds, kept=False)

    def _observe(self, plan: Plan, status_code: int, response: Any) -> Outcome:
        """A client's own continuation: an answer that echoes its
        previous_response_id shows the upstream honours the field."""
        if (
            status_code < 400
            and isinstance(response, dict)
            and plan.client_previous_response_id is not None
            and response.get("previous_response_id") == plan.client_previous_response_id
        ):
            self.upstreams.mark("honours_previous", plan.scope)
            return Outcome("ignored", "the upstream honours previous_response_id", response.get("id"))
        return Outcome("ignored", "client-managed continuation")

    def polled(self, response_id: str, scope: str, status_code: int, response: Any) -> Outcome | None:
        """A poll of a background response (``GET /responses/{id}``) by the
        same upstream + credential: once it is finished, learn from it as from
        the answer to the request that started it."""
        plan = self.background.hit(response_id)
        if plan is None or plan.scope != scope or status_code >= 400 or not isinstance(response, dict):
            return None
        if response.get("status") in ("queued", "in_progress"):
            return None
        del self.background[response_id]
        return self.settle(plan, status_code, response)

    def abandon(self, plan: Plan, why: str) -> Outcome:
        """The request failed before any answer (reset, refused, timeout): the
        branch it continued from is forgotten, so a retry is planned afresh."""
        self._forget_parent(plan)
        return Outcome("dropped", why)

    def _forget_parent(self, plan: Plan) -> None:
        if plan.parent is not None:
            self.store.forget(plan.parent)
            self._outbox.append(Write(ENTRIES, plan.parent, None))

    def _forget_branch(self, plan: Plan) -> None:
        """A continuation refused: every ancestor of its parent goes with it.
        An upstream that lost one response (a restart, its retention) has lost
        the older ones of the chain too, and the next turns would each be
        continued from the next older one and refused again."""
        if plan.parent is None or plan.sequence is None:
            return
        for digest in plan.sequence.digests[: plan.items_total - plan.items_sent]:
            self.store.forget(digest)
            self._outbox.append(Write(ENTRIES, digest, None))

    def retried(self, plan: Plan, refused: int, refusal: bytes, status_code: int) -> None:
        """Our retry with the client's original body got ``status_code``, after
        the upstream answered ``refused`` (its body: ``refusal``) to ours. If
        the only change had been a forced store, the original went through and
        the refusal can be about the request (a 4xx that says neither "not
        now" nor "unavailable"), the forced store was what the upstream refused
        (a zero-data-retention organization): never force it there again, for
        the time to live when the refusal names ``store`` (as the ZDR error
        does), for an hour otherwise. A 5xx, 408, 425 or 429 that the retry
        escaped was chance, and a chance teaches nothing; if the original
        failed too, the refusal was the request's own and proves nothing."""
        if plan.action == "full" and plan.forced_store and status_code < 400 \
                and 400 <= refused < 500 and refused not in TRANSIENT_STATUSES:
            period = None if names_store(refusal) else UNNAMED_STORE_REFUSAL_S
            self.upstreams.mark("no_forced_store", plan.scope, period)

    def _mark_unsupported(self, scope: str) -> None:
        if self.upstreams.mark("unsupported", scope):
            self.counters.unsupported_upstreams += 1
        self.store.forget_scope(scope)

    def clear(self) -> None:
        """Forget everything learned (the glue clears the backing store)."""
        self.store.clear()
        self.refs.clear()
        self._outbox.clear()

    def stats(self) -> dict[str, int]:
        return {**vars(self.counters), "branches": self.store.branch_count}


def plan_summary(plan: Plan) -> str:
    """One line for the flow list; never any prompt text."""
    if plan.action == "continue":
        return f"continued from {plan.previous_response_id}: {plan.items_sent} of {plan.items_total} items sent"
    if plan.action == "full":
        return f"full: {plan.items_total} items ({plan.reason})"
    return f"passed: {plan.reason}"


__all__ = ["Planner", "Plan", "Reading", "Request", "Outcome", "plan_summary"]
