"""What crosses an upstream WebSocket, and what the HTTP client gets back. Pure.

A turn goes up as one ``response.create`` message: the client's own body,
spliced (every other byte of every value is the client's), with ``type`` added
and ``stream`` removed (a socket always streams); a continuation has its
``input`` cut to the new items and ``previous_response_id`` added. Events come
back as one JSON text message each, exactly those of the HTTP stream; a
streaming client gets each one framed as the API's SSE event as soon as it
arrives, a JSON client the response object the terminal event carries, and an
``error`` event the HTTP status and body the API would have answered with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgspec

from blake3 import blake3

from ..items import ITEM_DIGEST_SIZE, ItemSequence, item_digest, strict_loads
from ..request_reader import splice
from ..answer_reader import TERMINAL_EVENTS
from ..upstreams import TRANSIENT_STATUSES, UNAVAILABLE_STATUSES

# Refusals about the socket's state, not the request: the turn goes again with
# its full history, and the client never hears of them.
STATE_ERRORS = frozenset({
    "previous_response_not_found",  # evicted (a failed turn, a restart), or never on this socket
    "websocket_connection_limit_reached",  # the socket's 60 minutes are up
    "conversation_already_has_active_response",  # a turn still runs on it
})
# Of those, the ones that say this socket cannot take a turn now: the retry takes a fresh one.
UNUSABLE_SOCKET_ERRORS = frozenset({"websocket_connection_limit_reached", "conversation_already_has_active_response"})
SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))
JSON_HEADERS = ((b"content-type", b"application/json"),)


def socket_message(body: bytes, fields: dict[str, msgspec.Raw], new_items: list[bytes] | None = None,
                   previous_response_id: str | None = None) -> bytes:
    """The ``response.create`` message for a request: its whole input, or
    (with ``previous_response_id``) only ``new_items``."""
    changes: dict[str, bytes | None] = {"type": b'"response.create"', "stream": None}
    if previous_response_id is not None:
        assert new_items is not None
        changes["input"] = b"[" + b",".join(new_items) + b"]"
        changes["previous_response_id"] = json.dumps(previous_response_id).encode()
    return splice(body, fields, changes)


class _Error(msgspec.Struct):
    code: Any = None
    type: Any = None
    headers: Any = None  # openai-python's ResponseWsError keeps them here


# The HTTP status an error event names when it carries none (an error inside a
# stream, or a server that leaves it out), by its code or type: as the HTTP API
# answers them. Anything else is a server error.
STATUS_OF = {
    "previous_response_not_found": 400, "websocket_connection_limit_reached": 400,
    "conversation_already_has_active_response": 400, "invalid_request_error": 400,
    "authentication_error": 401, "invalid_api_key": 401, "permission_error": 403, "not_found_error": 404,
    "rate_limit_exceeded": 429, "rate_limit_error": 429, "insufficient_quota": 429,
    "server_error": 500, "api_error": 500, "server_is_overloaded": 503, "slow_down": 503, "overloaded_error": 503,
}
# Headers of an error event that the client's SDK acts on (when to retry) or shows; the rest are the server's own.
KEPT_HEADERS = ("retry-after", "retry-after-ms")
KEPT_HEADER_PREFIXES = ("x-ratelimit-",)


_ABSENT = msgspec.Raw(b"")


def _given(raw: msgspec.Raw) -> msgspec.Raw | None:
    """A raw field, or None when absent or null (the API treats those alike)."""
    return raw if raw and (len(raw) != 4 or bytes(raw) != b"null") else None  # never copies a large span


class _Fields(msgspec.Struct):
    type: Any = None
    status: Any = None
    status_code: Any = None  # the same, as some servers spell it (codex-rs reads either)
    headers: Any = None  # codex-rs reads them here
    error: msgspec.Raw = _ABSENT
    code: Any = None
    response: msgspec.Raw = _ABSENT
    item: msgspec.Raw = _ABSENT
    output_index: Any = None


@dataclass(frozen=True)
class Event:
    """The few fields of a server message the bridge acts on; the message
    itself goes to the client as it came."""

    type: Any = None
    status: Any = None  # an error event's HTTP status (openai-python's ResponseWsError), or its status_code
    error: msgspec.Raw | None = None  # the API's error object (nested, as on the wire)
    code: Any = None  # the flat form of an error event
    response: msgspec.Raw | None = None  # the response object, on the events that carry it
    item: msgspec.Raw | None = None  # on response.output_item.done
    output_index: Any = None
    headers: Any = None  # an error event's top-level headers

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    @cached_property
    def _error(self) -> _Error:
        if self.error is not None:
            try:
                return msgspec.json.decode(self.error, type=_Error)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return _Error()
        return _Error(code=self.code)

    @property
    def error_code(self) -> Any:
        """What the error is: its code, or its type where only that names a
        refusal the bridge knows (``websocket_connection_limit_reached``
        spelled as the type: codex-rs reads either), or where it has no code."""
        error = self._error
        if error.code in STATE_ERRORS or error.type not in STATE_ERRORS and error.code is not None:
            return error.code
        return error.type

    @property
    def http_status(self) -> int:
        """The HTTP status the API would have answered with: the event's own
        (``status`` or ``status_code``), else the one its code or type names,
        else a server error's."""
        if isinstance(self.status, int) and not isinstance(self.status, bool) and 400 <= self.status <= 599:
            return self.status
        error = self._error
        for name in (error.code, error.type):
            if isinstance(name, str) and name in STATUS_OF:
                return STATUS_OF[name]
        return 500

    def kept_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers an error event carries that the client's SDK acts on
        (``Retry-After``), from its top level or its error object."""
        kept: dict[bytes, bytes] = {}
        for headers in (self._error.headers, self.headers):
            if not isinstance(headers, dict):
                continue
            for name, value in headers.items():
                lower = name.lower() if isinstance(name, str) else ""
                if not (lower in KEPT_HEADERS or lower.startswith(KEPT_HEADER_PREFIXES)):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    value = str(value)
                if isinstance(value, str) and value.isprintable() and value.isascii():
                    kept[lower.encode()] = value.encode()
        return list(kept.items())


_FIELDS = msgspec.json.Decoder(_Fields)
UNREADABLE = Event()


def read_event(text: bytes | str) -> Event:
    """A server message's fields; ``UNREADABLE`` (no type) for one that is not a JSON object."""
    try:
        f = _FIELDS.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return UNREADABLE
    status = f.status if f.status is not None else f.status_code
    return Event(f.type, status, _given(f.error), f.code, _given(f.response), _given(f.item), f.output_index,
                 f.headers)


