"""Telemetry's mitmproxy glue: ``stateful_metrics`` and ``stateful_traces``.

Two addons, one at each end of the hook order, and no hook inside any other
capability: ``TelemetryStart``, listed before every capability, notes when a
request's hooks begin and the client's body size; ``Telemetry``, listed after
the record's answer side, reads what the capabilities put on the flow
(``decisions.classify``) once its request hooks are over (the proxy's added
time) and once it is answered (the counts), and turns each call the
continuation record tells it of into a span. Counting is cheap and on the
event loop; serving ``/metrics`` and exporting spans run on threads of their own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
from mitmproxy import exceptions, http

from ..counters import Counters
from ..flows import (
    BRIDGED,
    CONVERSATION,
    DECISION,
    EMULATION,
    OVERFLOW,
    RETRY_OF,
    ROUTED,
    SOCKET_TURN,
    WITHHELD,
    Call,
    PerFlow,
    internal_error,
)
from ..settings import Config, listen_address
from .decisions import Counted, classify, is_responses_api
from .metrics import Metrics, SocketsView
from .traces import MissingExtra, Traces

logger = logging.getLogger(__name__)

TRACES_WAIT = 5.0  # at shutdown, queued spans get this long to leave
# Counters other addons keep that are fallbacks too: (attribute, reason)
COUNTED_FALLBACKS = (("errors", "internal_error"), ("unsupported_upstreams", "upstream_unsupported"),
                     ("ambiguous", "ambiguous_body"))


@dataclass
class _Seen:
    """A client's Responses API request, between its request hooks and its answer."""

    client_bytes: int
    answered: bool  # the proxy answered it in the request hooks: the upstream never had it


class _Type(msgspec.Struct):
    type: object = None


