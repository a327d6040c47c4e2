"""The planner: from a client's request to a decision, and from an answer to
what the store learns. Pure: no mitmproxy, no I/O.

The one invariant everything here serves: for every request, the upstream's
context (its stored chain + the input we send) equals the client's input. A
continuation is planned only from an entry that an upstream answer proved
stored, and the items sent are the client's own items beyond that entry.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
from blake3 import blake3

from .items import Ambiguous, DigestCache, ItemSequence, as_item_list, item_digest, unambiguous
from .settings import Settings
from .state import (
    ENTRIES,
    REFS,
    Bounded,
    MarkKind,
    Marks,
    Outbox,
    StoredEntry,
    Write,
    encode_entry,
)
from .store import Match, PrefixStore

Action = Literal["pass", "full", "continue"]

# Headers that identify whose stored responses a request can reach. Upstreams
# scope stored responses by credential (and organization / project); a proxy
# credential tells users of one shared proxy apart. The URL's query string is
# credential material too (some gateways take keys there).
CREDENTIAL_HEADERS = (
    "authorization",
    "api-key",
    "x-api-key",
    "openai-organization",
    "openai-project",
    "proxy-authorization",
)
# Other APIs and gateways name their keys as they like (Gemini's x-goog-api-key,
# Azure API Management's Ocp-Apim-Subscription-Key, Portkey's x-portkey-api-key,
# Cloudflare AI Gateway's cf-aig-authorization, Helicone-Auth): a header named
# like a credential is one. An idempotency key names a request, not a tenant;
# cookies are left out (services rotate theirs, Cloudflare's every 30 minutes,
# and a chain recorded under one would be lost under the next).
_NAMED_LIKE_A_CREDENTIAL = re.compile(r"auth|key|token|secret|password|subscription")


def is_credential_header(name: str) -> bool:
    """Whether a header (its lower-case name) is credential material."""
    return name in CREDENTIAL_HEADERS or _named_like_a_credential(name)


def _named_like_a_credential(name: str) -> bool:
    return _NAMED_LIKE_A_CREDENTIAL.search(name) is not None and "idempotency" not in name


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes
    content_encoding: str = ""
    proxy_user: str = ""  # the user mitmproxy's proxyauth authenticated (it strips Proxy-Authorization)


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
    forced_store: bool = False  # we set store: true where the client had not
    client_bytes: int = 0
    client_previous_response_id: str | None = None  # the client's own continuation, watched for its echo
    draft: _Draft | None = field(default=None, repr=False)  # what improving the plan from the store needs
    root: bytes = field(default=b"", repr=False)  # the namespace's root digest

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
class Reading:
    """A request read by the rules every capability shares."""

    upstream: str
    model: str
    scope: str
    label: str
    credential: bytes
    fields: dict[str, msgspec.Raw]
    client_store: Any
    previous: Any  # previous_response_id as the client sent it (None: absent)
    raw_items: list[bytes] | None  # None: the input is a string
    digests: list[bytes]


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


@dataclass(frozen=True)
class Outcome:
    """What one answer taught the store, for logs, counters and the flow."""

    kind: Literal["advanced", "dropped", "unsupported", "ignored", "retry", "transient", "pending"]
    detail: str
    response_id: str | None = None


@dataclass
class Counters:
    requests: int = 0
    continued: int = 0
    delta_items: int = 0
    full_items: int = 0
    bytes_saved: int = 0
    retries: int = 0
    fallbacks: int = 0
    unsupported_upstreams: int = 0
    ambiguous: int = 0
    errors: int = 0


def upstream_of(url: str) -> str | None:
    """The base URL a ``.../responses`` endpoint lives under, or None."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/responses"):
        return None
    return f"{parts.scheme}://{parts.netloc}{path[: -len('/responses')]}"


# The body is split into raw spans without building its strings: the top-level
# fields, then the input's items. Only small fields are decoded; items are
# recognised by their bytes (items.DigestCache), and a rewritten body is
# spliced from the client's own bytes.
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


def _field(body: dict[str, msgspec.Raw], name: str) -> Any:
    raw = body.get(name)
    return None if raw is None else msgspec.json.decode(raw)