def sse_event(event_type: str | None, text: bytes) -> bytes:
    """One server message as the HTTP API streams it (``event:`` then
    ``data:``; a message without a type, ``data:`` alone); a message holding
    line breaks takes one ``data:`` line per line, which an SSE reader joins
    back with the same breaks."""
    data = b"\ndata: ".join(text.splitlines()) if b"\n" in text or b"\r" in text else text
    name = b"event: " + event_type.encode() + b"\n" if event_type else b""
    return name + b"data: " + data + b"\n\n"


def error_answer(event: Event) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The HTTP status, headers and body for an ``error`` event: its status
    (``Event.http_status``), the headers the client's SDK acts on
    (``Retry-After``), and the API's ``{"error": …}`` body."""
    status, headers = event.http_status, [*JSON_HEADERS, *event.kept_headers()]
    if event.error is not None:
        return status, headers, b'{"error":' + bytes(event.error) + b"}"
    return status, headers, json.dumps(
        {"error": {"type": "server_error", "code": event.code, "message": "", "param": None}}).encode()


def retried_on_a_socket(event: Event, continued: bool) -> bool:
    """An error event that sends the turn again with its full history: one
    about the socket's state, or any failure of a continuation but "not now"
    and "unavailable" (the change may be why: a 500 too), as forward mode
    retries every request it changed with the client's own body over HTTP."""
    status = event.http_status
    return event.error_code in STATE_ERRORS or (continued and 400 <= status
                                                 and status not in TRANSIENT_STATUSES | UNAVAILABLE_STATUSES)


def retried_over_http(event: Event) -> bool:
    """A refusal of the client's own request on the socket: it goes once more
    over HTTP, where the client would have sent it (a parameter the socket
    refuses and HTTP takes, say). Whatever HTTP answers is the client's."""
    status = event.http_status
    return 400 <= status < 500 and status not in TRANSIENT_STATUSES


