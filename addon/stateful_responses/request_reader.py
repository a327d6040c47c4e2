"""Responses API requests as every capability reads them.

A ``POST …/responses`` whose body the addon may act on is read once, by one
set of rules, into a ``Reading``: the body split into raw spans without
building its strings (the top-level fields, then the input's items), the
items' digests, and the tenant. Only small fields are decoded; items are
recognised by their bytes (``items.DigestCache``), and a rewritten body is
spliced from the client's own bytes. A body whose meaning depends on the JSON
parser is never read: it passes untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from .bounded import Bounded
from .counters import Counters
from .items import Ambiguous, DigestCache, as_item_list, item_digest, unambiguous
from .settings import Config
from .tenancy import Tenancy, credential_material


@dataclass(frozen=True)
class Request:
    """A client's request as the pure cores see it."""

    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes
    content_encoding: str = ""
    proxy_user: str = ""  # the user mitmproxy's proxyauth authenticated (it strips Proxy-Authorization)


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
    conversation: Any = None  # as the client sent it (None: absent); read only when asked for


@dataclass(frozen=True)
class Skip:
    """A request the addon leaves alone, and why."""

    reason: str
    upstream: str = ""  # empty: not a Responses API request at all
    model: str = ""


def upstream_of(url: str) -> str | None:
    """The base URL a ``.../responses`` endpoint lives under, or None."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/responses"):
        return None
    return f"{parts.scheme}://{parts.netloc}{path[: -len('/responses')]}"


_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])


def names_kept_state(body: bytes) -> bool:
    """Whether a Responses request's body names state store emulation may
    have to expand (``conversation``, ``previous_response_id``): such a body
    cannot go upstream before the emulations read the store."""
    try:
        fields = _TOP.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return any(bytes(fields.get(name, b"null")) != b"null" for name in ("conversation", "previous_response_id"))
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


@dataclass
class Reader:
    """Reads Responses API requests for every capability, by one set of rules."""

    config: Config = field(default_factory=Config)
    counters: Counters = field(default_factory=Counters)
    tenancy: Tenancy = field(default_factory=Tenancy)
    digests: DigestCache = field(default_factory=DigestCache, repr=False)
    _last_read: tuple | None = field(default=None, repr=False)
    _checked_fields: Bounded = field(default_factory=lambda: Bounded(1024), repr=False)  # raw value -> verdict

    def __post_init__(self) -> None:
        self.tenancy.on_new_secret(self.forget_last)

    def forget_last(self) -> None:
        """Read the next request afresh (the settings or the secret changed)."""
        self._last_read = None

    def read(self, request: Request, *, count: bool = True, conversations: bool = False) -> Reading | Skip:
        """A Responses API request the addon may act on, read; or why it is
        left alone. The same request read again (the record, then forward
        mode) is read once: bytes are immutable, so the same object is the
        same body. A request in a conversation (``conversation``) is read
        only for those who handle ``conversations``: the others must leave it
        alone, as its context is not in its body."""
        last = self._last_read
        if last is not None and last[0] is request.body and last[1] == (request.url, request.method) \
                and last[2] == credential_material(request) and isinstance(last[3], Reading):
            if count:
                self.counters.requests += 1
            if last[3].conversation is not None and not conversations:
                return Skip("client uses a conversation", last[3].upstream, last[3].model)
            return last[3]
        reading = self._read(request, count, conversations)
        if isinstance(reading, Reading):
            self._last_read = (request.body, (request.url, request.method), reading.credential, reading)
        return reading

    def _read(self, request: Request, count: bool, conversations: bool) -> Reading | Skip:
        s = self.config.settings
        if not s.enabled:
            return Skip("addon disabled")
        if request.method.upper() != "POST":
            return Skip("not a POST")
        upstream = upstream_of(request.url)
        if upstream is None:
            return Skip("not a /responses endpoint")
        if not s.url_matches(request.url):
            return Skip("upstream not in stateful_base_urls")
        if count:
            self.counters.requests += 1
        if request.content_encoding not in ("", "identity"):
            return Skip("compressed request body", upstream)
        try:
            body = _TOP.decode(request.body)
        except (msgspec.DecodeError, RecursionError):
            return self._unreadable(request.body, "body is not a JSON object", upstream, count)
        try:
            model = _field(body, "model")
            client_store = _field(body, "store")
            client_previous = _field(body, "previous_response_id")
        except msgspec.DecodeError:
            return Skip("body holds invalid JSON", upstream)
        if not isinstance(model, str):
            return Skip("no string model", upstream)
        in_conversation = _present(body, "conversation")
        # A conversation the proxy keeps is expanded whatever the model: only the proxy knows its id.
        if not s.model_matches(model) and not (in_conversation and conversations):
            return Skip("model not in stateful_models", upstream, model)
        if in_conversation and not conversations:
            return Skip("client uses a conversation", upstream, model)
        try:
            # In a conversation ``input`` is optional (absent or null): the conversation's items are the context.
            raw_items, digests = ([], []) if in_conversation and not _present(body, "input") \
                else self._items(body.get("input"))
            if not _unambiguous_top_level(request.body, body) or not self._unambiguous_fields(body):
                raise Ambiguous("top level")
        except Ambiguous:
            return self._ambiguous(upstream, model, count)
        except (msgspec.DecodeError, ValueError, RecursionError):
            return self._unreadable(request.body, "input is not a list of items or a string", upstream, count,
                                    model)
        credential = credential_material(request)
        scope, label = self.tenancy.scope(upstream, credential)
        return Reading(upstream, model, scope, label, credential, body, client_store, client_previous,
                       raw_items, digests, _field(body, "conversation") if in_conversation else None)

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

    def _ambiguous(self, upstream: str, model: str, count: bool) -> Skip:
        if count:
            self.counters.ambiguous += 1
        return Skip("ambiguous body", upstream, model)

    def _unreadable(self, body: bytes, reason: str, upstream: str, count: bool, model: str = "") -> Skip:
        """A body msgspec refused: ambiguous if the standard library reads it
        (a lone surrogate, say), else simply not what the addon handles."""
        try:
            json.loads(body)
        except (ValueError, RecursionError):
            return Skip(reason, upstream, model)
        return self._ambiguous(upstream, model, count)

    def _items(self, raw_input: msgspec.Raw | None) -> tuple[list[bytes] | None, list[bytes]]:
        """The input's raw item spans (None for a string input) and their digests."""
        if raw_input is None:
            raise ValueError("no input")
        if bytes(memoryview(raw_input)[:1]) == b'"':  # a string is one user message (the API's rule)
            return None, [item_digest(as_item_list(msgspec.json.decode(raw_input))[0])]
        raw_items = [bytes(r) for r in _ITEMS.decode(raw_input)]
        return raw_items, self.digests.digests(raw_items)