class Telemetry:
    def __init__(self, config: Config, counters: Counters, sockets: SocketsView) -> None:
        self.config = config
        self.counters = counters
        self.sockets = sockets
        self.metrics: Metrics | None = None
        self.traces = Traces()
        self.listen = "off"
        self._began: PerFlow[tuple[float, _Seen | None]] = PerFlow()
        self._seen: PerFlow[_Seen] = PerFlow()
        self._synced = {attribute: 0 for attribute, _ in COUNTED_FALLBACKS}

    @property
    def active(self) -> bool:
        return self.metrics is not None or self.traces.on

    @property
    def start(self) -> TelemetryStart:
        return TelemetryStart(self)

    # -- options -------------------------------------------------------------------

    def configure(self, updated: set[str]) -> None:
        s = self.config.settings
        if "stateful_metrics" in updated and s.metrics != self.listen:
            self._serve(s.metrics)
        if "stateful_traces" in updated:
            if s.traces == "otlp":
                try:
                    self.traces.start()
                except MissingExtra as e:
                    raise exceptions.OptionsError(str(e)) from None
            else:
                self.traces.close(0)

    def _serve(self, listen: str) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.listen = listen
        if listen == "off":
            return
        if self.metrics is None:
            self.metrics = Metrics(self.sockets)
            self._synced = {attribute: getattr(self.counters, attribute) for attribute, _ in COUNTED_FALLBACKS}
        host, port = listen_address(listen)
        try:
            self.metrics.serve(host, port)
        except OSError as e:
            self.listen = "off"
            raise exceptions.OptionsError(f"stateful_metrics: cannot listen on {listen} ({e.strerror})") from None
        logger.info("stateful-responses: metrics at http://%s/metrics", listen)

    def done(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.traces.close(TRACES_WAIT)

    # -- hooks ---------------------------------------------------------------------

    def began(self, flow: http.HTTPFlow) -> None:
        """The first of the request hooks (``TelemetryStart``)."""
        if not self.active or flow.metadata.get(RETRY_OF) is not None:
            return
        start, req, s = time.perf_counter(), flow.request, self.config.settings
        seen = None
        if s.enabled and is_responses_api(req.path.partition("?")[0]) and (not s.base_urls or s.url_matches(req.url)):
            body = req.raw_content
            if body is None:
                length = req.headers.get("content-length", "")
                seen = _Seen(int(length) if length.isdigit() else 0, False)
            else:
                seen = _Seen(len(body), False)
        self._began.put(flow, (start, seen))

    def request(self, flow: http.HTTPFlow) -> None:
        """The last of the request hooks: the proxy's time on its path is over."""
        began = self._began.pop(flow)
        if began is None:
            return
        try:
            if self.metrics is not None:
                self.metrics.added.observe(time.perf_counter() - began[0])
            seen = began[1]
            if seen is not None:
                seen.answered = flow.response is not None
                self._seen.put(flow, seen)
        except Exception:
            internal_error(self.counters, "counting a request")

    def response(self, flow: http.HTTPFlow) -> None:
        self._finish(flow, answered=True)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow, answered=False)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """A ``response.create`` on the client's own socket: passed untouched."""
        metrics = self.metrics
        if metrics is None or flow.websocket is None or not flow.websocket.messages:
            return
        message = flow.websocket.messages[-1]
        s = self.config.settings
        if not message.from_client or not s.enabled or not s.url_matches(flow.request.url) \
                or not is_responses_api(urlsplit(flow.request.url).path):
            return
        try:
            if msgspec.json.decode(message.content, type=_Type).type != "response.create":
                return
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        upstream = metrics.upstream(flow.request.host)
        metrics.request(Counted("passed", "websocket", ()), upstream, len(message.content))
        metrics.sent(upstream, len(message.content))

    def _finish(self, flow: http.HTTPFlow, answered: bool) -> None:
        metrics = self.metrics
        if metrics is None or flow.websocket is not None:
            self._seen.pop(flow)
            return
        try:
            if flow.metadata.get(RETRY_OF) is not None:
                # Our own request on the client's behalf (a retry, a proof): its body went upstream.
                if answered and is_responses_api(flow.request.path.split("?")[0]):
                    metrics.sent(metrics.upstream(flow.request.host), len(flow.request.raw_content or b""))
                return
            seen = self._seen.pop(flow)
            if seen is None:
                return
            upstream = metrics.upstream(flow.request.host)
            metrics.request(self._counted(flow, seen), upstream, seen.client_bytes)
            metrics.sent(upstream, _sent(flow.metadata, seen, flow.request.raw_content))
            self._sync_counters(metrics)
        except Exception:
            internal_error(self.counters, "counting a request")

    def _sync_counters(self, metrics: Metrics) -> None:
        for attribute, reason in COUNTED_FALLBACKS:
            now = getattr(self.counters, attribute)
            if now > self._synced[attribute]:
                metrics.fallback(reason, now - self._synced[attribute])
            self._synced[attribute] = now

    def _counted(self, flow: http.HTTPFlow, seen: _Seen | None) -> Counted:
        md = flow.metadata
        counted = classify(md.get(DECISION) or {}, md.get(BRIDGED) or {}, md.get(EMULATION) or {},
                           md.get(CONVERSATION) or {}, md.get(ROUTED) or {}, OVERFLOW in md,
                           seen is not None and seen.answered)
        if SOCKET_TURN in md:  # a response.create on a socket the proxy serves: the client's transport
            counted = dataclasses.replace(counted, transport="websocket")
        return counted

    # -- traces --------------------------------------------------------------------

    def call(self, flow: http.HTTPFlow, call: Call) -> None:
        """A call the continuation record finished: its span."""
        if not self.traces.on:
            return
        if call.client_transport == "websocket":
            counted = Counted("passed", "websocket", ())
        elif call.protocol == "openai-responses":
            counted = self._counted(flow, self._seen.get(flow))
        else:
            counted = None
        self.traces.span(call, counted, flow.request.host)

    def store_operation(self, backend: str, operation: str, seconds: float, failed: bool) -> None:
        if self.metrics is not None:
            self.metrics.store_operation(backend, operation, seconds, failed)


def _sent(metadata: Mapping, seen: _Seen, body: bytes | None) -> int:
    """The bytes a client's flow itself sent upstream: over the bridge's
    sockets, their messages (an HTTP fallback is a retry of ours, counted as
    such); none when the proxy answered it, or when a retry of ours sent its
    body (a withheld one)."""
    bridged = metadata.get(BRIDGED) or {}
    if bridged:
        return int(bridged.get("sent_bytes") or 0)
    if seen.answered or WITHHELD in metadata:
        return 0
    return len(body or b"")


class TelemetryStart:
    """Listed before every capability: a request's hooks begin here."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def request(self, flow: http.HTTPFlow) -> None:
        self.telemetry.began(flow)