@dataclass(frozen=True)
class Tip:
    """A socket's most recent completed response, as the socket's memory holds
    it: the digest of its whole item sequence (its input, then its output)
    under the namespace root, its length, and the output items' ids (an
    ``item_reference`` to one equals that item)."""

    root: bytes
    digest: bytes
    length: int
    response_id: str
    # the chain's output items, packed: per item, a short hash of its id then its digest (OUTPUT_ENTRY bytes:
    # 24 kB for MAX_REMEMBERED_OUTPUTS, where a tuple of (id, digest) pairs held about 200 kB)
    outputs: bytes = b""
    stored: bool = False  # the upstream said it stored the response: any socket can continue it, not this one alone

    def named(self) -> dict[bytes, bytes]:
        """The output items' digests by their ids' hashes (``output_key``)."""
        o = self.outputs
        return {o[i:i + _KEY]: o[i + _KEY:i + OUTPUT_ENTRY] for i in range(0, len(o), OUTPUT_ENTRY)}

    def resolved(self, digests: list[bytes], references: dict[bytes, str]) -> list[bytes]:
        """``digests`` with each item reference to an output item of this chain replaced by that item's digest."""
        named = self.named()
        return [named.get(output_key(references[d]), d) if d in references else d for d in digests]

    def extended_by(self, root: bytes, digests: list[bytes], references: dict[bytes, str]) -> bool:
        """Whether a request's items strictly extend this sequence."""
        if root != self.root or len(digests) <= self.length:
            return False
        if references:
            digests = self.resolved(digests, references)
        return ItemSequence(root, digests[: self.length]).digests[-1] == self.digest


def done_output(done_items: dict[int, msgspec.Raw]) -> list[msgspec.Raw] | None:
    """The output items a turn's ``output_item.done`` events carried, in
    order; None when one is missing (its index skipped): the turn's output is
    then unknown."""
    if sorted(done_items) != list(range(len(done_items))):
        return None
    return [done_items[i] for i in range(len(done_items))]


_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])


def answered_response(response: msgspec.Raw, done_items: dict[int, msgspec.Raw]) -> bytes:
    """The response object a JSON client gets: the terminal event's, with an
    output it left empty filled from the done events, as the HTTP API's JSON
    answer would hold it (servers that leave it empty still send every item
    in ``output_item.done``); every other byte as the upstream sent it."""
    raw = bytes(response)
    if not done_items or (done := done_output(done_items)) is None:
        return raw
    try:
        fields = _TOP_LEVEL.decode(raw)
        output = _given(fields.get("output", _ABSENT))
        if output is not None and _ITEMS.decode(output):
            return raw
    except (msgspec.DecodeError, msgspec.ValidationError):
        return raw
    return splice(raw, fields, {"output": b"[" + b",".join(bytes(item) for item in done) + b"]"})


MAX_REMEMBERED_OUTPUTS = 1024  # output item ids a socket's chain keeps for item references
_KEY = 8  # bytes of an output item id's hash: ids are the upstream's, a collision among 1024 is 2^-44 likely
OUTPUT_ENTRY = _KEY + ITEM_DIGEST_SIZE


def output_key(item_id: str) -> bytes:
    return blake3(item_id.encode("utf-8", "surrogatepass")).digest(_KEY)


def tip_after(root: bytes, digests: list[bytes], response: msgspec.Raw | None, done_items: dict[int, msgspec.Raw],
              previous: Tip | None) -> Tip | None:
    """The socket's memory after a turn whose input was ``digests`` (the
    request's whole history): its completed response, or None (anything else
    evicts it, and an answer other parsers could read differently is not
    built on). ``done_items`` fill an output the terminal event left empty."""
    if response is None:
        return None
    try:
        answer = strict_loads(bytes(response))
        if not isinstance(answer, dict) or answer.get("status") != "completed" \
                or not isinstance(answer.get("id"), str):
            return None
        output = answer.get("output")
        if not output and done_items:
            done = done_output(done_items)
            if done is None:
                return None
            output = [strict_loads(bytes(item)) for item in done]
        if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
            return None
        output_digests = [item_digest(item) for item in output]
    except (ValueError, RecursionError):
        return None
    sequence = ItemSequence(root, [*digests, *output_digests])
    new = {output_key(item["id"]): digest for item, digest in zip(output, output_digests, strict=True)
           if isinstance(item.get("id"), str)}
    kept = previous.named() if previous is not None and previous.root == root else {}
    for key in new:
        kept.pop(key, None)  # an id again: its newest item, at the end
    kept.update(new)
    outputs = b"".join(key + digest for key, digest in list(kept.items())[-MAX_REMEMBERED_OUTPUTS:])
    return Tip(root, sequence.digests[-1], len(sequence.items), answer["id"], outputs, answer.get("store") is True)


class _Echo(msgspec.Struct):
    previous_response_id: Any | msgspec.UnsetType = msgspec.UNSET


def echoed_previous(response: msgspec.Raw | None) -> Any:
    """The ``previous_response_id`` a response object echoes: ``msgspec.UNSET``
    when it has no such field (an early event of a server that echoes it only
    on the terminal one), None when null or unreadable."""
    if response is None:
        return None
    try:
        return msgspec.json.decode(response, type=_Echo).previous_response_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
