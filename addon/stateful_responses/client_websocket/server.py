"""The loopback WebSocket server a client's upgrade is pointed at, and one
socket's session: its lanes, its queue, its memory, its lifetime. Pure:
asyncio and ``websockets`` (its server), no mitmproxy.

mitmproxy cannot answer an upgrade itself without an upstream, so the addon
points the client's upgrade at this server (127.0.0.1, a port of its own, an
unguessable token for a path) and mitmproxy relays every message between the
client and it. Each ``response.create`` becomes one HTTP request the addon
sends through mitmproxy's own pipeline (``post``); its SSE events come back
here and go to the client, one text message each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from ..answer_reader import SSEParser, Unreadable
from ..logs import SOCKETS
from .protocol import (
    LIFETIME_S,
    MAX_ACTIVE,
    MAX_NAMED_LANES,
    Create,
    Ignored,
    Invalid,
    Memory,
    Outcome,
    Remembered,
    Steer,
    error_event,
    framed,
    http_body,
    lane_limit,
    lifetime_limit,
    not_found,
    read_message,
    steer_failed,
    upstream_error,
    warm_up,
)

logger = logging.getLogger(__name__)

PATH_PREFIX = "/stateful-client-websocket/"
IDLE_S = 900.0  # a socket with no message and no turn this long is closed (1000)
MAX_MESSAGE = 64 * 1024 * 1024  # the largest client message taken (a long history resent whole)
MAX_ERROR_BODY = 1024 * 1024  # of an upstream's refusal, what is read for its error object
WATCH_S = 5.0  # lifetime and idleness are looked at this often


@dataclass
class Posted:
    """A turn's HTTP request under way. Its answer arrives on ``parts``:
    ``("head", status)``, then ``("data", bytes)`` as it streams, then
    ``("end", None)``; ``cancel`` gives it up (the socket closed)."""

    parts: asyncio.Queue
    cancel: Callable[[], None]


Post = Callable[[bytes, int, "Create"], Posted]  # the HTTP body, the turn's place on the socket, the create


class Session:
    """One client socket: lanes run FIFO each, up to ``MAX_ACTIVE`` responses
    at once across lanes, at most ``MAX_NAMED_LANES`` distinct ``stream_id``s;
    the responses made on it are its memory (connection-local, as the mode's)."""

    def __init__(self, post: Post, clock: Callable[[], float] = time.monotonic,
                 lifetime_s: float = LIFETIME_S, idle_s: float = IDLE_S) -> None:
        self.post = post
        self.clock = clock
        self.lifetime_s = lifetime_s
        self.idle_s = idle_s
        self.memory = Memory()
        self.turns = 0  # creates taken, warm-ups included: each turn's place on the socket
        self.opened = clock()
        self.last_message = self.opened
        self._active = asyncio.Semaphore(MAX_ACTIVE)
        self._queues: dict[str | None, deque[tuple[Create, int]]] = {}
        self._workers: dict[str | None, asyncio.Task] = {}
        self._named: set[str] = set()
        self._connection: ServerConnection | None = None
        self.closed = asyncio.Event()  # the socket is gone: its turns given up, its memory dropped

    @property
    def busy(self) -> bool:
        return bool(self._workers)

    @property
    def expired(self) -> bool:
        return self.clock() - self.opened >= self.lifetime_s

    async def run(self, connection: ServerConnection) -> None:
        """Serve the socket until it closes; every turn still running is then given up."""
        self._connection = connection
        watch = asyncio.get_running_loop().create_task(self._watch())
        try:
            async for message in connection:
                self.last_message = self.clock()
                await self._take(message.encode() if isinstance(message, str) else message)
        except ConnectionClosed:
            pass
        finally:
            watch.cancel()
            for worker in list(self._workers.values()):
                worker.cancel()
            self.memory.clear()
            self.closed.set()

    async def _take(self, text: bytes) -> None:
        try:
            message = read_message(text)
        except Invalid as e:
            await self.send(error_event(e.status, e.error, e.lane))
            return
        if isinstance(message, Ignored):
            return
        if isinstance(message, Steer):
            await self.send(steer_failed(message))
            return
        lane = message.lane
        if self.expired:
            await self.send(lifetime_limit(lane))
            return
        if lane is not None and lane not in self._named:
            if len(self._named) >= MAX_NAMED_LANES:
                await self.send(lane_limit(lane))
                return
            self._named.add(lane)  # detaching a lane does not give its id back (C9)
        self._queues.setdefault(lane, deque()).append((message, self.turns))
        self.turns += 1
        if lane not in self._workers:
            # mitmproxy 12 runs tasks eagerly: a lane whose turns need no await (a warm-up the proxy answers) is
            # done, its ``finally`` run, before create_task returns; a done worker must not be kept as the lane's
            worker = asyncio.get_running_loop().create_task(self._lane(lane))
            if not worker.done():
                self._workers[lane] = worker

    async def _lane(self, lane: str | None) -> None:
        """A lane's creates, one after the other."""
        queue = self._queues[lane]
        try:
            while queue:
                create, n = queue.popleft()
                async with self._active:
                    try:
                        await self._turn(create, n)
                    except Exception:  # noqa: BLE001 - the socket and its other turns go on
                        logger.warning("stateful-responses: internal error while serving a WebSocket turn",
                                       exc_info=False)  # never its message: it could quote the request
                        await self.send(error_event(500, {"type": "server_error", "code": None, "param": None,
                                                          "message": "The proxy could not serve this turn."},
                                                    create.lane))
        finally:
            self._queues.pop(lane, None)
            self._workers.pop(lane, None)

    async def _turn(self, create: Create, n: int) -> None:
        lane, previous = create.lane, create.previous
        parent = self.memory.get(previous) if previous is not None else None
        if previous is not None and parent is None and create.store is False:
            await self.send(not_found(previous, lane))  # a store:false turn continues this socket's responses only
            return
        # a response only the upstream holds (continued by id) is continued by id; a warm-up of one, by that id
        upstream_id = parent.upstream_id if parent is not None and parent.items is None else None
        body, whole = http_body(create, parent.items if parent is not None else None, upstream_id)
        if not create.generate:
            response_id, events = warm_up(create, lane)
            for event in events:
                await self.send(event)
            self.memory.put(response_id, Remembered(whole, lane, False, None if whole is not None
                                                    else upstream_id or previous))
            return
        posted = self.post(body, n, create)
        try:
            outcome, status, refusal = await self._relay(posted, lane)
        except BaseException:
            posted.cancel()  # the socket closed: its turns are given up, as the mode drops them
            raise
        if status is None or status >= 300:
            await self.send(upstream_error(status or 502, bytes(refusal), lane))
            if parent is not None and parent.lane == lane:
                self.memory.forget(previous)  # a same-lane continuation that failed evicts its parent (C10)
            return
        if outcome.terminal is None:
            await self.send(error_event(502, {"type": "server_error", "code": None, "param": None,
                                              "message": "The upstream's stream ended before the response did."},
                                        lane))
            return
        if outcome.terminal == "response.completed" and outcome.response_id is not None:
            items = [*whole, *outcome.output] if whole is not None and outcome.output is not None else None
            self.memory.put(outcome.response_id, Remembered(items, lane, outcome.stored))

    async def _relay(self, posted: Posted, lane: str | None) -> tuple[Outcome, int | None, bytearray]:
        """The answer's events to the client as they come, each one text message, until its terminal event:
        the lane's next create may go then (forward mode learned from the answer before this tap saw its
        last event; what the stream still carries after it, mitmproxy's hooks finish on their own)."""
        outcome, parser, refusal, status = Outcome(), SSEParser(), bytearray(), None
        while True:
            kind, value = await posted.parts.get()
            if kind == "end":
                break
            if kind == "head":
                status = value
                continue
            if status is None or status >= 300:
                if len(refusal) < MAX_ERROR_BODY:
                    refusal += value[:MAX_ERROR_BODY - len(refusal)]
                continue
            try:
                events = parser.feed(value)
            except (Unreadable, UnicodeDecodeError):
                break
            for name, data in events:
                if data == "[DONE]":
                    continue
                outcome.read(name, data)
                await self.send(framed(data, lane))
                if outcome.terminal is not None:
                    return outcome, status, refusal
        return outcome, status, refusal

    async def send(self, message: bytes) -> None:
        if self._connection is None:
            return
        try:
            await self._connection.send(message, text=True)
        except ConnectionClosed:
            pass

    async def _watch(self) -> None:
        """Close the socket past its lifetime (once its turns are done: new
        creates get the mode's limit error meanwhile), or idle too long."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self._connection is None or self.busy:
                continue
            if self.expired:
                await self._connection.close(1000, "Connection lifetime exceeded")
                return
            if self.clock() - self.last_message >= self.idle_s:
                await self._connection.close(1000, "Connection idle")
                return


Claim = Callable[[str], "Session | None"]


class LoopbackServer:
    """The server; ``claim(token)`` gives the session an upgrade was pointed
    here for (once), None for a token nobody issued."""

    def __init__(self, claim: Claim) -> None:
        self._claim = claim
        self._server: Server | None = None
        self._starting = asyncio.Lock()
        self.port = 0

    async def start(self) -> None:
        async with self._starting:
            if self._server is None:
                self._server = await serve(self._serve, "127.0.0.1", 0, process_request=self._check,
                                           compression=None, max_size=MAX_MESSAGE, ping_interval=None,
                                           logger=logging.getLogger(SOCKETS))  # quiet: it would quote frames
                self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _check(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path
        session = self._claim(path[len(PATH_PREFIX):]) if path.startswith(PATH_PREFIX) else None
        if session is None:
            return connection.respond(404, "No such socket.\n")
        connection.session = session  # type: ignore[attr-defined]
        return None

    async def _serve(self, connection: ServerConnection) -> None:
        session: Session = connection.session  # type: ignore[attr-defined]
        try:
            await session.run(connection)
        except Exception:  # noqa: BLE001 - one broken socket must not end the server
            logger.warning("stateful-responses: a client WebSocket's session broke", exc_info=False)

