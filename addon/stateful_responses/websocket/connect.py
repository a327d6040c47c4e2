"""Opening a WebSocket to an upstream's Responses endpoint, the way mitmproxy
would reach that upstream: the address it would connect to, the request's
credential on the upgrade, and mitmproxy's upstream TLS options applied by hand
(a connection of our own gets none of them): ``ssl_insecure``, the trusted CAs
of ``ssl_verify_upstream_trusted_ca`` / ``_confdir`` (certifi's otherwise, as
mitmproxy does) and ``client_certs``.

The client is ``websockets``' asyncio one: it runs in mitmproxy's event loop,
keeps the framing, the close handshake and keepalive pings (a dead upstream is
found within ``PING_S`` twice), and offers permessage-deflate as Codex does (an
upstream may decline it). Compressing runs inside ``send()``, on mitmproxy's
event loop, at about 10–40 MB/s: a 16 MB turn would hold every flow for
hundreds of milliseconds. So only messages up to ``COMPRESS_UP_TO`` (a delta:
a few kB, well under a millisecond) are compressed; larger ones go as they are,
as their HTTP request would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.extensions.base import Extension
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory, PerMessageDeflate
from websockets.frames import Frame, Opcode
from websockets.protocol import State

from ..bounded import Bounded
from ..logs import SOCKETS

OPEN_TIMEOUT_S = 10.0  # connect, TLS and the upgrade; then the turn goes over HTTP
PING_S = 20.0  # a keepalive ping this often; no pong within as long closes the socket
MAX_MESSAGE = 64 * 1024 * 1024  # the largest event taken from the upstream (a long answer's terminal event)
FRAGMENT = 1024 * 1024  # a larger message goes in frames of this size (RFC 6455 fragmentation)
COMPRESS_UP_TO = 16 * 1024  # larger messages go uncompressed: deflate costs ~0.05 ms per kB of the event loop
_CONTROL = (Opcode.CLOSE, Opcode.PING, Opcode.PONG)  # never compressed (RFC 7692)


@dataclass(frozen=True)
class TLSOptions:
    """mitmproxy's options for its upstream TLS, as they stand."""

    insecure: bool = False
    ca_file: str | None = None
    ca_path: str | None = None
    client_certs: str | None = None


@dataclass(frozen=True)
class Target:
    """Where a socket goes: its URL (``ws``/``wss``, the name the upstream is
    known by, the request's path and query), that name (TLS's server name),
    the address to connect to (an address of transparent mode, say), and the
    upgrade's headers."""

    url: str
    server_name: str
    host: str
    port: int
    headers: tuple[tuple[str, str], ...]


class Refused(Exception):
    """The upstream answered the upgrade with an HTTP status: no WebSocket mode here."""

    def __init__(self, status: int) -> None:
        super().__init__(f"upgrade refused with {status}")
        self.status = status


class Unreachable(Exception):
    """The socket could not be opened (connection, TLS, a broken handshake, a timeout)."""


