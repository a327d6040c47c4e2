"""Helpers for the lifter tests: a loopback stub that records what real SDKs
send, SSE bytes, and lifting an answer the way the addon will read it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stateful_responses.items import canonical_json
from stateful_responses.record.protocols import AnswerLifter, LiftedAnswer, LiftedRequest, lift_request
from stateful_responses.answer_reader import SSEParser


class Stub:
    """An HTTP server on 127.0.0.1 that records each POST and answers the
    next canned answer. Use as a context manager: it is stopped on exit."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []  # (path with query, body)
        self.answers: list[tuple[str, bytes]] = []  # (content type, body)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                stub.requests.append((self.path, body))
                content_type, data = stub.answers.pop(0)
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Stub:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def answer_json(self, doc: Any) -> bytes:
        data = json.dumps(doc).encode()
        self.answers.append(("application/json", data))
        return data

    def answer_sse(self, events: list) -> bytes:
        data = sse_bytes(events)
        self.answers.append(("text/event-stream", data))
        return data

    def sent(self, index: int = -1) -> tuple[str, bytes]:
        """The url path and body of a recorded request (the last by default)."""
        return self.requests[index]


def sse_bytes(events: list) -> bytes:
    """SSE for ``events``: (name, object) pairs get an ``event:`` line, a bare
    object only ``data:``, a string is sent as data verbatim (``[DONE]``)."""
    out = []
    for event in events:
        if isinstance(event, tuple):
            name, data = event
            out.append(f"event: {name}\ndata: {json.dumps(data)}\n\n")
        else:
            out.append(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n")
    return "".join(out).encode()


def lift_answer(protocol: str, data: bytes, sse: bool) -> LiftedAnswer | None:
    lifter = AnswerLifter(protocol)
    if sse:
        parser = SSEParser()
        for name, payload in parser.feed(data) + parser.close():
            lifter.event(name, payload)
    else:
        lifter.body(data)
    return lifter.finish()


def lift(protocol: str, url: str, body: bytes) -> LiftedRequest:
    lifted = lift_request(protocol, url, body)
    assert lifted is not None
    return lifted


def same(a: Any, b: Any) -> bool:
    """Equal as the prefix hash will see them (canonical JSON: 1, 1.0 and true differ)."""
    return canonical_json(a) == canonical_json(b)


def assert_continues(before: LiftedRequest, answer: LiftedAnswer, after: LiftedRequest) -> None:
    """``after``'s conversation extends ``before``'s plus the answer to it."""
    expected = before.messages + answer.messages
    assert answer.messages, "the answer lifted to no message"
    assert same(after.messages[: len(expected)], expected), (after.messages, expected)
