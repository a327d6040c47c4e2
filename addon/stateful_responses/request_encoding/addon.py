"""Compressed request bodies' mitmproxy glue: decoded before every capability
reads the request, encoded again after the last one changed it.

``DecodedRequests``, listed before the record, replaces a body the client
sent in zstd, gzip, deflate or br by its decoding (within ``codec``'s bound,
off the event loop) and drops the Content-Encoding, so that the record, the
router, the emulations, the bridge and forward mode read plain JSON.
``EncodedRequests``, listed after forward mode, puts the client's own bytes
back where no capability changed the body, and encodes a changed body as the
client did (our retries of the client's request too). A body past the bound,
or one that does not decode, keeps its Content-Encoding: every capability
leaves it alone and it passes byte for byte.

A body mitmproxy streams (``stream_large_bodies``) is decoded as it arrives,
on the event loop (the stream callable is synchronous: hence a stricter
ratio), for forward mode's collector, which plans it once whole; its
Content-Encoding goes upstream before the body, so the body goes as the
client encoded it, re-encoded when rewritten.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mitmproxy import http

from ..counters import Counters
from ..flows import BRIDGED, PerFlow, client_flow, internal_error
from ..settings import Config
from .codec import STREAMED_RATIO, Decoder, Refused, coding_of, decode, encode

logger = logging.getLogger(__name__)

WORKERS = 2  # bodies decoded or encoded at once, off the event loop


@dataclass
class _Coded:
    """A client's compressed body, and what became of it."""

    coding: str
    header: str  # the client's Content-Encoding, as sent
    original: bytes | None = None  # the client's bytes
    decoded: bytes | None = None
    sent: bytes | None = None  # streamed: the bytes that went upstream
    streamed: bool = False  # its body streams through our decoder (forward mode collects it)


class _Codings:
    """What both addons share: the flows whose body was decoded, the settings,
    and the threads the work runs on."""

    def __init__(self, config: Config, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.flows: PerFlow[_Coded] = PerFlow()
        self._pool: ThreadPoolExecutor | None = None

    def coding(self, req: http.Request) -> str | None:
        s = self.config.settings
        if not s.enabled or req.method.upper() != "POST" or not s.url_matches(req.url):
            return None
        return coding_of(req.headers.get("content-encoding", ""))

    async def run(self, work: Any, *args: Any) -> Any:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="stateful-codings")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def debug(self, msg: str, *args: Any) -> None:
        if self.config.settings.debug:
            logger.info("stateful-responses: " + msg, *args)


def _set_body(req: http.Request, raw: bytes) -> None:
    """``raw`` as the body, its length where the request states one."""
    req.raw_content = raw
    if "content-length" in req.headers:
        req.headers["content-length"] = str(len(raw))


class DecodedRequests:
    """Listed before every capability: a compressed body becomes plain."""

    def __init__(self, config: Config, counters: Counters) -> None:
        self.codings = _Codings(config, counters)

    @property
    def encoded(self) -> EncodedRequests:
        return EncodedRequests(self.codings)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Forward mode's collector copies the headers now: it must see the
        plain body's (``EncodedRequests`` puts the coding back before they go)."""
        try:
            coding = self.codings.coding(flow.request)
            if coding is not None:
                self.codings.flows.put(flow, _Coded(coding, flow.request.headers["content-encoding"]))
                del flow.request.headers["content-encoding"]
        except Exception:
            internal_error(self.codings.counters, "reading a request's coding")

    async def request(self, flow: http.HTTPFlow) -> None:
        coded = self.codings.flows.get(flow)
        req = flow.request
        if coded is not None and coded.streamed or req.raw_content is None or flow.response is not None:
            return  # streamed through our decoder, or past every addon, or answered
        try:
            coding = self.codings.coding(req)
            if coding is None:
                return
            original = req.raw_content
            try:
                decoded = await self.codings.run(decode, original, coding)
            except Refused as e:
                self.codings.debug("a %s request body passes as sent: %s", coding, e)
                return
            self.codings.flows.put(flow, _Coded(coding, req.headers["content-encoding"], original, decoded))
            del req.headers["content-encoding"]
            _set_body(req, decoded)
        except Exception:
            internal_error(self.codings.counters, "decoding a request body")

    def done(self) -> None:
        self.codings.close()


