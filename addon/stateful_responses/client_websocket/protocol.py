"""The Responses API's WebSocket mode, as the proxy serves it to clients of an
upstream without it. Pure: what a client message says, the HTTP body each
``response.create`` becomes, the mode's events and error events (the guide's
texts verbatim), and the socket's memory of the responses made on it.

Sources: PROTOCOL_FACTS.md section C (OpenAI's WebSocket mode guide, the
openai SDK's event types, codex-rs) and FACTS.md's WebSocket-mode notes.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..request_reader import splice

MAX_ACTIVE = 16  # responses running at once on one socket, lanes together; more creates wait (C9)
MAX_NAMED_LANES = 32  # distinct stream_ids one socket accepts; the default lane does not count (C9)
LIFETIME_S = 3600.0  # "Connections last up to 60 minutes" (C13)
# The socket's own memory: the responses made on it, their whole item sequence, newest kept.
MEMORY_RESPONSES = 256
MEMORY_BYTES = 64 * 1024 * 1024
WS_ONLY_FIELDS = ("type", "generate", "stream_id")  # never sent to an HTTP upstream (C4, C5)
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "response.cancelled", "error"})
_STREAM_ID = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw] | str)


class Invalid(Exception):
    """A message the mode refuses: its error event (status and error object)."""

    def __init__(self, status: int, error: dict, lane: str | None = None) -> None:
        super().__init__(error.get("code"))
        self.status = status
        self.error = error
        self.lane = lane  # a named lane's refusals echo its stream_id (C8)


def _invalid(code: str, message: str, param: str | None, lane: str | None = None) -> Invalid:
    return Invalid(400, {"type": "invalid_request_error", "code": code, "message": message, "param": param}, lane)


@dataclass
class Create:
    """One ``response.create``: its raw top-level fields and what the proxy acts on."""

    raw: bytes
    fields: dict[str, msgspec.Raw]
    lane: str | None  # its stream_id (None: the default lane)
    previous: str | None
    store: Any  # as the client sent it (None: absent)
    generate: bool
    model: Any
    items: list[bytes]  # its input as items (a string input is one user message, the API's rule)


@dataclass(frozen=True)
class Ignored:
    """A client message the mode ignores silently (Codex's ``response.processed``,
    an old ``response.append``, anything unknown): an error in reply would be
    read by Codex as its next turn's first event (C7)."""


@dataclass(frozen=True)
class Steer:
    """A ``response.steer``: answered ``response.steer.failed``."""

    previous: Any
    input: Any


def _field(fields: dict[str, msgspec.Raw], name: str) -> Any:
    raw = fields.get(name)
    return None if raw is None else msgspec.json.decode(raw)


def read_message(text: bytes) -> Create | Steer | Ignored:
    """A client message; ``Invalid`` for a create the mode refuses."""
    try:
        fields = _TOP.decode(text)
        kind = _field(fields, "type")
    except (msgspec.DecodeError, RecursionError):
        raise _invalid("invalid_json", "The message is not a JSON object.", None) from None
    if kind == "response.steer":
        try:
            return Steer(_field(fields, "previous_response_id"), _field(fields, "input"))
        except msgspec.DecodeError:
            return Steer(None, None)
    if kind != "response.create":
        return Ignored()
    try:
        lane = _field(fields, "stream_id")
        previous = _field(fields, "previous_response_id")
        generate = _field(fields, "generate")
        background = _field(fields, "background")
        model, store = _field(fields, "model"), _field(fields, "store")
        raw_input = fields.get("input")
        value = _ITEMS.decode(raw_input) if raw_input is not None and bytes(raw_input) != b"null" else []
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        raise _invalid("invalid_value", "Invalid 'input': expected a string or an array of items.",
                       "input") from None
    if lane is not None and not (isinstance(lane, str) and _STREAM_ID.fullmatch(lane)):
        raise _invalid("invalid_stream_id", "The 'stream_id' field must be a non-empty string with at most 256 "
                       "characters and may only contain letters, numbers, underscores, hyphens, and periods.",
                       "stream_id")
    if background is True:
        raise Invalid(400, {"type": "invalid_request_error", "code": "unsupported_parameter",
                            "message": "background is not supported over WebSocket.", "param": "background"}, lane)
    if previous is not None and not isinstance(previous, str):
        raise _invalid("invalid_type", "Invalid type for 'previous_response_id': expected a string.",
                       "previous_response_id", lane)
    items = [bytes(item) for item in value] if isinstance(value, list) \
        else [json.dumps({"role": "user", "content": value}).encode()]
    return Create(text, fields, lane, previous, store, generate is not False, model, items)