def _present(body: dict[str, msgspec.Raw], name: str) -> bool:
    """Present and not null (a null field is an absent one to the API)."""
    raw = body.get(name)
    return raw is not None and bytes(raw) != b"null"


_OPEN = re.compile(rb"[ \t\n\r]*\{")
_KEY = re.compile(rb'[ \t\n\r]*"((?:[^"\\]|\\.)*)"[ \t\n\r]*:[ \t\n\r]*', re.S)
_AFTER_VALUE = re.compile(rb"[ \t\n\r]*([,}])[ \t\n\r]*")


def _unambiguous_top_level(original: bytes, body: dict[str, msgspec.Raw]) -> bool:
    """Every top-level key appears once, followed by the very value msgspec
    kept for it. A duplicated key, which parsers resolve differently (first
    wins, last wins, refused), shows as a key seen twice or as a value other
    than the kept one. Small keys are decoded; values are only compared."""
    opening = _OPEN.match(original)
    if opening is None:
        return False
    pos, seen = opening.end(), set()
    if not body:
        return original[pos:].strip() == b"}"
    while True:
        key_match = _KEY.match(original, pos)
        if key_match is None:
            return False
        written = key_match.group(1)
        try:  # a key without escapes is its own UTF-8 (msgspec has checked the rest)
            key = json.loads(b'"' + written + b'"') if b"\\" in written else written.decode()
        except ValueError:
            return False
        raw = body.get(key)
        if raw is None or key in seen:
            return False
        seen.add(key)
        end = key_match.end() + len(raw)
        if not original.startswith(raw, key_match.end()):  # compared in place: the input may be megabytes
            return False
        after = _AFTER_VALUE.match(original, end)
        if after is None:
            return False
        pos = after.end()
        if after.group(1) == b"}":
            return pos == len(original) and len(seen) == len(body)


def splice(original: bytes, body: dict[str, msgspec.Raw], changes: dict[str, bytes | None]) -> bytes:
    """The client's body with some top-level fields replaced, added or (None)
    removed; every other byte of every value is the client's own."""
    if not changes.keys() & body.keys():
        # Only new fields (a forced store): insert them before the closing
        # brace rather than copy the whole body field by field.
        end = original.rindex(b"}")
        extra = b",".join(json.dumps(k).encode() + b":" + v for k, v in changes.items() if v is not None)
        view = memoryview(original)
        return b"".join((view[:end], b"," if body else b"", extra, view[end:]))
    parts = []
    for key, raw in body.items():
        if key in changes and changes[key] is None:
            continue
        value = changes.pop(key, None)
        parts.append(json.dumps(key).encode() + b":" + (value if value is not None else bytes(raw)))
    parts += [json.dumps(key).encode() + b":" + value for key, value in changes.items() if value is not None]
    return b"{" + b",".join(parts) + b"}"


# Answers that say "not now", not "not this": the client's SDK retries them and
# the same answer would have come without the addon, so they teach nothing.
TRANSIENT_STATUSES = frozenset({408, 425, 429})
_ABSENT = object()


