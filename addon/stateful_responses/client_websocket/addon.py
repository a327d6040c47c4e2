"""The client-facing WebSocket mode's mitmproxy glue (``stateful_client_websocket``).

The engine's third transport: clients that speak the Responses API's
WebSocket mode (the openai SDK's ``responses.connect()``, openai-agents,
Codex) served by the proxy itself where the upstream lacks the mode.

In ``request``, a client's upgrade to a Responses endpoint whose upstream +
credential lacks the mode (the ``refuses_websocket`` verdict of
``upstreams.py``, shared through the state store; learned here by one probe
upgrade when nothing is known) is pointed at the loopback server
(``server.LoopbackServer``); mitmproxy then relays the socket between the
client and it. Where the upstream has the mode the upgrade passes untouched.

Each ``response.create`` becomes one ``POST …/responses`` (``stream: true``)
made as mitmproxy's own client replay of a flow built from the upgrade (its
client connection, mode and headers): every addon's hooks apply to it as to a
client's HTTP request, so the one engine plans it (forward mode), store
emulation and conversations expand it, the router routes it, and the record
records it (one line per socket turn). Listed after the addons that tap or
replace an answer: its tap is the outermost, and its ``response`` hook sees
the answer the client is meant to get.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from ..bounded import Bounded
from ..counters import Counters
from ..flows import HELD, SERVED_SOCKET, SOCKET_TURN, PerFlow, internal_error, request_of
from ..request_reader import upstream_of
from ..settings import Config
from ..state.access import StateAccess
from ..tenancy import Tenancy, credential_material
from ..upstreams import Upstreams
from ..websocket.connect import Refused, Target, TLSOptions, Unreachable, open_socket
from .protocol import Create
from .server import PATH_PREFIX, LoopbackServer, Posted, Session

logger = logging.getLogger(__name__)

# Upgrade answers that say "no WebSocket mode here" (a router without the route, a gateway refusing the upgrade,
# an HTTP server that ignores it): a verdict. Others (401, 403, 429, 5xx) are the client's to see.
LACKS_MODE = frozenset({200, 400, 404, 405, 410, 426, 501})
HAS_MODE_S = 3600.0  # an upstream + credential that accepted a probe upgrade is not probed again this long
REPROBE_S = 3600.0  # a verdict drawn from an upgrade never answered holds this long
CLAIM_S = 60.0  # an upgrade pointed at the loopback server that does not arrive by then is forgotten
MAX_SOCKETS_PER_CREDENTIAL = 64  # client sockets served at once per upstream + credential; more pass through
# The upgrade's headers a turn's request does not carry (Host stays: TLS's name in transparent mode).
_NOT_CARRIED = frozenset({"connection", "upgrade", "content-length", "transfer-encoding", "keep-alive",
                          "proxy-authorization", "proxy-connection", "te", "trailer"})


def _websocket_header(name: str) -> bool:
    return name.startswith("sec-websocket-")


class _Socket:
    """A client socket the proxy serves: the upgrade as the client sent it,
    the session answering it, and its turns' answers under way."""

    def __init__(self, flow: http.HTTPFlow, scope: str, label: str, post: Callable[..., Posted]) -> None:
        self.template = flow.copy()  # the client's connection, mode and upgrade, for each turn's request
        self.client = flow.request.copy()
        self.flow_id = flow.id
        self.scope, self.label = scope, label
        self.session = Session(lambda body, n, create: post(self, body, n, create))


