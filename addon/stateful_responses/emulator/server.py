"""HTTP face of the emulator: the Responses API's endpoints, under ``/v1`` or
not, three other conversation APIs, and a control plane under ``/_emulator/``
for tests and the demo.

  ``POST   /v1/responses``                     create (JSON or SSE; background too)
  ``GET    /v1/responses/{id}``                retrieve
  ``DELETE /v1/responses/{id}``                delete
  ``GET    /v1/responses/{id}/input_items``    list the items it was generated from
  ``POST   /v1/responses/{id}/cancel``         cancel a background response
  ``GET    /v1/responses`` + ``Upgrade: websocket``  WebSocket mode (websocket.py)
  ``GET    /v1/models``                        the models it lists (any model is answered)

  ``POST   /v1/conversations``                 OpenAI's Conversations API (openai_conversations.py):
  ``GET``, ``POST``, ``DELETE /v1/conversations/{id}``, ``POST``, ``GET /v1/conversations/{id}/items``,
  ``GET``, ``DELETE /v1/conversations/{id}/items/{item_id}``

  ``POST   /v1/chat/completions``              OpenAI Chat Completions (chat.py)
  ``POST   /v1/messages``                      Anthropic Messages (anthropic.py)
  ``POST   /v1beta/models/{model}:generateContent``, ``…:streamGenerateContent``  Gemini (gemini.py)

Control plane (docs/emulator.md lists every command):
  ``GET  /_emulator/log``      what it received: bytes, items, continued, context
  ``POST /_emulator/control``  faults, pacing and forgetting (see ``model.Faults``)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import socket
import ssl
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import brotli
import zstandard
from urllib.parse import parse_qsl, urlsplit

from . import errors
from .anthropic import Messages
from .chat import ChatCompletions
from .stateless_apis import Call, ConversationAPI
from .errors import APIError
from .gemini import GenerateContent
from .model import ResponsesModel
from .openai_conversations import ConversationsCall
from .sse import TERMINAL_EVENT, background_events, encode_event, error_events, sse_events, wants_obfuscation
from .websocket import ResponsesSocket

COMPACT_ROUTE = re.compile(r"^(?:/v1)?/responses/compact/?$")
ROUTE = re.compile(r"^(?:/v1)?/responses(?:/(?P<id>[^/]+)(?:/(?P<action>input_items|cancel))?)?/?$")
CONVERSATION_ROUTES: tuple[tuple[re.Pattern, ConversationAPI], ...] = (
    (re.compile(r"^(?:/v1)?/chat/completions/?$"), ChatCompletions()),
    (re.compile(r"^(?:/v1)?/messages/?$"), Messages()),
    (re.compile(r"^/v1(?:beta|alpha)?/models/(?P<model>[^/:]+):(?P<method>generateContent|streamGenerateContent)$"),
     GenerateContent()),
)
OPENAI_CONVERSATIONS_ROUTE = re.compile(
    r"^(?:/v1)?/conversations(?:/(?P<conversation>[^/]+)(?P<items>/items(?:/(?P<item>[^/]+))?)?)?/?$")
# (method, what the path names) -> the OpenAIConversations method that answers it
OPENAI_CONVERSATIONS_ENDPOINTS = {
    ("POST", "conversations"): "create", ("GET", "conversation"): "retrieve", ("POST", "conversation"): "update",
    ("DELETE", "conversation"): "delete", ("POST", "items"): "add_items", ("GET", "items"): "list_items",
    ("GET", "item"): "retrieve_item", ("DELETE", "item"): "delete_item",
}
MODELS_ROUTE = re.compile(r"^(?:/v1)?/models/?$")
# What ``GET /v1/models`` lists, as every OpenAI-compatible server lists its models (the emulator answers any).
MODELS = {"object": "list", "data": [{"id": "gpt-test", "object": "model", "created": 1700000000,
                                      "owned_by": "emulator"}]}
HTML_PAGE = b"<html><body>502 Bad Gateway</body></html>"
BACKGROUND_POLL_S = 0.01  # how often a streamed background response looks for progress
PACED_READ_INTERVAL_S = 0.02  # a paced body is read in chunks of this many seconds' worth


class Route(NamedTuple):
    """An API path: its endpoint ("responses", "response", "input_items" or
    "cancel"), the response id in it, and the query."""

    endpoint: str
    response_id: str
    query: dict[str, str]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # An answer's head and body go out in two sends: with Nagle's algorithm a
    # share of them would wait 40 ms for a delayed ACK, as no real API server does.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    @property
    def model(self) -> ResponsesModel:
        return self.server.model

    def _credential(self) -> str:
        return self.headers.get("authorization") or self.headers.get("api-key") or ""

    def _route(self, method: str, *endpoints: str) -> Route:
        """This request's path, if it names one of ``endpoints``."""
        url = urlsplit(self.path)
        match = ROUTE.match(url.path)
        endpoint = match and ("responses" if match["id"] is None else match["action"] or "response")
        if endpoint not in endpoints:
            raise errors.invalid_url(method, self.path)
        return Route(endpoint, match["id"] or "", dict(parse_qsl(url.query)))

    def _read_body(self, rate: int = 0) -> bytes:
        """The request body, read ``rate`` bytes a second when given (a slow
        uplink), decoded when the client compressed it (zstd, gzip, deflate
        or br, as the API's servers take them; a body that does not decode
        is read as it is, and refused as one that is not JSON)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            body = self._read_chunked()
        else:
            length = int(self.headers.get("content-length") or 0)
            body = self._read_paced(length, rate) if rate else self.rfile.read(length) if length else b""
        self.raw_sha256 = hashlib.sha256(body).hexdigest()
        self.body_encoding = self.headers.get("content-encoding", "").strip().lower()
        try:
            return _decoded(body, self.body_encoding)
        except (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError, brotli.error):
            return body

    def _read_chunked(self) -> bytes:
        """A chunked request body, as every real HTTP/1.1 server accepts."""
        body = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(body)
            body += self.rfile.read(size)
            self.rfile.readline()

    def _read_paced(self, length: int, rate: int) -> bytes:
        step = max(1, int(rate * PACED_READ_INTERVAL_S))
        body = bytearray()
        start = time.monotonic()
        while len(body) < length:
            chunk = self.rfile.read(min(step, length - len(body)))
            if not chunk:
                break
            body += chunk
            ahead = len(body) / rate - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)
        return bytes(body)

    def _gzips(self) -> bool:
        """Answers go gzipped when set and the client accepts gzip, as servers do."""
        accepted = {part.split(";")[0].strip().lower() for part in self.headers.get("accept-encoding", "").split(",")}
        return self.model.faults.gzip and "gzip" in accepted

    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        headers = {"content-type": "application/json"}
        if self._gzips() and status < 400:
            data = gzip.compress(data)
            headers["content-encoding"] = "gzip"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: APIError) -> None:
        self._send_json(error.status, error.body)

    def _send_html(self) -> None:
        """A proxy's error page with status 200: what the ``html`` fault sends."""
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(HTML_PAGE)))
        self.end_headers()
        self.wfile.write(HTML_PAGE)

    def _openai_conversations(self, method: str, body: bytes) -> bool:
        """Answer a request to the Conversations API; False when the path is
        not one. An upstream without the API (the ``conversations`` fault) has
        no such paths (404), or has them for other methods only (405)."""
        url = urlsplit(self.path)
        match = OPENAI_CONVERSATIONS_ROUTE.match(url.path)
        if not match:
            return False
        names = "item" if match["item"] else "items" if match["items"] else \
            "conversation" if match["conversation"] else "conversations"
        endpoint = OPENAI_CONVERSATIONS_ENDPOINTS.get((method, names))
        try:
            if self.model.faults.conversations == "not_allowed":
                raise errors.method_not_allowed()
            if endpoint is None or self.model.faults.conversations is not None:
                raise errors.invalid_url(method, self.path)
            call = ConversationsCall(match["conversation"] or "", match["item"] or "",
                                     _parsed(body) if body else {}, tuple(parse_qsl(url.query)))
            self._send_json(200, self.model.conversations_endpoint(endpoint, self._credential(), call))
        except APIError as e:
            self._send_error(e)
        return True

    def do_GET(self) -> None:
        if self.headers.get("upgrade", "").lower() == "websocket" and ROUTE.match(urlsplit(self.path).path):
            self._upgrade()
            return
        body = self._read_body()
        if self.path == "/_emulator/log":
            self._send_json(200, self.model.snapshot_log())
            return
        if self._openai_conversations("GET", body):
            return
        if MODELS_ROUTE.match(urlsplit(self.path).path):
            self._send_json(200, MODELS)
            return
        try:
            route = self._route("GET", "response", "input_items")
            listing = route.endpoint == "input_items"
            fault = self.model.endpoint_fault("input_items" if listing else "retrieve") or {}
            if fault.get("kind") == "stall":  # a slow answer: it comes, late
                time.sleep(fault.get("ms", 0) / 1000)
            elif fault.get("kind") == "status":
                raise errors.server_error(fault.get("status", 500))
            if listing and self.model.faults.input_items == "absent":
                raise errors.invalid_url("GET", self.path)
            if listing:
                self._send_json(200, self.model.list_input_items(self._credential(), route.response_id, route.query))
            elif route.query.get("stream") == "true":
                self._resume(route)
            else:
                self._send_json(200, self.model.retrieve(self._credential(), route.response_id))
        except APIError as e:
            self._send_error(e)

    def _upgrade(self) -> None:
        """``GET /v1/responses`` asking for a WebSocket: WebSocket mode
        (websocket.py), unless refused with an HTTP status, as the API refuses
        an upgrade without a credential (401) and a server without the mode
        answers a GET on the path (404 ``Invalid URL``: the ``websocket``
        fault ``refuse``; ``unavailable``: 503, a server that has it but not now;
        ``close``: accepted and closed before any event, as LiteLLM's pass-through does;
        ``silent``: never answered)."""
        self.close_connection = True
        credential = self._credential()
        try:
            self._route("GET", "responses")
            if self.model.faults.websocket == "refuse":
                raise errors.invalid_url("GET", self.path)
            if self.model.faults.websocket == "unavailable":
                raise errors.server_error(503)
            if not credential:
                raise errors.missing_api_key()
        except APIError as e:
            self._send_error(e)
            return
        ws = ResponsesSocket(self.model, self.connection, self.rfile, credential)
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]
        with self.server.serving(ws):
            if self.model.faults.websocket == "silent":
                ws.serve()  # the upgrade is never answered: read until the client gives up
                return
            if ws.handshake(self.path, headers):
                if self.model.faults.websocket == "close":
                    ws.close()  # accepted, then closed before any event
                    return
                ws.serve()

    def do_DELETE(self) -> None:
        if self._openai_conversations("DELETE", self._read_body()):
            return
        try:
            route = self._route("DELETE", "response")
            self._send_json(200, self.model.delete(self._credential(), route.response_id))
        except APIError as e:
            self._send_error(e)

    def do_POST(self) -> None:
        if self.path == "/_emulator/control":
            self._send_json(200, self.model.control(json.loads(self._read_body() or b"{}")))
            return
        body = self._read_body(self.model.faults.read_rate_bytes_per_s)
        if self._openai_conversations("POST", body):
            return
        url = urlsplit(self.path)
        try:
            for pattern, api in CONVERSATION_ROUTES:
                if match := pattern.match(url.path):
                    self._converse(api, Call(_parsed(body), {k.lower(): v for k, v in self.headers.items()},
                                             match.groupdict(), dict(parse_qsl(url.query)), len(body),
                                             self.raw_sha256))
                    return
            if COMPACT_ROUTE.match(url.path):
                self._compact(body)
                return
            route = self._route("POST", "responses", "cancel")
            if route.endpoint == "cancel":
                self._send_json(200, self.model.cancel(self._credential(), route.response_id))
            else:
                self._create(body)
        except APIError as e:
            self._send_error(e)

    def _compact(self, body: bytes) -> None:
        """``POST /v1/responses/compact`` (compaction.py), or a server without it."""
        mode = self.model.faults.compaction
        if mode == "not_allowed":
            raise errors.method_not_allowed()
        if mode is not None:
            raise errors.invalid_url("POST", self.path)
        self._think()
        self._send_json(200, self.model.compact(self._credential(), _parsed(body), len(body), self.raw_sha256))

    def _converse(self, api: ConversationAPI, call: Call) -> None:
        """A request to one of the other conversation APIs: answered as JSON or
        streamed as that API streams, unless a fault says otherwise."""
        self._think()
        answer, conversation, fault = self.model.converse(api, call)
        kind = (fault or {}).get("kind")
        if kind == "reset":
            self._reset_connection()
        elif kind == "html":
            self._send_html()
        elif not conversation.stream:
            self._send_json(200, answer)
        else:
            content_type, frames = api.stream(conversation, answer)
            self._stream(api.answer_id(answer), frames, content_type, fault)

    def _create(self, body: bytes) -> None:
        parsed = _parsed(body)
        credential = self._credential()
        if not (isinstance(parsed, dict) and parsed.get("background") and self.model.answers_background_at_once()):
            self._think()  # a background response is queued (or refused) at once; it thinks in the background
        response, fault = self.model.create(credential, parsed, len(body), self.raw_sha256,
                                             self.body_encoding)
        fault = fault or {}
        kind = fault.get("kind")
        if kind == "reset":
            self._reset_connection()
        elif kind == "html":
            self._send_html()
        elif not parsed.get("stream"):
            self._send_json(200, response)
        else:
            obfuscation = wants_obfuscation(parsed)
            if kind == "stream_error":
                events: Iterable[dict] = error_events(response, errors.STREAM_ERROR)
            elif response["background"]:
                events = self._follow_background(credential, response, obfuscation)
            else:
                events = sse_events(response, fault.get("terminal_event"), obfuscation=obfuscation)
            self._stream(response["id"], (encode_event(event) for event in events), "text/event-stream; charset=utf-8",
                         fault)

    def _resume(self, route: Route) -> None:
        """``GET /responses/{id}?stream=true[&starting_after=N]``: a background
        response's events from the first (or after ``N``), then each later one
        as it comes, as the API replays a background stream. A response that
        was not made in the background has no stream to replay (404, as the API
        answers)."""
        credential = self._credential()
        current = self.model.retrieve(credential, route.response_id)
        if not current["background"]:
            raise errors.response_not_found(route.response_id)
        after = route.query.get("starting_after")
        if after is not None and not after.lstrip("-").isdigit():
            raise errors.invalid_type("starting_after", "an integer", after)
        first = int(after) + 1 if after is not None else 0
        events = (event for event in self._follow_background(credential, current, True)
                  if event["sequence_number"] >= first)
        self._stream(route.response_id, (encode_event(event) for event in events),
                     "text/event-stream; charset=utf-8", None)

    def _follow_background(self, credential: str, queued: dict, obfuscation: bool) -> Iterator[dict]:
        """A streamed background response's events: created and queued at once,
        then each later one once its state is reached. The stream ends when it
        finishes, or without a terminal event when it is cancelled or deleted."""
        current, sent = queued, 0
        while True:
            events = background_events(current, obfuscation=obfuscation)
            yield from events[sent:]
            sent = len(events)
            if current["status"] in TERMINAL_EVENT:
                return
            time.sleep(BACKGROUND_POLL_S)
            try:
                current = self.model.retrieve(credential, current["id"])
            except APIError:
                return
            if current["status"] == "cancelled":
                return

    def _think(self) -> None:
        if think_ms := self.model.faults.think_ms:
            time.sleep(think_ms / 1000)

    def _reset_connection(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.connection.close()
        self.close_connection = True

    def _stream(self, response_id: str, frames: Iterable[bytes], content_type: str, fault: dict | None) -> None:
        """Send ``frames`` as they come, chunked (gzipped when set), pausing
        ``slow_ms`` after each; after ``after_events`` of them a ``cut`` fault
        resets the connection, an ``end`` fault ends the stream there."""
        faults = self.model.faults
        kind, after = (fault or {}).get("kind"), (fault or {}).get("after_events", 0)
        compress = zlib.compressobj(wbits=16 + zlib.MAX_WBITS) if self._gzips() else None
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("transfer-encoding", "chunked")
        self.send_header("cache-control", "no-cache")
        if compress:
            self.send_header("content-encoding", "gzip")
        self.end_headers()

        def chunk(data: bytes) -> None:
            if compress:
                data = compress.compress(data) + compress.flush(zlib.Z_SYNC_FLUSH)
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        sent = bytearray()
        for n, data in enumerate(frames):
            if kind == "cut" and n >= after:
                self._reset_connection()
                return
            if kind == "end" and n >= after:
                break
            sent += data
            self.model.record_stream(response_id, bytes(sent))
            chunk(data)
            if faults.slow_ms:
                time.sleep(faults.slow_ms / 1000)
        if compress:
            tail = compress.flush()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(tail), tail))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _decoded(body: bytes, encoding: str) -> bytes:
    if not body or encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":  # zlib-wrapped by the standard, raw from some clients
        return zlib.decompress(body, zlib.MAX_WBITS if body[0] & 0x0F == 8 else -zlib.MAX_WBITS)
    if encoding == "br":
        return brotli.decompress(body)
    if encoding == "zstd":  # every frame, as zstd's own tools read a body; a truncated one is refused
        frames, context = [], zstandard.ZstdDecompressor()
        while body:
            frame = context.decompressobj()
            frames.append(frame.decompress(body))
            if not frame.eof:
                raise ValueError("truncated zstd frame")
            body = frame.unused_data
        return b"".join(frames)
    raise ValueError(f"content-encoding {encoding!r}")


