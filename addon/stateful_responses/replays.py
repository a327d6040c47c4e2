"""Our second attempts at a client's request, sent the way mitmproxy itself
would send it (reverse, upstream mode, TLS options), their answers kept whole
for the client's flow."""

from __future__ import annotations

import asyncio
import html

from mitmproxy import ctx, http, version

from .counters import Counters
from .flows import COMPARISON, RETRY_OF, internal_error, retry_of


def bad_gateway(why: str) -> http.Response:
    """The answer mitmproxy itself gives when the upstream connection fails."""
    body = (f"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>"
            f"<p>{html.escape(why)}</p></body></html>").encode()
    return http.Response.make(
        502, body, {"Server": version.MITMPROXY, "Connection": "close", "Content-Type": "text/html"}
    )


class Replays:
    """Our second attempts at a client's request, sent the way mitmproxy
    itself would send it (reverse, upstream mode, TLS options), their answers
    kept whole for the client's flow.

    Listed last: its collector wraps whatever taps the other addons set, and
    is a stream rather than mitmproxy's buffering, which ``stream_large_bodies``
    would turn into streaming to nowhere."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._bodies: dict[str, bytearray | None] = {}  # by the retry's flow id

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.id not in self._bodies or flow.response is None:
            return
        body = self._bodies[flow.id] = bytearray()
        downstream = flow.response.stream

        def keep(chunk: bytes) -> bytes:
            data = downstream(chunk) if callable(downstream) else chunk
            body.extend(data if isinstance(data, bytes | bytearray) else b"".join(data))
            return b""

        flow.response.stream = keep

    async def send(self, flow: http.HTTPFlow, request: http.Request, why: str,
                   kind: str = "retry", timeout: float | None = None,
                   metadata: dict | None = None) -> tuple[http.Response, str | None]:
        """The answer the client gets for ``request`` sent in its flow's place:
        the upstream's, whole, or mitmproxy's own 502 (and why) when the retry
        itself failed, even midway, never the refusal that made us retry. With a ``timeout``, an
        answer not whole by then is given up (its connection closed)."""
        from mitmproxy.addons.clientplayback import ReplayHandler

        child = handler = None
        try:
            child = flow.copy()
            child.request = request
            child.response = None
            child.error = None
            # Who the client is stays: mitmproxy's proxyauth let the client in
            # (and lets a replay through), and the user it let in names the tenant.
            child.metadata = {key: flow.metadata[key] for key in ("proxyauth",) if key in flow.metadata}
            child.metadata.update(metadata or {})  # what tells the other addons to leave it alone
            child.is_replay = "request"
            if kind in ("proof", "comparison"):  # ours, no attempt at the client's request: no addon takes it for one
                child.metadata[RETRY_OF] = flow.id
                child.metadata[COMPARISON] = kind == "comparison"  # nothing is learned from it: the caller compares
            else:
                retry_of(child, flow)
            child.comment = f"{kind} for {flow.id}: {why}"
            self._bodies[child.id] = None  # responseheaders starts collecting
            handler = ReplayHandler(child, ctx.options)
            await asyncio.wait_for(handler.replay(), timeout)
        except TimeoutError:
            if child is not None:
                self._bodies.pop(child.id, None)
            for io in handler.transports.values() if handler is not None else ():
                if io.handler is not None:
                    io.handler.cancel()  # as mitmproxy's replay closes them once answered
            failure = f"no answer within {timeout} s"
            return bad_gateway(failure), failure
        except Exception:
            internal_error(self.counters, "retrying a request")
        body = self._bodies.pop(child.id, None) if child is not None else None
        # An answer whose connection failed midway is no answer: its head promised bytes that never came.
        if child is not None and child.response is not None and body is not None and child.error is None:
            child.response.raw_content = bytes(body)
            return child.response, None
        failure = str(child.error) if child is not None and child.error else "internal error"
        return bad_gateway(failure), failure
