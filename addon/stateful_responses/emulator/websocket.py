"""WebSocket mode: the Responses API over one socket on the HTTP port
(``GET /v1/responses`` with ``Upgrade: websocket``), as OpenAI's WebSocket mode
guide and openai-python's ``responses.connect()`` describe it.

Each client message is a ``response.create`` (the create body plus ``type``);
each turn is answered with exactly the events the HTTP stream of that request
carries, one JSON text message each, with no SSE framing. A refused message is
answered with one ``error`` event carrying the HTTP status the API would have
given. The API's semantics, the socket's memory of its latest response among
them, are the model's (``ResponsesModel.create_on_socket``).

The handshake and the framing are wsproto's: it ships with mitmproxy, so the
emulator needs nothing more, and its sans-IO design fits the blocking handler's
socket. Extensions (permessage-deflate) are declined, as a server may.
"""

from __future__ import annotations

import hashlib
import json
import queue
import socket
import threading
import time
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Event, Ping, RejectConnection, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from . import errors
from .errors import APIError
from .model import ResponsesModel, SocketSession
from .sse import error_events, sse_events, wants_obfuscation

READ_SIZE = 65536
STALL_MS = 3_600_000  # the ws_stall fault's silence when it names none: until the client gives up


class ClientGone(ConnectionError):
    """The client closed the socket (or the connection broke) while a turn ran."""


def error_event(error: APIError) -> dict:
    """A refusal on the socket: openai-python's ``ResponseWsError`` (the HTTP
    status beside the API's error object, and no sequence number: it is not
    part of a response's stream)."""
    return {"type": "error", "status": error.status, "error": error.body["error"]}


class ResponsesSocket:
    """One upgraded connection. A reader thread turns frames into messages on a
    queue; the handler's thread answers them a turn at a time, and meanwhile
    answers each message that arrives while the turn runs (the API refuses a
    second ``response.create`` on a busy socket)."""

    def __init__(self, model: ResponsesModel, connection: socket.socket, rfile: Any, credential: str) -> None:
        self.model = model
        self.connection = connection
        self.rfile = rfile
        self.session = SocketSession(credential)
        self._ws = WSConnection(ConnectionType.SERVER)
        self._lock = threading.Lock()  # the wsproto state and the socket's writes, shared with the reader
        self._messages: queue.Queue[bytes | None] = queue.Queue()  # None: no more will come

    def handshake(self, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        """Answer the upgrade request the HTTP handler has read: 101, or the
        HTTP error wsproto gives a malformed handshake. True once open (False
        too when the connection is already gone: closed by a stopping server)."""
        try:
            self._ws.initiate_upgrade_connection(headers, path)
        except RemoteProtocolError as e:
            answer, accepted = self._ws.send(e.event_hint or RejectConnection(status_code=400)), False
        else:
            answer, accepted = self._ws.send(AcceptConnection()), True
        try:
            self.connection.sendall(answer)
        except OSError:
            return False
        return accepted

    def serve(self) -> None:
        """Answer messages until the client closes the socket or it breaks."""
        reader = threading.Thread(target=self._read, name="responses-websocket-reader", daemon=True)
        reader.start()
        try:
            while (message := self._messages.get()) is not None:
                self._turn(message)
        except (OSError, LocalProtocolError):
            pass  # the client went away mid-turn: nothing is left to answer
        finally:
            self.close()
            reader.join()

    def close(self) -> None:
        """End the connection's reading (and so its serving) from any thread."""
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- a turn ----------------------------------------------------------------

    def _turn(self, message: bytes) -> None:
        """One client message: the model's answer to it, sent as events paced
        by ``think_ms`` and ``slow_ms`` as over HTTP, or one ``error`` event,
        sent at once (a refused message never reaches the model). The
        ``ws_stall`` fault is a silence of the turn's (pings still answered)."""
        body = _parsed(message)
        try:
            response, fault = self.model.create_on_socket(self.session, body, len(message),
                                                          hashlib.sha256(message).hexdigest())
        except APIError as e:
            self._send_json(error_event(e))
            return
        fault = fault or {}
        kind = fault.get("kind")
        if kind == "stream_error":
            events = error_events(response, errors.STREAM_ERROR)
        else:
            events = sse_events(response, fault.get("terminal_event"), obfuscation=wants_obfuscation(body))
        self.session.running = response["id"]
        try:
            self._pause(self.model.faults.think_ms)
            sent: list[str] = []
            for n, event in enumerate(events):
                if kind == "ws_close" and n >= fault.get("after_events", 0):
                    self._drop(fault.get("code"))
                    return
                if kind == "ws_stall" and n == fault.get("after_events", 0):
                    self._pause(fault.get("ms", STALL_MS))
                sent.append(self._send_json(event))
                self.model.record_messages(response["id"], sent)
                if n < len(events) - 1:  # after the terminal event the response is done: the next may start
                    self._pause(self.model.faults.slow_ms)
            if kind == "ws_stall" and fault.get("after_events", 0) >= len(events):
                self._pause(fault.get("ms", STALL_MS))  # its events are all sent, yet the turn still runs
        finally:
            self.session.running = None

    def _pause(self, ms: float) -> None:
        """Wait ``ms`` while answering each message that arrives meanwhile: a
        turn is running, so the model refuses every one of them at once."""
        deadline = time.monotonic() + ms / 1000
        while True:
            try:
                message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if message is None:
                self._messages.put(None)  # for the serving loop, once this turn gives up
                raise ClientGone
            self._turn(message)

    def _drop(self, code: int | None) -> None:
        """The ``ws_close`` fault: a close frame with ``code``, or, without one,
        the connection dropped with no close frame (the client sees 1006)."""
        if code is not None:
            self._send(CloseConnection(code=code))
        else:
            self.close()

    # -- frames ----------------------------------------------------------------

    def _send_json(self, event: dict) -> str:
        text = json.dumps(event)
        self._send(TextMessage(data=text))
        return text

    def _send(self, event: Event) -> None:
        with self._lock:
            self.connection.sendall(self._ws.send(event))

    def _read(self) -> None:
        """Frames in, messages out: each complete message (text, or binary
        holding the same JSON) is queued; a ping is answered; a close is
        answered and ends the queue, as does a broken connection. Reads are
        paced by ``read_rate_bytes_per_s``, as HTTP bodies are."""
        parts: list[bytes] = []
        paced_until = time.monotonic()
        try:
            while data := self.rfile.read1(READ_SIZE):
                if rate := self.model.faults.read_rate_bytes_per_s:  # a slow uplink, as for HTTP bodies
                    paced_until = max(paced_until, time.monotonic()) + len(data) / rate
                    time.sleep(max(0.0, paced_until - time.monotonic()))
                with self._lock:
                    self._ws.receive_data(data)
                    events = list(self._ws.events())
                for event in events:
                    if isinstance(event, (TextMessage, BytesMessage)):
                        parts.append(event.data.encode() if isinstance(event.data, str) else bytes(event.data))
                        if event.message_finished:
                            self._messages.put(b"".join(parts))
                            parts = []
                    elif isinstance(event, Ping):
                        self._send(event.response())
                    elif isinstance(event, CloseConnection):
                        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                            self._send(event.response())
                        return
        except (OSError, LocalProtocolError):
            pass
        finally:
            self._messages.put(None)


def _parsed(message: bytes) -> Any:
    """The message's JSON, or None when it is not JSON (refused as the API refuses a body that is not)."""
    try:
        return json.loads(message)
    except ValueError:
        return None