def _parsed(body: bytes) -> Any:
    """The JSON body, or None when it is not JSON (each API refuses that its own way)."""
    try:
        return json.loads(body)
    except ValueError:
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many agents connecting at once, as a real API server takes them
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], model: ResponsesModel) -> None:
        super().__init__(address, _Handler)
        self.model = model
        self._sockets: set[ResponsesSocket] = set()
        self._connections: set[socket.socket] = set()
        self._sockets_lock = threading.Lock()
        self._stopping = False

    def process_request(self, request, client_address) -> None:
        with self._sockets_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._sockets_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone before its answer came (one that gave up waiting) is no error of the server's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @contextmanager
    def serving(self, ws: ResponsesSocket) -> Iterator[None]:
        """Track a WebSocket from its upgrade on, so that stopping closes it
        (one upgraded while the server stops is closed at once)."""
        with self._sockets_lock:
            self._sockets.add(ws)
            if self._stopping:
                ws.close()
        try:
            yield
        finally:
            with self._sockets_lock:
                self._sockets.discard(ws)

    def open_sockets(self) -> int:
        with self._sockets_lock:
            return len(self._sockets)

    def close_sockets(self) -> None:
        """Close every open WebSocket, and from now on each one as it upgrades;
        end every kept-alive connection, as a server that stops does (its
        handler threads would otherwise go on answering on them)."""
        with self._sockets_lock:
            self._stopping = True
            for ws in self._sockets:
                ws.close()
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Emulator:
    """The emulator in a background thread: ``with Emulator() as emu: emu.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int = 0,
                 certfile: str | None = None, keyfile: str | None = None,
                 model: ResponsesModel | None = None) -> None:
        self.model = model or ResponsesModel(seed)  # a model of a stopped emulator: the same upstream restarted
        self._server = _Server((host, port), self.model)
        self.scheme = "http"
        if certfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        # a short poll interval: stop() returns within 50 ms instead of 0.5 s
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="responses-emulator", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def open_sockets(self) -> int:
        """How many WebSockets are open on it now: a test waits for a socket's upgrade, or its close."""
        return self._server.open_sockets()

    def start(self) -> Emulator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.close_sockets()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
