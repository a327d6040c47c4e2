"""Read an answer on the side while its bytes pass through untouched.

``AnswerReader`` is fed the raw chunks mitmproxy streams to the client (still
content-encoded: the stream callable sees bytes before decoding) and finds the response object: from a JSON body, or
from an SSE stream's events. It never changes, holds back or reorders bytes;
it only looks. If anything about the answer cannot be read (unknown encoding,
oversized event, broken JSON), it gives up quietly and the answer is simply not
learned from. What it reads is read strictly (``items.strict_loads``): an answer
that another client's parser could read differently (duplicate keys, lone
surrogates, invalid UTF-8) teaches nothing.
"""

from __future__ import annotations

import zlib
from typing import Any

from .items import canonical_json, strict_loads

# Events that carry the whole response object.
RESPONSE_EVENTS = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.completed",
        "response.failed",
        "response.incomplete",
        "response.cancelled",
    }
)
INTERESTING_EVENTS = RESPONSE_EVENTS | {"response.output_item.done", "error"}
# After one of these the answer is final (the stream may still close after it).
TERMINAL_EVENTS = frozenset(
    {"response.completed", "response.failed", "response.incomplete", "response.cancelled", "error"}
)
MAX_BUFFER = 64 * 1024 * 1024


class Unreadable(Exception):
    pass


def _read_strictly(text: str) -> Any:
    """JSON as every client reads it, or ValueError. Lone surrogates can only
    come from escapes, so the encoding check runs only when there are some."""
    value = strict_loads(text)
    if "\\u" in text:
        canonical_json(value)
    return value


class _Decoder:
    """Incremental content decoding for the encodings upstreams use."""

    def __init__(self, encoding: str) -> None:
        enc = encoding.strip().lower()
        self._obj: Any = None
        if enc in ("", "identity"):
            return
        if enc in ("gzip", "x-gzip"):
            self._obj = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self._obj = _Deflate()
        elif enc == "br":
            import brotli

            self._obj = _Brotli(brotli.Decompressor())
        elif enc == "zstd":
            import zstandard

            self._obj = zstandard.ZstdDecompressor().decompressobj()
        else:
            raise Unreadable(f"content-encoding {encoding!r}")

    def feed(self, data: bytes) -> bytes:
        if self._obj is None or not data:  # zstd refuses even b"" after its frame
            return data
        return self._obj.decompress(data)


class _Deflate:
    """``deflate`` is zlib-wrapped by the standard, raw in some servers."""

    def __init__(self) -> None:
        self._obj: Any = None

    def decompress(self, data: bytes) -> bytes:
        if self._obj is None:
            if not data:
                return b""
            raw = (data[0] & 0x0F) != 8
            self._obj = zlib.decompressobj(-zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
        return self._obj.decompress(data)


class _Brotli:
    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def decompress(self, data: bytes) -> bytes:
        return self._obj.process(data) if hasattr(self._obj, "process") else self._obj.decompress(data)


class SSEParser:
    """The WHATWG event-stream framing: LF, CR or CRLF line ends, multi-line
    ``data``, comments, events split anywhere across chunks."""

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        buf = self._buf + data
        events: list[tuple[str, str]] = []
        start = 0
        n = len(buf)
        while True:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf != -1 else n)
            if cr != -1:
                if cr + 1 == n:  # a CR at the end may be half of a CRLF
                    break
                end, nxt = cr, cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(buf[start:end], events)
            start = nxt
        self._buf = buf[start:]
        if len(self._buf) > MAX_BUFFER:
            raise Unreadable("SSE line too long")
        return events

    def close(self) -> list[tuple[str, str]]:
        """End of stream: a held-back final CR ends its line after all."""
        events: list[tuple[str, str]] = []
        if self._buf.endswith(b"\r"):
            self._buf = self._buf[:-1] + b"\n"
            events = self.feed(b"")
        return events

    def _line(self, line: bytes, events: list[tuple[str, str]]) -> None:
        if not line:
            if self._data:
                events.append((self._event, "\n".join(self._data)))
            self._event, self._data = "", []
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value.decode("utf-8"))
        elif name == b"event":
            self._event = value.decode("utf-8")