class ClientWebSocket:
    def __init__(self, config: Config, counters: Counters, tenancy: Tenancy, upstreams: Upstreams,
                 state: StateAccess) -> None:
        self.config = config
        self.counters = counters
        self.tenancy = tenancy
        self.upstreams = upstreams
        self.state = state
        self.loopback = LoopbackServer(self._claim)
        self._waiting: dict[str, tuple[_Socket, asyncio.TimerHandle]] = {}  # token -> a socket not yet at the server
        self._open: dict[str, int] = {}  # scope -> client sockets served
        self._has_mode = Bounded(4096)  # scope -> until when its upstream is known to have the mode
        self._probing: dict[str, asyncio.Future] = {}  # scope -> the probe under way
        self._turns: dict[str, asyncio.Queue] = {}  # turn flow id -> where its answer goes
        self._sockets: dict[str, _Socket] = {}  # upgrade flow id -> its socket (to restore its request)
        self._tasks: set[asyncio.Task] = set()
        self._passed: PerFlow[tuple[str, str]] = PerFlow()  # an upgrade passed to the upstream: its scope, label
        tenancy.on_new_secret(self._has_mode.clear)

    # -- hooks -------------------------------------------------------------------

    def done(self) -> None:
        self.loopback.close()

    async def request(self, flow: http.HTTPFlow) -> None:
        if not self._may_serve(flow):
            return
        await self.state.ready()
        try:
            await self._serve(flow)
        except Exception:
            internal_error(self.counters, "serving a client's WebSocket")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        socket = self._sockets.pop(flow.id, None)
        if socket is not None:  # the loopback server's 101: mitmweb, -w and the view show the client's upgrade
            flow.request.data = socket.client.data
            return
        parts = self._turns.get(flow.id)
        if parts is None or flow.response is None or flow.metadata.get(HELD):
            return  # an answer held back by another addon comes whole, in ``response``
        parts.put_nowait(("head", flow.response.status_code))
        downstream = flow.response.stream

        def tap(chunk: bytes) -> bytes:
            data = downstream(chunk) if callable(downstream) else chunk
            if data:
                parts.put_nowait(("data", data if isinstance(data, bytes) else b"".join(data)))
            return data

        flow.response.stream = tap

    def response(self, flow: http.HTTPFlow) -> None:
        parts = self._turns.pop(flow.id, None)
        if parts is None or flow.response is None:
            return
        if flow.metadata.get(HELD) or not callable(flow.response.stream):
            parts.put_nowait(("head", flow.response.status_code))
            parts.put_nowait(("data", flow.response.raw_content or b""))
        parts.put_nowait(("end", None))

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        """A socket passed to an upstream that took a ``response.create`` and
        closed before any event (LiteLLM's pass-through to an upstream without
        the mode): a verdict drawn from a fault, for ``REPROBE_S``; the
        client's next socket is served by the proxy."""
        passed = self._passed.pop(flow)
        if passed is None or flow.websocket is None or flow.websocket.closed_by_client:
            return
        messages = flow.websocket.messages
        if any(not m.from_client for m in messages) or not any(
                m.from_client and b'"response.create"' in m.content for m in messages):
            return
        scope, label = passed
        self._has_mode.pop(scope, None)
        if self.upstreams.mark("refuses_websocket", scope, REPROBE_S):
            logger.info("stateful-responses: %s closed a WebSocket before its first event: the proxy serves "
                        "WebSocket mode to its clients for %ds", label, REPROBE_S)
        self.state.flush()

    def error(self, flow: http.HTTPFlow) -> None:
        self._sockets.pop(flow.id, None)
        parts = self._turns.pop(flow.id, None)
        if parts is not None:
            parts.put_nowait(("end", None))

    # -- taking an upgrade ---------------------------------------------------------

    def _may_serve(self, flow: http.HTTPFlow) -> bool:
        s, req = self.config.settings, flow.request
        return (s.enabled and s.client_websocket == "auto" and req.method == "GET" and flow.response is None
                and req.headers.get("upgrade", "").lower() == "websocket" and SOCKET_TURN not in flow.metadata
                and upstream_of(req.url) is not None and s.url_matches(req.url)
                and not isinstance(flow.client_conn.proxy_mode, mode_specs.UpstreamMode))

    async def _serve(self, flow: http.HTTPFlow) -> None:
        upstream = upstream_of(flow.request.url)
        assert upstream is not None
        scope, label = self.tenancy.scope(upstream, credential_material(request_of(flow)))
        if not await self._lacks_mode(flow, scope, label):
            self._passed.put(flow, (scope, label))
            return
        if self._open.get(scope, 0) >= MAX_SOCKETS_PER_CREDENTIAL:
            self._debug("ws client: %s has %d sockets served already; this upgrade passes through", label,
                        MAX_SOCKETS_PER_CREDENTIAL)
            return
        socket = _Socket(flow, scope, label, self._post)
        token = secrets.token_urlsafe(24)
        await self.loopback.start()
        self._open[scope] = self._open.get(scope, 0) + 1
        self._waiting[token] = (socket, asyncio.get_running_loop().call_later(CLAIM_S, self._unclaimed, token))
        self._sockets[flow.id] = socket
        flow.metadata[SERVED_SOCKET] = {"transport": "websocket", "upstream": "http"}
        flow.comment, flow.marked = "ws: WebSocket mode served by the proxy: each turn over HTTP", ":recycle:"
        req = flow.request
        req.scheme, req.host, req.port, req.path = "http", "127.0.0.1", self.loopback.port, PATH_PREFIX + token
        req.headers["host"] = f"127.0.0.1:{self.loopback.port}"
        for name in [k for k in req.headers if k.lower() not in ("upgrade", "connection", "host")
                     and not _websocket_header(k.lower())]:
            del req.headers[name]  # nothing of the client's (its credential) goes to the loopback server
        self.counters.client_websocket_sockets += 1
        self._debug("ws client: serving WebSocket mode for %s (its upstream lacks it)", label)

    async def _lacks_mode(self, flow: http.HTTPFlow, scope: str, label: str) -> bool:
        """Whether this upstream + credential lacks WebSocket mode: its verdict
        (any replica's), else one probe upgrade with the client's own headers."""
        if self.upstreams.has("refuses_websocket", scope):
            return True
        if self._has_mode.get(scope, 0.0) > time.monotonic():
            return False
        probing = self._probing.get(scope)
        if probing is None:
            probing = self._probing[scope] = asyncio.get_running_loop().create_future()
            try:
                probing.set_result(await self._probe(flow, scope, label))
            except Exception:
                probing.set_result(False)
                raise
            finally:
                del self._probing[scope]
        return await asyncio.shield(probing)

    async def _probe(self, flow: http.HTTPFlow, scope: str, label: str) -> bool:
        o = ctx.options
        tls = TLSOptions(o.ssl_insecure, o.ssl_verify_upstream_trusted_ca, o.ssl_verify_upstream_trusted_confdir,
                         o.client_certs)
        try:
            socket = await open_socket(_target(flow.request), tls)
        except Refused as e:
            if e.status not in LACKS_MODE:
                return False  # the client sees the upstream's own answer (its credential refused, say)
            if self.upstreams.mark("refuses_websocket", scope):
                logger.info("stateful-responses: %s refused the WebSocket upgrade (%d): the proxy serves WebSocket "
                            "mode to its clients", label, e.status)
            self.state.flush()
            return True
        except Unreachable as e:
            if str(e) == "TimeoutError":  # took the connection, never answered the upgrade
                self.upstreams.mark("refuses_websocket", scope, REPROBE_S)
                self.state.flush()
                return True
            return False
        socket.close_soon()
        self._has_mode.put(scope, time.monotonic() + HAS_MODE_S)
        return False

    def _claim(self, token: str) -> Session | None:
        waiting = self._waiting.pop(token, None)
        if waiting is None:
            return None
        socket, timer = waiting
        timer.cancel()
        task = asyncio.get_running_loop().create_task(self._closed(socket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return socket.session

    async def _closed(self, socket: _Socket) -> None:
        await socket.session.closed.wait()
        self._release(socket.scope)

    def _unclaimed(self, token: str) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            self._release(waiting[0].scope)

    def _release(self, scope: str) -> None:
        left = self._open.get(scope, 0) - 1
        if left > 0:
            self._open[scope] = left
        else:
            self._open.pop(scope, None)

    # -- one turn over HTTP, through mitmproxy's pipeline ---------------------------

    def _post(self, socket: _Socket, body: bytes, n: int, create: Create) -> Posted:
        """The create's HTTP request, made as mitmproxy's client replay of a
        flow built from the upgrade: every addon's hooks apply, and its answer
        streams back on ``parts``."""
        from mitmproxy.addons.clientplayback import ReplayHandler

        turn = socket.template.copy()
        request = socket.client.copy()
        request.method = "POST"
        for name in [k for k in request.headers if k.lower() in _NOT_CARRIED or _websocket_header(k.lower())
                     or (k.lower() == "openai-beta" and "responses_websockets" in request.headers[k])]:
            del request.headers[name]
        request.headers["content-type"] = "application/json"
        request.headers["accept"] = "text/event-stream"
        request.headers["accept-encoding"] = "identity"  # the events are read as they come
        request.content = body
        turn.request, turn.response, turn.error, turn.websocket = request, None, None, None
        turn.metadata = {key: socket.template.metadata[key] for key in ("proxyauth",)
                         if key in socket.template.metadata}
        turn.metadata[SOCKET_TURN] = {"socket": socket.flow_id, "turn": n, "stream_id": create.lane}
        turn.is_replay = "request"
        turn.comment = f"ws turn {n} of {socket.flow_id}"
        parts: asyncio.Queue = asyncio.Queue()
        self._turns[turn.id] = parts
        handler = ReplayHandler(turn, ctx.options)
        task = asyncio.get_running_loop().create_task(handler.replay())
        self._tasks.add(task)
        self.counters.client_websocket_turns += 1

        def finished(done: asyncio.Task) -> None:
            self._tasks.discard(done)
            if self._turns.pop(turn.id, None) is not None:  # no response or error hook came: the turn failed
                parts.put_nowait(("end", None))

        def cancel() -> None:
            if task.done():
                return
            for io in handler.transports.values():
                if io.handler is not None:
                    io.handler.cancel()  # as mitmproxy's replay closes its connections once answered
            task.cancel()

        task.add_done_callback(finished)
        return Posted(parts, cancel)

    def _debug(self, msg: str, *args) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _target(request: http.Request) -> Target:
    """Where the probe upgrade goes: where mitmproxy would send the client's
    (an address of transparent mode gives way to the Host header's name, for
    TLS), with the client's own headers but the handshake's."""
    name = request.host
    try:
        ipaddress.ip_address(name)
        name = request.host_header.rsplit(":", 1)[0].strip("[]") if request.host_header else name
    except ValueError:
        pass
    netloc = f"[{name}]" if ":" in name else name
    if request.port != (443 if request.scheme == "https" else 80):
        netloc += f":{request.port}"
    headers = tuple((k, v) for k, v in request.headers.items(multi=True)
                    if k.lower() not in _NOT_CARRIED and k.lower() != "host" and not _websocket_header(k.lower()))
    return Target(f"{'wss' if request.scheme == 'https' else 'ws'}://{netloc}{request.path}", name, request.host,
                  request.port, headers)