@dataclass
class Planner:
    settings: Settings = field(default_factory=Settings)
    store: PrefixStore = field(init=False)
    counters: Counters = field(default_factory=Counters)
    # What the addon learned per upstream + credential: "unsupported" (does not
    # store), "no_forced_store" (refuses a forced store), "honours_previous"
    # (echoed a previous_response_id correctly: there, an answer that omits
    # ``store`` may be taken at the request's word).
    marks: Marks = field(default_factory=Marks)
    digests: DigestCache = field(default_factory=DigestCache, repr=False)
    # Output items by id, per namespace: an item_reference equals the item it names.
    refs: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)
    # Background responses still running: their plans wait for the poll that finds them finished.
    background: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)
    clock: Callable[[], float] = field(default=time.time, repr=False)
    _secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    _outbox: Outbox = field(default_factory=Outbox, repr=False)
    _last_read: tuple | None = field(default=None, repr=False)
    _checked_fields: Bounded = field(default_factory=lambda: Bounded(1024), repr=False)  # raw value -> verdict
    _scopes: Bounded = field(default_factory=lambda: Bounded(1024), repr=False)  # (upstream, credential) -> scope

    def __post_init__(self) -> None:
        self.store = PrefixStore(self.settings.max_chains)

    def reconfigure(self, settings: Settings) -> None:
        if settings.max_chains != self.settings.max_chains:
            self.store = PrefixStore(settings.max_chains)
        self.settings = settings
        self._last_read = None

    @property
    def secret(self) -> bytes:
        """The keyed-hash secret (the backing store's once connected): never logged."""
        return self._secret

    def use_secret(self, secret: bytes) -> None:
        """Hash with the backing store's secret from now on, so that every
        process sharing the store names sequences and scopes alike. What was
        learned under another secret is unreachable and is dropped."""
        if secret != self._secret:
            self._secret = secret
            self._last_read = None
            self._scopes.clear()
            self.store.clear()
            self.marks.clear()
            self.refs.clear()

    def take_writes(self) -> list[Write]:
        """What must reach the backing store, oldest first (the outbox empties)."""
        return self._outbox.take()

    @property
    def ttl(self) -> float:
        return self.settings.ttl_days * 86400.0

    def mark(self, kind: MarkKind, scope: str) -> bool:
        write = self.marks.add(kind, scope, self.clock(), self.ttl)
        if write is not None:
            self._outbox.append(write)
        return write is not None

    def namespace(self, upstream: str, model: str, credential: bytes) -> bytes:
        """The root digest that every stored sequence of one namespace hangs from.

        A namespace is upstream + model + credential. It deliberately leaves out
        ``prompt_cache_key``, ``instructions`` and ``tools``: matching is by item
        content, so two requests whose items agree are the same conversation up
        to that point whatever they are called; instructions and tools are resent
        with every request and are not part of the stored context (FACTS.md);
        and clients vary ``prompt_cache_key`` freely (openai-agents sends a new
        one on every ``Runner.run``), which would make every turn start over.
        The credential (``credential_material``) enters only through a keyed
        hash with a secret: it is never stored, and the digest cannot be tested
        offline.
        """
        h = blake3(key=self._secret)
        h.update(f"{upstream}\x00{model}\x00".encode("utf-8", "surrogatepass"))
        h.update(credential)
        return h.digest()

    @staticmethod
    def credential_material(request: Request) -> bytes:
        """Whatever decides whose stored responses a request can reach: the
        credential headers, the URL's query string, and the user mitmproxy's
        proxyauth let in (it removes Proxy-Authorization before addons run)."""
        headers = request.headers
        parts = [headers.get(n, "") for n in CREDENTIAL_HEADERS]
        parts += [urlsplit(request.url).query, request.proxy_user]
        parts += sorted(f"{name}: {value}" for written, value in headers.items()
                        if (name := written.lower()) not in CREDENTIAL_HEADERS and _named_like_a_credential(name))
        return "\x00".join(parts).encode("utf-8", "surrogatepass")

    def scope(self, upstream: str, credential: bytes) -> tuple[str, str]:
        """Where "does not store" and "refuses a forced store" apply: one
        upstream as seen by one credential. Zero data retention is decided per
        organization, so one such tenant must not switch the addon off for
        every other tenant of the same upstream.

        Returns the scope (a keyed hash) and its label for logs: scheme, host
        and hash tags, never the path (some gateways take keys there) nor
        anything of the credential."""
        known = self._scopes.get((upstream, credential))
        if known is not None:
            return known
        upstream_bytes = upstream.encode("utf-8", "surrogatepass")
        scope = blake3(upstream_bytes + b"\x00" + credential, key=self._secret).hexdigest(16)
        parts = urlsplit(upstream)
        host = parts.hostname or "?"
        if parts.port:
            host = f"{host}:{parts.port}"
        upstream_tag = blake3(upstream_bytes, key=self._secret).hexdigest(3)
        credential_tag = blake3(credential, key=self._secret).hexdigest(4)
        result = scope, f"{parts.scheme}://{host} (upstream #{upstream_tag}, credential #{credential_tag})"
        self._scopes.put((upstream, credential), result)
        return result

    def read(self, request: Request, *, count: bool = True) -> Reading | Plan:
        """A Responses API request the addon may act on, read; or the plan to
        leave it alone, with the reason. The same rules for forward mode and
        store emulation: a body whose meaning depends on the parser is never
        read (issue 17). The same request read again (the record, then forward
        mode) is read once: bytes are immutable, so the same object is the
        same body."""
        last = self._last_read
        if last is not None and last[0] is request.body and last[1] == (request.url, request.method) \
                and last[2] == self.credential_material(request) and isinstance(last[3], Reading):
            if count:
                self.counters.requests += 1
            return last[3]
        reading = self._read(request, count)
        if isinstance(reading, Reading):
            self._last_read = (request.body, (request.url, request.method), reading.credential, reading)
        return reading

    def _read(self, request: Request, count: bool) -> Reading | Plan:
        s = self.settings
        if not s.enabled:
            return Plan("pass", "addon disabled")
        if request.method.upper() != "POST":
            return Plan("pass", "not a POST")
        upstream = upstream_of(request.url)
        if upstream is None:
            return Plan("pass", "not a /responses endpoint")
        if not s.url_matches(request.url):
            return Plan("pass", "upstream not in stateful_base_urls")
        if count:
            self.counters.requests += 1
        if request.content_encoding not in ("", "identity"):
            return Plan("pass", "compressed request body", upstream)
        try:
            body = _TOP.decode(request.body)
        except (msgspec.DecodeError, RecursionError):
            return self._unreadable(request.body, "body is not a JSON object", upstream, count)
        try:
            model = _field(body, "model")
            client_store = _field(body, "store")
            client_previous = _field(body, "previous_response_id")
        except msgspec.DecodeError:
            return Plan("pass", "body holds invalid JSON", upstream)
        if not isinstance(model, str):
            return Plan("pass", "no string model", upstream)
        if not s.model_matches(model):
            return Plan("pass", "model not in stateful_models", upstream, model)
        if _present(body, "conversation"):
            return Plan("pass", "client uses a conversation", upstream, model)
        try:
            raw_items, digests = self._items(body.get("input"))
            if not _unambiguous_top_level(request.body, body) or not self._unambiguous_fields(body):
                raise Ambiguous("top level")
        except Ambiguous:
            return self._ambiguous(upstream, model, count)
        except (msgspec.DecodeError, ValueError, RecursionError):
            return self._unreadable(request.body, "input is not a list of items or a string", upstream, count,
                                    model)
        credential = self.credential_material(request)
        scope, label = self.scope(upstream, credential)
        return Reading(upstream, model, scope, label, credential, body, client_store, client_previous,
                       raw_items, digests)

    def plan(self, request: Request, *, rewrite: bool = True) -> Plan:
        """Decide what to send. With ``rewrite=False`` (our own retry of a
        client's original body) nothing is changed, only tracked."""
        reading = self.read(request, count=rewrite)
        if isinstance(reading, Plan):
            return reading
        s = self.settings
        upstream, model, scope, label = reading.upstream, reading.model, reading.scope, reading.label
        body, client_store, raw_items, digests = reading.fields, reading.client_store, reading.raw_items, reading.digests
        credential = reading.credential
        if reading.previous is not None:
            plan = Plan("pass", "client sent previous_response_id", upstream, model, scope, label)
            if isinstance(reading.previous, str):
                plan.client_previous_response_id = reading.previous
            return plan
        if not digests:
            return Plan("pass", "input has no items", upstream, model)
        if client_store is False and not s.force_store:
            return Plan("pass", "client sent store:false", upstream, model)
        now = self.clock()
        if self.marks.has("unsupported", scope, now):
            return Plan("pass", "upstream does not store responses", upstream, model, scope, label)

        root = self.namespace(upstream, model, credential)
        unresolved = self._resolve_references(root, digests)
        sequence = ItemSequence(root, digests)
        prefixes = sequence.digests
        force = (
            rewrite
            and s.force_store
            and client_store is not True
            and not self.marks.has("no_forced_store", scope, now)
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
            forced_store=force,
            client_bytes=len(request.body),
            root=root,
        )
        if not asked_store:
            plan.reason = "full; the request does not ask to store"
        if not rewrite:
            return plan
        match = self.store.deepest(prefixes, now)
        plan.draft = _Draft(request.body, body, raw_items, force, match.length if match else 0, unresolved)
        self._shape(plan, match)
        self._count(plan)
        return plan

    def _ref_key(self, root: bytes, item_id: str) -> bytes:
        return blake3(root + b"\x00ref\x00" + item_id.encode("utf-8", "surrogatepass"),
                      key=self._secret).digest(16)

    def _resolve_references(self, root: bytes, digests: list[bytes]) -> list[bytes]:
        """Give each item reference the digest of the output item it names
        (learned from this namespace's answers); the keys of those memory
        does not know (the backing store may)."""
        unresolved = []
        references = self.digests.references
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
        if plan.draft is not None:
            self._uncount(plan)
            self.counters.requests -= 1

    def _shape(self, plan: Plan, match: Match | None) -> None:
        """Write the plan's body: continued from ``match``, or full."""
        draft = plan.draft
        assert draft is not None
        changes: dict[str, bytes] = {}
        if match is not None:
            assert draft.raw_items is not None  # a string input is one item and never extends anything
            changes["input"] = b"[" + b",".join(draft.raw_items[match.length :]) + b"]"
            changes["previous_response_id"] = json.dumps(match.response_id).encode()
            plan.action = "continue"
            plan.reason = f"extends {match.response_id}"
            plan.previous_response_id = match.response_id
            plan.parent = match.digest
            plan.items_sent = plan.items_total - match.length
        if draft.force_store:
            changes["store"] = b"true"
        plan.body = splice(draft.request_body, draft.fields, changes) if changes else None

    def lookups(self, plan: Plan) -> list[bytes]:
        """Entries the backing store may hold that would continue ``plan``
        from deeper than memory can: every prefix deeper than memory's match
        (one round trip). Empty when memory already has the deepest possible."""
        if plan.draft is None or plan.draft.raw_items is None or plan.sequence is None:
            return []
        prefixes = plan.sequence.digests
        return prefixes[plan.draft.memory_depth : len(prefixes) - 1]

    def improve(self, plan: Plan, found: Mapping[bytes, StoredEntry]) -> None:
        """Continue ``plan`` from the deepest entry the backing store had
        (another process learned it, or this one before a restart)."""
        if not found or plan.sequence is None:
            return
        now, prefixes = self.clock(), plan.sequence.digests
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

    def _unambiguous_fields(self, body: dict[str, msgspec.Raw]) -> bool:
        """Every top-level value but the input (whose items are checked one by
        one) reads the same in every mainstream parser. They are small and come
        back unchanged every turn (tools, instructions): each is checked once."""
        checked = self._checked_fields
        for key, raw in body.items():
            if key == "input":
                continue
            value = bytes(raw)
            verdict = checked.get(value)
            if verdict is None:
                verdict = unambiguous(value)
                if len(value) <= 65536:
                    checked.put(value, verdict)
            if not verdict:
                return False
        return True

    def _ambiguous(self, upstream: str, model: str, rewrite: bool) -> Plan:
        if rewrite:
            self.counters.ambiguous += 1
        return Plan("pass", "ambiguous body", upstream, model)

    def _unreadable(self, body: bytes, reason: str, upstream: str, rewrite: bool, model: str = "") -> Plan:
        """A body msgspec refused: ambiguous if the standard library reads it
        (a lone surrogate, say), else simply not what the addon handles."""
        try:
            json.loads(body)
        except (ValueError, RecursionError):
            return Plan("pass", reason, upstream, model)
        return self._ambiguous(upstream, model, rewrite)

    def _items(self, raw_input: msgspec.Raw | None) -> tuple[list[bytes] | None, list[bytes]]:
        """The input's raw item spans (None for a string input) and their digests."""
        if raw_input is None:
            raise ValueError("no input")
        if bytes(memoryview(raw_input)[:1]) == b'"':  # a string is one user message (the API's rule)
            return None, [item_digest(as_item_list(msgspec.json.decode(raw_input))[0])]
        raw_items = [bytes(r) for r in _ITEMS.decode(raw_input)]
        return raw_items, self.digests.digests(raw_items)

    def _count(self, plan: Plan, sign: int = 1) -> None:
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

    def settle(self, plan: Plan, status_code: int, response: Any) -> Outcome:
        """Learn from the upstream's answer to a planned request.

        ``response`` is the answer's response object (from the JSON body or the
        SSE terminal event), or None when there was none to read.
        """
        if status_code in TRANSIENT_STATUSES:
            return Outcome("transient", f"upstream answered {status_code}; nothing learned")
        if not plan.tracked:
            return self._observe(plan, status_code, response)
        if status_code >= 400:
            self._forget_parent(plan)
            if 400 <= status_code < 500 and plan.changed:
                return Outcome("retry", f"upstream answered {status_code} to a changed request")
            return Outcome("dropped", f"upstream answered {status_code}")
        if not isinstance(response, dict):
            self._forget_parent(plan)
            return Outcome("dropped", "no response object in the answer")
        rid = response.get("id")
        status = response.get("status")
        echoed = response.get("previous_response_id", _ABSENT)
        if plan.action == "continue" and echoed is not _ABSENT:
            if echoed != plan.previous_response_id:
                self._mark_unsupported(plan.scope)
                return Outcome("unsupported", "upstream ignored previous_response_id", rid)
            self.mark("honours_previous", plan.scope)
        if status in ("queued", "in_progress") and response.get("background") is True and isinstance(rid, str):
            self.background.put(rid, plan)
            return Outcome("pending", "a background response: learned from when a poll finds it finished", rid)
        if status != "completed" or not isinstance(rid, str) or not rid:
            self._forget_parent(plan)
            return Outcome("dropped", f"response status {status!r}", rid if isinstance(rid, str) else None)
        if plan.action == "continue" and echoed is _ABSENT:
            # An upstream that ignores the field and echoes nothing looks the same.
            return Outcome("ignored", "the answer does not echo previous_response_id: it proves nothing", rid)
        stored = response.get("store")
        if not isinstance(stored, bool):
            if not self.marks.has("honours_previous", plan.scope, self.clock()):
                return Outcome("ignored", "the answer does not say it stored the response", rid)
            stored = plan.asked_store
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
                self._outbox.append(Write(REFS, key, item_digest_, self.ttl))
        length, expires = plan.items_total + len(output), self.clock() + self.ttl
        self.store.remember(digest, length, rid, plan.parent, plan.scope, expires)
        self._outbox.append(Write(ENTRIES, digest, encode_entry(StoredEntry(rid, length, plan.scope, expires)), self.ttl))
        return Outcome("advanced", f"stores {plan.items_total + len(output)} items", rid)

    def _observe(self, plan: Plan, status_code: int, response: Any) -> Outcome:
        """A client's own continuation: an answer that echoes its
        previous_response_id shows the upstream honours the field."""
        if (
            status_code < 400
            and isinstance(response, dict)
            and plan.client_previous_response_id is not None
            and response.get("previous_response_id") == plan.client_previous_response_id
        ):
            self.mark("honours_previous", plan.scope)
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

    def retried(self, plan: Plan, status_code: int) -> None:
        """Our retry with the client's original body got ``status_code``. If
        the only change had been a forced store and the original went through,
        the forced store was what the upstream refused (a zero-data-retention
        organization): never force it there again. If the original failed too,
        the refusal was the request's own and proves nothing."""
        if plan.action == "full" and plan.forced_store and status_code < 400:
            self.mark("no_forced_store", plan.scope)

    def _mark_unsupported(self, scope: str) -> None:
        if self.mark("unsupported", scope):
            self.counters.unsupported_upstreams += 1
        self.store.forget_scope(scope)

    def clear(self) -> None:
        """Forget everything learned (the glue clears the backing store)."""
        self.store.clear()
        self.marks.clear()
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


__all__ = ["Planner", "Plan", "Reading", "Request", "Outcome", "plan_summary", "splice", "upstream_of"]
