"""What every addon of ours shares on the mitmproxy side: how a flow is read
into a ``Request``, how an internal error is reported (never its message: it
could quote a prompt), and the retry of a request mitmproxy sends like its own."""

from __future__ import annotations

import html
import logging
import os
import sys
import traceback

from mitmproxy import ctx, http, version

from .planner import Counters, Request, is_credential_header

logger = logging.getLogger("stateful_responses")

RETRY_OF = "stateful_retry_of"  # flow.metadata key marking our own retry
# flow.metadata key: an answer held back whole, so that the response hook can
# replace it before the client sees a byte; no addon streams it.
HELD = "stateful_held"


def hold(flow: http.HTTPFlow) -> None:
    assert flow.response is not None
    flow.response.stream = False
    flow.metadata[HELD] = True


def end_still_to_come(response: http.Response) -> bool:
    """Whether the client still waits for this answer's end after the response
    hooks (a chunked stream: SSE). With a Content-Length it already has every
    byte, and waiting would only hold back its next request on the connection."""
    return "content-length" not in response.headers


def _headers_read(fields: tuple[tuple[bytes, bytes], ...]) -> dict[str, str]:
    """The headers the core reads (the credentials and content-encoding), by
    lower-case name, in one pass over the raw fields (a repeated one joined
    as mitmproxy joins it)."""
    found: dict[str, str] = {}
    for name, value in fields:
        key = name.decode("latin-1").lower()
        if key == "content-encoding" or is_credential_header(key):
            text = value.decode("utf-8", "surrogateescape")
            found[key] = f"{found[key]}, {text}" if key in found else text
    return found


def request_of(flow: http.HTTPFlow, req: http.Request | None = None) -> Request:
    """The pure core's view of a flow's request (or of ``req``, the client's)."""
    req = req or flow.request
    proxy_user = flow.metadata.get("proxyauth")
    headers = _headers_read(req.headers.fields)
    return Request(
        method=req.method,
        url=req.url,
        body=req.raw_content or b"",
        content_encoding=headers.pop("content-encoding", ""),
        headers=headers,
        proxy_user="\x00".join(map(str, proxy_user)) if isinstance(proxy_user, tuple) else "",
    )


def internal_error(counters: Counters, doing: str) -> None:
    """Log where it broke, never the exception's message: a message can
    quote request content (a KeyError of a prompt, say)."""
    counters.errors += 1
    kind, _, tb = sys.exc_info()
    where = traceback.extract_tb(tb)[-1] if tb else None
    logger.warning(
        "stateful-responses: internal error (%s at %s:%s) while %s; flow passed through",
        kind.__name__ if kind else "?",
        os.path.basename(where.filename) if where else "?",
        where.lineno if where else "?",
        doing,
    )


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

    async def send(self, flow: http.HTTPFlow, request: http.Request, why: str) -> tuple[http.Response, str | None]:
        """The answer the client gets for ``request`` sent in its flow's place:
        the upstream's, or mitmproxy's own 502 (and why) when the retry itself
        failed, never the refusal that made us retry."""
        from mitmproxy.addons.clientplayback import ReplayHandler

        child = None
        try:
            child = flow.copy()
            child.request = request
            child.response = None
            child.error = None
            child.metadata = {RETRY_OF: flow.id}
            child.comment = f"retry of {flow.id}: {why}"
            self._bodies[child.id] = None  # responseheaders starts collecting
            await ReplayHandler(child, ctx.options).replay()
        except Exception:
            internal_error(self.counters, "retrying a request")
        body = self._bodies.pop(child.id, None) if child is not None else None
        if child is not None and child.response is not None and body is not None:
            child.response.raw_content = bytes(body)
            return child.response, None
        failure = str(child.error) if child is not None and child.error else "internal error"
        return bad_gateway(failure), failure
