"""The loopback server mitmproxy relays a bridged answer from. Pure: asyncio.

An addon cannot stream an answer it makes itself; mitmproxy streams one it
reads from a server (verified on mitmproxy 11 and 12). So a bridged flow is pointed at this server
(127.0.0.1, a port of its own, in mitmproxy's event loop) with an unguessable
token for a path; the answer is written here as the upstream's events arrive,
and mitmproxy relays each chunk on. HTTP/1.1 with keep-alive, as mitmproxy
speaks to servers; an answer cut short drops the connection, as a dropped
upstream connection would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus

from .messages import JSON_HEADERS, SSE_HEADERS, sse_event

logger = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # mitmproxy's request to this server carries a few short headers
PATH_PREFIX = "/stateful-websocket/"


class Answer:
    """The client's answer to one turn, written as it comes."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader | None = None) -> None:
        self._writer = writer
        self._reader = reader
        self.started = False  # its head is written: the client may have bytes of it
        self.complete = False
        self.gone = False  # the connection broke: nobody listens any more

    @property
    def abandoned(self) -> bool:
        """Whether nobody waits for the answer: the connection broke, or
        mitmproxy closed it (its client went away)."""
        return self.gone or (self._reader is not None and self._reader.at_eof())

    async def event(self, event_type: str | None, text: bytes) -> None:
        """One upstream event, as the HTTP API streams it (the head goes with the first)."""
        data = sse_event(event_type, text)
        chunk = b"%x\r\n%s\r\n" % (len(data), data)
        if not self.started:
            self.started = True
            chunk = self._head_bytes(200, SSE_HEADERS, b"transfer-encoding", b"chunked") + chunk
        await self._send(chunk)

    async def end_stream(self) -> None:
        self.complete = True
        await self._send(b"0\r\n\r\n")

    async def whole(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        """An answer in one piece: a JSON response, an error, an HTTP retry's answer (head and body in one
        write: one wake-up of mitmproxy's reading side, not two). Headers are bytes, as they came (a value
        outside latin-1 passes as the upstream sent it)."""
        self.started = self.complete = True
        await self._send(self._head_bytes(status, headers, b"content-length", b"%d" % len(body)) + body)

    async def json(self, status: int, body: bytes) -> None:
        await self.whole(status, JSON_HEADERS, body)

    def drop(self) -> None:
        """End the connection mid-answer: the client sees its stream break."""
        self.gone = True
        self._writer.transport.abort()

    @staticmethod
    def _head_bytes(status: int, headers: Sequence[tuple[bytes, bytes]], length_name: bytes, length: bytes) -> bytes:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"HTTP/1.1 {status} {reason}".encode(), *(k + b": " + v for k, v in headers), length_name + b": " + length]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _send(self, data: bytes) -> None:
        """Write and wait while mitmproxy reads behind (a slow client): memory
        stays bounded. A broken connection is noted, never raised: the turn
        still reads its socket to the end."""
        if self.gone:
            return
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, RuntimeError):
            self.gone = True


Serve = Callable[[str, Answer], Awaitable[None]]


class Loopback:
    """The server; ``serve(token, answer)`` answers one request."""

    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()  # the first requests arrive together: one server
        self._writers: set[asyncio.StreamWriter] = set()  # its open connections
        self.port = 0

    async def start(self) -> None:
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0, limit=MAX_HEAD)
                self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        """Stop serving, and end the connections mitmproxy keeps open to it (idle keep-alives)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (token := await _read_request(reader)) is not None:
                answer = Answer(writer, reader)
                await self._serve(token, answer)
                if not answer.complete or answer.gone:
                    break
        except asyncio.CancelledError:
            # mitmproxy is stopping (its loop cancels what still runs): the connection ends with it, quietly.
            # Re-raised, Python 3.11's stream callback would log the cancellation as a traceback.
            pass
        except Exception:  # noqa: BLE001 - one broken connection must not end the server
            logger.warning("stateful-responses: the WebSocket bridge's loopback connection broke", exc_info=False)
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()


async def _read_request(reader: asyncio.StreamReader) -> str | None:
    """The next request's token (its body, empty from mitmproxy, is read and
    dropped); None when the connection ends or holds no request of ours."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[1].startswith(PATH_PREFIX):
        return None
    headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                await reader.readexactly(size + 2)
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
        elif length := int(headers.get("content-length") or 0):
            await reader.readexactly(length)
    except (ValueError, asyncio.IncompleteReadError, ConnectionError):
        return None
    return parts[1][len(PATH_PREFIX):]