class LargeUncompressed(PerMessageDeflate):
    """permessage-deflate that sends a message over ``COMPRESS_UP_TO`` as it
    is, its first frame's RSV1 clear: RFC 7692 lets the sender choose per
    message, and a message left uncompressed changes neither side's context."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._as_is = False  # the message being sent goes uncompressed (its continuation frames too)

    def encode(self, frame: Frame) -> Frame:
        if frame.opcode in _CONTROL:
            return frame
        if frame.opcode is not Opcode.CONT:
            self._as_is = len(frame.data) > COMPRESS_UP_TO
        return frame if self._as_is else super().encode(frame)


class LargeUncompressedFactory(ClientPerMessageDeflateFactory):
    """The offer websockets makes by default (``memLevel`` 5), negotiating ``LargeUncompressed``."""

    def __init__(self) -> None:
        super().__init__(compress_settings={"memLevel": 5})

    def process_response_params(self, params, accepted_extensions: list[Extension]) -> PerMessageDeflate:
        agreed = super().process_response_params(params, accepted_extensions)
        return LargeUncompressed(agreed.remote_no_context_takeover, agreed.local_no_context_takeover,
                                 agreed.remote_max_window_bits, agreed.local_max_window_bits, agreed.compress_settings)


class UpstreamSocket:
    """One open WebSocket to an upstream, as the bridge uses it."""

    def __init__(self, connection: ClientConnection) -> None:
        self._connection = connection

    @property
    def open(self) -> bool:
        return self._connection.state is State.OPEN

    async def send(self, message: bytes) -> None:
        """One text message (the bytes are the client's JSON, valid UTF-8); a
        large one in frames of ``FRAGMENT``, each masked and written as the
        connection takes it, so that the event loop is never held for all of it."""
        if len(message) <= FRAGMENT:
            await self._connection.send(message, text=True)
            return
        view = memoryview(message)
        await self._connection.send((view[i:i + FRAGMENT] for i in range(0, len(view), FRAGMENT)), text=True)

    async def recv(self) -> bytes:
        """The next message, its bytes as they came; ConnectionClosed once the socket is gone."""
        return await self._connection.recv(decode=False)

    async def close(self) -> None:
        try:
            await self._connection.close()
        except (ConnectionClosed, OSError):
            pass

    def close_soon(self) -> None:
        """Close in the background: the close handshake may take a while, and
        nothing waits for it."""
        task = asyncio.get_running_loop().create_task(self.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    def abort(self) -> None:
        """Drop the connection at once (the proxy stops)."""
        transport = self._connection.transport
        if transport is not None:
            transport.abort()


_CLOSING: set[asyncio.Task] = set()  # close handshakes under way (a task needs a reference)
_CONTEXTS = Bounded(64)  # (options, client certificate) -> ssl.SSLContext


def client_certificate(client_certs: str | None, server_name: str) -> str | None:
    """mitmproxy's rule: ``client_certs`` is a file, or a directory holding ``<server name>.pem``."""
    if not client_certs:
        return None
    path = os.path.expanduser(client_certs)
    if os.path.isfile(path):
        return path
    per_server = os.path.join(path, f"{server_name}.pem")
    return per_server if os.path.isfile(per_server) else None


def _ssl_context(tls: TLSOptions, certificate: str | None) -> ssl.SSLContext:
    if tls.ca_file is None and tls.ca_path is None:
        import certifi  # the trust store mitmproxy verifies upstreams with by default

        context = ssl.create_default_context(cafile=certifi.where())
    else:
        context = ssl.create_default_context(cafile=tls.ca_file, capath=tls.ca_path)
    if tls.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if certificate is not None:
        context.load_cert_chain(certificate)
    context.set_alpn_protocols(["http/1.1"])
    return context


async def ssl_context(tls: TLSOptions, server_name: str) -> ssl.SSLContext:
    """The TLS context for ``server_name``, made once per options (loading a
    trust store takes milliseconds: off the event loop)."""
    key = (tls, client_certificate(tls.client_certs, server_name))
    context = _CONTEXTS.get(key)
    if context is None:
        context = await asyncio.to_thread(_ssl_context, *key)
        _CONTEXTS.put(key, context)
    return context


async def open_socket(target: Target, tls: TLSOptions) -> UpstreamSocket:
    """An open socket to ``target``; Refused or Unreachable."""
    secure = target.url.startswith("wss:")
    try:
        context = await ssl_context(tls, target.server_name) if secure else None
        connection = await connect(
            target.url, additional_headers=list(target.headers), user_agent_header=None,
            extensions=[LargeUncompressedFactory()],  # deflate, but not on the event loop for large messages
            proxy=None,  # mitmproxy's own connections ignore HTTPS_PROXY; so does the bridge
            open_timeout=OPEN_TIMEOUT_S, ping_interval=PING_S, ping_timeout=PING_S, max_size=MAX_MESSAGE,
            ssl=context, host=target.host, port=target.port,
            logger=logging.getLogger(SOCKETS))  # quiet: websockets' own debug lines quote headers and frames
    except InvalidStatus as e:
        raise Refused(e.response.status_code) from None
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI, ssl.SSLError, ValueError) as e:
        raise Unreachable(type(e).__name__) from None
    return UpstreamSocket(connection)
