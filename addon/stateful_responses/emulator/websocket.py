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
import itertools
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


def error_event(error: APIError, status_field: str = "status") -> dict:
    """A refusal on the socket: openai-python's ``ResponseWsError`` (the HTTP
    status beside the API's error object, and no sequence number: it is not
    part of a response's stream). ``status_field``: how the server names the
    status (``status_code``, or ``none`` to leave it out); headers go where
    the SDK (``error.headers``) and codex-rs (top level) read them."""
    event: dict = {"type": "error"}
    if status_field != "none":
        event[status_field] = error.status
    event["error"] = dict(error.body["error"])
    if error.headers:
        event["error"]["headers"] = event["headers"] = dict(error.headers)
    return event


class ResponsesSocket:
    """One upgraded connection. A reader thread turns frames into messages on a
    queue; the handler's thread takes them in order and starts each accepted
    turn on a thread of its own, so that lanes (``stream_id``) run at once; a
    ``response.create`` on a lane still running a response is refused at once
    (the model's rule), and ``response.steer`` queues input for the
    successor of the response it names."""

    def __init__(self, model: ResponsesModel, connection: socket.socket, rfile: Any, credential: str) -> None:
        self.model = model
        self.connection = connection
        self.rfile = rfile
        self.session = SocketSession(credential)
        self._ws = WSConnection(ConnectionType.SERVER)
        self._lock = threading.Lock()  # the wsproto state and the socket's writes, shared with the reader
        self._messages: queue.Queue[bytes | None] = queue.Queue()  # None: no more will come
        self._closed = threading.Event()  # the client went away: every running turn stops
        self._signal = threading.Condition()  # notified on each message taken and when the client goes away
        self._received = 0  # messages taken so far
        self._turns: list[threading.Thread] = []
        self._steers: dict[str, list] = {}  # a running response's id -> the steering input accepted for it
        self._steer_ids = itertools.count(1)

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
                self._dispatch(message)
        except (OSError, LocalProtocolError):
            pass  # the client went away: nothing is left to answer
        finally:
            self._closed.set()
            with self._signal:
                self._signal.notify_all()
            self.close()
            for turn in self._turns:
                turn.join()
            reader.join()

    def close(self) -> None:
        """End the connection's reading (and so its serving) from any thread."""
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- a turn ----------------------------------------------------------------

    def _dispatch(self, message: bytes) -> None:
        """One client message: steering, or a ``response.create`` answered by
        the model, whose events a thread of the turn's own sends; a refused
        message is one ``error`` event, sent at once (it never reaches the
        model), naming its lane."""
        with self._signal:
            self._received += 1
            self._signal.notify_all()
        body = _parsed(message)
        if isinstance(body, dict) and body.get("type") == "response.steer":
            self._steer(body)
            return
        lane = body.get("stream_id") if isinstance(body, dict) else None
        try:
            response, fault = self.model.create_on_socket(self.session, body, len(message),
                                                          hashlib.sha256(message).hexdigest())
        except APIError as e:
            self._send_json(_on_lane(error_event(e, self.model.faults.ws_error_status), lane))
            return
        self.session.running[lane] = response["id"]
        self._turns = [t for t in self._turns if t.is_alive()]
        turn = threading.Thread(target=self._turn, args=(body, response, fault or {}, lane),
                                name="responses-websocket-turn", daemon=True)
        self._turns.append(turn)
        turn.start()

    def _turn(self, body: dict, response: dict, fault: dict, lane: Any) -> None:
        """A response's events, paced by ``think_ms`` and ``slow_ms`` as over
        HTTP; the ``ws_stall`` fault is a silence of the turn's (pings still
        answered). Steering accepted meanwhile ends it at its output's end
        (``response.incomplete``, ``steered``) and starts its successor."""
        try:
            while (after := self._events(body, response, fault, lane)) is not None:
                response, fault = after, {}
        except (ClientGone, OSError, LocalProtocolError):
            pass  # the client went away mid-turn: nothing is left to answer
        finally:
            if self.session.running.get(lane) == response["id"]:  # not the lane's next response already
                self.session.running.pop(lane, None)

    def _events(self, body: dict, response: dict, fault: dict, lane: Any) -> dict | None:
        """Send one response's events; its successor's, if steering made one."""
        kind = fault.get("kind")
        if kind == "stream_error":
            events = error_events(response, errors.STREAM_ERROR)
        else:
            events = sse_events(response, fault.get("terminal_event"), obfuscation=wants_obfuscation(body))
        if self.model.faults.echo_previous == "terminal":  # a server whose early events leave the echo out
            events = [{**e, "response": {k: v for k, v in e["response"].items() if k != "previous_response_id"}}
                      if "response" in e and n < len(events) - 1 else e for n, e in enumerate(events)]
        received = self._received  # a stall that ends on a message ends on one after the turn began
        self._pause(self.model.faults.think_ms)
        sent: list[str] = []
        for n, event in enumerate(events):
            if kind == "ws_close" and n >= fault.get("after_events", 0):
                self._drop(fault.get("code"))
                return None
            if kind == "ws_stall" and n == fault.get("after_events", 0):
                self._pause(fault.get("ms", STALL_MS), received if fault.get("until_message") else None)
            if n == len(events) - 1 and (steering := self._steers.pop(response["id"], None)) is not None:
                return self._steered(body, response, event, sent, steering, lane)
            if n == len(events) - 1 and not (kind == "ws_stall" and fault.get("after_events", 0) >= len(events)):
                self.session.running.pop(lane, None)  # done once its terminal event is out: the next may start
            sent.append(self._send_json(_on_lane(event, lane)))
            self.model.record_messages(response["id"], sent)
            if n < len(events) - 1:  # after the terminal event the response is done: the next may start
                self._pause(self.model.faults.slow_ms)
        if kind == "ws_stall" and fault.get("after_events", 0) >= len(events):
            self._pause(fault.get("ms", STALL_MS))  # its events are all sent, yet the turn still runs
        return None

    def _steered(self, body: dict, response: dict, terminal: dict, sent: list[str], steering: list,
                 lane: Any) -> dict | None:
        """End a steered response (``response.incomplete``, ``steered``) and
        create its successor: the response's settings, continued from it with
        the steering input (the successor's ``response.created`` commits it)."""
        self.model.steered(response)
        self.session.running.pop(lane, None)
        sent.append(self._send_json(_on_lane({"type": "response.incomplete", "response": response,
                                              "sequence_number": terminal.get("sequence_number")}, lane)))
        self.model.record_messages(response["id"], sent)
        successor = {key: value for key, value in body.items() if key not in ("input", "previous_response_id")}
        successor.update(input=steering, previous_response_id=response["id"])
        message = json.dumps(successor).encode()
        try:
            after, _ = self.model.create_on_socket(self.session, successor, len(message),
                                                   hashlib.sha256(message).hexdigest())
        except APIError as e:
            self._send_json(_on_lane(error_event(e, self.model.faults.ws_error_status), lane))
            return None
        self.session.running[lane] = after["id"]
        body.clear()
        body.update(successor)
        return after

    def _steer(self, body: dict) -> None:
        """``response.steer``: accepted for a response still running (it ends
        at its output's end and a successor takes the input), else failed."""
        target, steering = body.get("previous_response_id"), body.get("input")
        lanes = [lane for lane, running in self.session.running.items() if running == target]
        items = [{"role": "user", "content": steering}] if isinstance(steering, str) else steering
        if not lanes or not isinstance(items, list) or not items:
            code = "invalid_input" if lanes else "response_not_active"
            self._send_json({"type": "response.steer.failed", "sequence_number": 0,
                             "steer": {"input": steering, "previous_response_id": target},
                             "error": {"type": "invalid_request_error", "code": code,
                                       "message": "The steering input is not valid." if lanes
                                       else "The response is no longer accepting steering input."}})
            return
        self._steers.setdefault(target, []).extend(items)
        self._send_json(_on_lane({"type": "response.steer.accepted", "sequence_number": 0,
                                  "steer": {"id": f"steer_{next(self._steer_ids)}", "previous_response_id": target}},
                                 lanes[0]))

    def _pause(self, ms: float, received: int | None = None) -> None:
        """Wait ``ms``, or until the client goes away; given ``received``, only
        until a message beyond that many arrives."""
        deadline = time.monotonic() + ms / 1000
        with self._signal:
            while not self._closed.is_set() and (received is None or self._received == received) \
                    and (remaining := deadline - time.monotonic()) > 0:
                self._signal.wait(remaining)
        if self._closed.is_set():
            raise ClientGone

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


def _on_lane(event: dict, lane: Any) -> dict:
    """An event as a lane sends it: naming its ``stream_id`` (the default lane names none)."""
    return event if lane is None else {**event, "stream_id": lane}


def _parsed(message: bytes) -> Any:
    """The message's JSON, or None when it is not JSON (refused as the API refuses a body that is not)."""
    try:
        return json.loads(message)
    except ValueError:
        return None