def http_body(create: Create, parent_items: list[bytes] | None,
              upstream_id: str | None = None) -> tuple[bytes, list[bytes] | None]:
    """The ``POST …/responses`` body of a create (``stream: true``, without
    the WebSocket-only fields), and the whole input it sends when that is
    known: with ``parent_items`` (a response of this socket's memory) its
    ``previous_response_id`` becomes that response's items followed by the
    new ones; without, the body keeps it (the upstream, or store emulation,
    continues by id), or names ``upstream_id`` in its place (a warm-up's
    parent that only the upstream holds)."""
    changes: dict[str, bytes | None] = {name: None for name in WS_ONLY_FIELDS}
    changes["stream"] = b"true"
    whole: list[bytes] | None = None
    if parent_items is not None:
        whole = [*parent_items, *create.items]
        changes["input"] = b"[" + b",".join(whole) + b"]"
        changes["previous_response_id"] = None
    elif create.previous is None:
        whole = create.items
    elif upstream_id is not None:
        changes["previous_response_id"] = json.dumps(upstream_id).encode()
    return splice(create.raw, dict(create.fields), changes), whole


# -- what goes back ----------------------------------------------------------


def error_event(status: int, error: dict, lane: str | None = None) -> bytes:
    """The mode's error event, always with ``status`` (Codex reads it as the HTTP status; C12)."""
    event: dict[str, Any] = {"type": "error", "status": status, "error": error}
    if lane is not None:
        event["stream_id"] = lane
    return json.dumps(event).encode()


def not_found(previous: str, lane: str | None) -> bytes:
    return error_event(400, {"type": "invalid_request_error", "code": "previous_response_not_found",
                             "message": f"Previous response with id '{previous}' not found.",
                             "param": "previous_response_id"}, lane)


def lane_limit(lane: str) -> bytes:
    return error_event(400, {"type": "invalid_request_error", "code": "websocket_stream_limit_reached",
                             "message": f"This WebSocket connection has reached its maximum number of distinct "
                                        f"stream IDs ({MAX_NAMED_LANES}). Reuse an existing stream_id or open a new "
                                        "WebSocket connection.", "param": "stream_id"}, lane)


def lifetime_limit(lane: str | None) -> bytes:
    return error_event(400, {"type": "invalid_request_error", "code": "websocket_connection_limit_reached",
                             "message": "Responses websocket connection limit reached (60 minutes). Create a new "
                                        "websocket connection to continue."}, lane)


def steer_failed(steer: Steer) -> bytes:
    """The honest answer over an HTTP upstream: a running response cannot be steered (C6)."""
    return json.dumps({"type": "response.steer.failed",
                       "error": {"type": "invalid_request_error", "code": "steering_not_supported",
                                 "message": "Steering is not supported on this connection."},
                       "steer": {"input": steer.input, "previous_response_id": steer.previous}}).encode()


def upstream_error(status: int, body: bytes, lane: str | None) -> bytes:
    """An HTTP refusal as the mode's error event: the upstream's own error
    object and status (a body that holds none gets a plain one)."""
    try:
        error = _TOP.decode(body).get("error")
        decoded = msgspec.json.decode(error) if error is not None else None
    except (msgspec.DecodeError, RecursionError):
        decoded = None
    if not isinstance(decoded, dict):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        decoded = {"type": kind, "code": None, "message": f"The upstream answered {status}.", "param": None}
    return error_event(status, decoded, lane)


def framed(data: str, lane: str | None) -> bytes:
    """One SSE event's data as the mode's text message: the event itself,
    ``stream_id`` added on a named lane (C8); every other byte the upstream's."""
    raw = data.encode()
    if lane is None or not raw.startswith(b"{"):
        return raw
    tail = raw[1:].lstrip()
    return b'{"stream_id":' + json.dumps(lane).encode() + (b"," + tail if not tail.startswith(b"}") else tail)


