"""The Prometheus families, in a registry of their own (never the process's
global one), served by prometheus_client's own HTTP server on a thread: a
scrape never runs on mitmproxy's event loop. Counting is a lock and an add.

Every label value comes from a fixed set (``decisions``, ``pool.EVENTS``,
``observed.OPERATIONS``, the store kinds) or from ``decisions.Hosts``, which
folds hosts past its bound into ``other``: no credential, prompt, id or
anything that grows with traffic is ever a label or a value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .decisions import DECISIONS, FALLBACKS, TRANSPORTS, Counted, Hosts

# The proxy's own time on a request's path: tens of microseconds when planned from memory, milliseconds with a
# store read, up to a proof's wait.
ADDED_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5)
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# (sockets held now, events by name): read at each scrape, from the scrape's thread
SocketsView = Callable[[], tuple[int, Mapping[str, int]]]


class _Sockets(Collector):
    """The bridge's sockets, read when scraped: the pool counts them itself."""

    def __init__(self, view: SocketsView) -> None:
        self.view = view

    def collect(self) -> Iterator[Any]:
        held, events = self.view()
        gauge = GaugeMetricFamily("stateful_upstream_sockets", "Upstream WebSockets the bridge holds now.")
        gauge.add_metric([], held)
        counter = CounterMetricFamily("stateful_upstream_socket_events", "What befell the bridge's upstream "
                                      "WebSockets: opened, continued (a turn on a socket's memory), closed, "
                                      "declined_busy/declined_live (no socket: HTTP), refused, unreachable.",
                                      labels=["event"])
        for event, count in dict(events).items():
            counter.add_metric([event], count)
        yield gauge
        yield counter


class Metrics:
    def __init__(self, sockets: SocketsView) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.hosts = Hosts()
        self.requests = Counter("stateful_requests", "Responses API requests the addon saw, by what it did with "
                                "them, how they went upstream, and the upstream's host.",
                                ["decision", "transport", "upstream"], registry=r)
        self.client_bytes = Counter("stateful_client_request_bytes", "Request body bytes of Responses API "
                                    "requests as the client sent them.", ["upstream"], registry=r)
        self.upstream_bytes = Counter("stateful_upstream_request_bytes", "Request body bytes as they left for the "
                                      "upstream (continuations, expansions and retries included; over the bridge, "
                                      "the socket's message).", ["upstream"], registry=r)
        self.fallbacks = Counter("stateful_fallbacks", "Requests that went on another way than planned, invisibly "
                                 "to the client, by reason.", ["reason"], registry=r)
        self.store_seconds = Histogram("stateful_store_operation_seconds", "Time of each call to the state store.",
                                       ["backend", "operation"], buckets=STORE_BUCKETS, registry=r)
        self.store_errors = Counter("stateful_store_errors", "State store calls that failed or were given up.",
                                    registry=r)
        self.added = Histogram("stateful_request_added_seconds", "The proxy's own time on a request's path: from "
                               "the first of its request hooks to the end of the last.", buckets=ADDED_BUCKETS,
                               registry=r)
        r.register(_Sockets(sockets))
        for reason in FALLBACKS:
            self.fallbacks.labels(reason)  # every reason shows, at 0 until it happens
        self._seen: set[str] = set()
        self._children: dict[tuple[str, ...], Any] = {}  # labels() looked up once per label set
        self._server: Any = None

    def upstream(self, host: str) -> str:
        """The label of ``host``; its every series shows from its first request, at 0 until it happens."""
        label = self.hosts.label(host)
        if label not in self._seen:
            self._seen.add(label)
            for decision in DECISIONS:
                for transport in TRANSPORTS:
                    self.requests.labels(decision, transport, label)
            self.client_bytes.labels(label)
            self.upstream_bytes.labels(label)
        return label

    def _child(self, family: Counter, *labels: str) -> Any:
        key = (family._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def request(self, counted: Counted, upstream: str, client_bytes: int) -> None:
        self._child(self.requests, counted.decision, counted.transport, upstream).inc()
        if client_bytes:
            self._child(self.client_bytes, upstream).inc(client_bytes)
        for reason in counted.fallbacks:
            self._child(self.fallbacks, reason).inc()

    def sent(self, upstream: str, size: int) -> None:
        if size:
            self._child(self.upstream_bytes, upstream).inc(size)

    def fallback(self, reason: str, times: int = 1) -> None:
        self.fallbacks.labels(reason).inc(times)

    def store_operation(self, backend: str, operation: str, seconds: float, failed: bool) -> None:
        self.store_seconds.labels(backend, operation).observe(seconds)
        if failed:
            self.store_errors.inc()

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` at ``host:port`` on prometheus_client's own thread."""
        self._server, _ = start_http_server(port, host, registry=self.registry)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