class AnswerReader:
    """Finds the response object of one answer, JSON or SSE, chunk by chunk."""

    def __init__(self, content_type: str, content_encoding: str, content_length: int | None = None) -> None:
        self.is_sse = content_type.split(";")[0].strip().lower() == "text/event-stream"
        self.content_length = content_length
        self.received = 0  # raw bytes seen
        self.terminal = False  # an SSE terminal event arrived
        self.response: dict | None = None
        self._items: dict[int, dict] = {}
        self._json = bytearray()
        self._sse = SSEParser()
        try:
            self._decoder: _Decoder | None = _Decoder(content_encoding)
        except Unreadable:
            self._give_up()

    def feed(self, chunk: bytes) -> None:
        """Look at one raw chunk. Never raises."""
        self.received += len(chunk)
        if self._decoder is None:
            return
        try:
            data = self._decoder.feed(chunk)
            if self.is_sse:
                for event, payload in self._sse.feed(data):
                    self._event(event, payload)
            else:
                self._json += data
                if len(self._json) > MAX_BUFFER:
                    raise Unreadable("JSON answer too large to read")
        except Exception:  # noqa: BLE001 - a reader must never break the stream
            self._give_up()

    @property
    def complete(self) -> bool:
        """The answer is final before its stream has closed: an SSE terminal
        event was read, or a JSON body's last Content-Length byte arrived."""
        if self._decoder is None:
            return False
        if self.is_sse:
            return self.terminal
        return self.content_length is not None and self.received >= self.content_length

    def finish(self) -> dict | None:
        """The response object, once the answer has ended; None if unreadable."""
        if self._decoder is None:
            return None
        if not self.is_sse:
            try:
                body = _read_strictly(bytes(self._json).decode("utf-8"))
            except ValueError:
                self._give_up()
                return None
            self.response = body if isinstance(body, dict) else None
            return self.response
        try:
            for event, payload in self._sse.close():
                self._event(event, payload)
        except Exception:  # noqa: BLE001
            self._give_up()
            return None
        if self.response is not None and not self.response.get("output") and self._items:
            # Servers that leave the terminal event's output empty still sent
            # every item in output_item.done.
            self.response["output"] = [self._items[i] for i in sorted(self._items)]
        return self.response

    def _event(self, event: str, payload: str) -> None:
        if event and event not in INTERESTING_EVENTS:
            return  # deltas: skip the JSON parse
        if payload.strip() == "[DONE]":
            return
        data = _read_strictly(payload)  # raises: the whole answer is given up
        if not isinstance(data, dict):
            return
        kind = data.get("type", event)
        self.terminal = self.terminal or kind in TERMINAL_EVENTS
        if kind in RESPONSE_EVENTS and isinstance(data.get("response"), dict):
            self.response = data["response"]
        elif kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            index = data.get("output_index")
            self._items[index if isinstance(index, int) else len(self._items)] = data["item"]

    def _give_up(self) -> None:
        self._decoder = None
        self.response = None
        self._json = bytearray()


class LiftReader:
    """Reads any protocol's answer on the side for its lifter
    (``protocols.AnswerLifter``): content-decoded, SSE framed, or a JSON body
    (Gemini's streamed JSON array included) handed over whole at its end.
    Never raises; an unreadable answer lifts to None."""

    def __init__(self, lifter: Any, content_type: str, content_encoding: str) -> None:
        self.lifter = lifter
        self.is_sse = content_type.split(";")[0].strip().lower() == "text/event-stream"
        self._body = bytearray()
        self._sse = SSEParser()
        self._done = False
        try:
            self._decoder: _Decoder | None = _Decoder(content_encoding)
        except Unreadable:
            self._decoder = None

    def feed(self, chunk: bytes) -> None:
        if self._decoder is None or self._done:
            return
        try:
            data = self._decoder.feed(chunk)
            if self.is_sse:
                for event, payload in self._sse.feed(data):
                    self.lifter.event(event, payload)
            else:
                self._body += data
                if len(self._body) > MAX_BUFFER:
                    raise Unreadable("answer too large to read")
        except Exception:  # noqa: BLE001 - a reader must never break the stream
            self._decoder = None

    def finish(self) -> Any:
        """The lifted answer, once the answer has ended (None if unreadable)."""
        if self._decoder is None:
            return None
        if not self._done:
            self._done = True
            try:
                if self.is_sse:
                    for event, payload in self._sse.close():
                        self.lifter.event(event, payload)
                else:
                    self.lifter.body(bytes(self._body))
            except Exception:  # noqa: BLE001
                return None
        return self.lifter.finish()