class EncodedRequests:
    """Listed after every capability that changes requests: an untouched body
    goes as the client's own bytes, a changed one encoded as the client did."""

    def __init__(self, codings: _Codings) -> None:
        self.codings = codings

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        coded = self.codings.flows.get(flow)
        if coded is None:
            return
        req = flow.request
        try:
            req.headers["content-encoding"] = coded.header  # these headers may go upstream before the body
            if callable(req.stream):  # forward mode collects the body: it is decoded on the way in
                req.stream = self._decoding(flow, coded, req.stream)
                coded.streamed = True
        except Exception:
            internal_error(self.codings.counters, "streaming a compressed request body")

    def _decoding(self, flow: http.HTTPFlow, coded: _Coded, collect: Any) -> Any:
        """A stream callable that decodes the chunks and hands the collector
        the whole decoded body; what it sends is the client's bytes, or the
        collector's body encoded. Past the bound, the client's bytes pass."""
        decoder: Decoder | None = Decoder(coded.coding, STREAMED_RATIO)  # on the event loop: a stricter bound
        held: list[bytes] = []

        def stream(chunk: bytes) -> bytes | list[bytes]:
            nonlocal decoder
            if decoder is None:
                return chunk
            held.append(chunk)
            try:
                if chunk:
                    decoder.feed(chunk)
                    return []
                decoded = decoder.finish()
            except Exception as e:
                if not isinstance(e, Refused):
                    internal_error(self.codings.counters, "decoding a streamed request body")
                self.codings.debug("a %s request body passes as sent: %s", coded.coding, e)
                decoder, passed = None, b"".join(held)
                held.clear()
                return [passed]
            decoder = None
            original = b"".join(held)
            held.clear()
            try:
                out = [*_chunks(collect(decoded)), *_chunks(collect(b""))]
                sent = b"".join(out)
                raw = original if sent == decoded else encode(sent, coded.coding)
            except Exception:
                internal_error(self.codings.counters, "encoding a streamed request body")
                return [original]
            coded.original, coded.decoded, coded.sent = original, decoded, raw
            flow.request.headers.pop("content-encoding", None)  # the request hooks read the plain body
            return [raw]

        return stream

    async def request(self, flow: http.HTTPFlow) -> None:
        client = client_flow(flow)  # our retry of a client's request is sent as the client's
        coded = self.codings.flows.get(flow) or self.codings.flows.get(client)
        if coded is None or BRIDGED in flow.metadata:
            return  # not decoded; or answered over an upstream socket, whose messages are plain JSON
        req = flow.request
        try:
            if coded.streamed and flow is client:
                if coded.sent is not None:  # decoded as it streamed: what went upstream, for mitmweb and -w
                    req.headers["content-encoding"] = coded.header
                    req.raw_content = coded.sent
                return
            if coded.original is None or "content-encoding" in req.headers or req.raw_content is None:
                return
            body = req.raw_content
            if body is coded.decoded or body == coded.decoded or flow.response is not None:
                raw = coded.original  # untouched (or answered by the proxy): the client's own bytes
            else:
                raw = await self.codings.run(encode, body, coded.coding)
                self.codings.debug("a changed request body goes %s-encoded, as the client's", coded.coding)
            req.headers["content-encoding"] = coded.header
            _set_body(req, raw)
        except Exception:
            internal_error(self.codings.counters, "encoding a request body")


def _chunks(out: bytes | list[bytes] | Any) -> list[bytes]:
    return [out] if isinstance(out, bytes) else list(out)