def warm_up(create: Create, lane: str | None) -> tuple[str, list[bytes]]:
    """A ``generate: false`` create answered by the proxy: no upstream call,
    a response id later turns may continue from (C5: ``response.created`` and
    ``response.completed`` with an empty output)."""
    response_id = "resp_" + secrets.token_hex(24)
    response = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "completed",
                "model": create.model, "output": [], "previous_response_id": create.previous,
                "store": create.store is not False, "usage": None, "error": None, "incomplete_details": None}
    events = []
    for n, kind in enumerate(("response.created", "response.completed")):
        event: dict[str, Any] = {"type": kind, "sequence_number": n}
        if lane is not None:
            event["stream_id"] = lane
        event["response"] = {**response, "status": "in_progress"} if n == 0 else response
        events.append(json.dumps(event).encode())
    return response_id, events


_ABSENT = msgspec.Raw(b"")


class _Answer(msgspec.Struct):
    type: Any = None
    response: msgspec.Raw = _ABSENT
    item: msgspec.Raw = _ABSENT
    output_index: Any = None


class _Response(msgspec.Struct):
    id: Any = None
    status: Any = None
    store: Any = None
    output: list[msgspec.Raw] | None = None


_ANSWER = msgspec.json.Decoder(_Answer)
_RESPONSE = msgspec.json.Decoder(_Response)


@dataclass
class Outcome:
    """What one turn's events came to: its terminal event's response, when
    it completed (the socket's memory keeps it)."""

    terminal: str | None = None
    response_id: str | None = None
    stored: bool = False
    output: list[bytes] | None = None
    _done: dict[int, bytes] = field(default_factory=dict)

    def read(self, kind: str, data: str) -> None:
        """One SSE event: its ``event:`` name, else (servers that send ``data:`` alone) the type it holds."""
        if kind and kind != "response.output_item.done" and kind not in TERMINAL:
            return
        try:
            answer = _ANSWER.decode(data)
            kind = kind or answer.type
            if kind != "response.output_item.done" and kind not in TERMINAL:
                return
            if kind == "response.output_item.done":
                if answer.item and isinstance(answer.output_index, int):
                    self._done[answer.output_index] = bytes(answer.item)
                return
            self.terminal = kind
            if kind == "response.completed" and answer.response:
                response = _RESPONSE.decode(answer.response)
                if isinstance(response.id, str):
                    self.response_id = response.id
                    self.stored = response.store is True
                    output = [bytes(item) for item in response.output or []]
                    if not output and self._done:
                        done = sorted(self._done)
                        output = [self._done[i] for i in done] if done == list(range(len(done))) else None
                    self.output = output
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return


# -- the socket's memory -------------------------------------------------------


@dataclass
class Remembered:
    """A response made on the socket: its whole item sequence (None when it
    continued a stored response by id: then only the upstream holds it), its
    lane, and whether the upstream said it stored it."""

    items: list[bytes] | None
    lane: str | None
    stored: bool
    upstream_id: str | None = None  # of a warm-up that continued a response only the upstream holds


class Memory:
    """The responses made on one socket, newest kept, bounded by count and by
    the bytes of the distinct items they hold (a conversation's responses
    share their items: each is counted once)."""

    def __init__(self, max_responses: int = MEMORY_RESPONSES, max_bytes: int = MEMORY_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: dict[str, Remembered] = {}
        self._held: dict[int, list] = {}  # id(item) -> [references, size]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Remembered | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._entries[response_id] = entry  # most recently used last
        return entry

    def put(self, response_id: str, entry: Remembered) -> None:
        self.forget(response_id)
        self._entries[response_id] = entry
        for item in entry.items or ():
            held = self._held.get(id(item))
            if held is None:
                self._held[id(item)] = [1, len(item), item]
                self.bytes += len(item)
            else:
                held[0] += 1
        while self._entries and (len(self._entries) > self.max_responses or self.bytes > self.max_bytes):
            self.forget(next(iter(self._entries)))

    def forget(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        for item in entry.items or () if entry is not None else ():
            held = self._held[id(item)]
            held[0] -= 1
            if not held[0]:
                del self._held[id(item)]
                self.bytes -= held[1]

    def clear(self) -> None:
        self._entries.clear()
        self._held.clear()
        self.bytes = 0
