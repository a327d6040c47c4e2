"""Routing decisions over several upstreams, read off the continuation record
only (seed 003's rule for routers: chainId, stickyScope, resumeFrom; never a
protocol's own fields). Pure: the glue asks, this decides.

* A turn that resumes from upstream state (``stickyScope: request_chain``: a
  ``previous_response_id``, a continuation the proxy made) goes to the
  upstream that holds its parent; so does input carrying reasoning that
  upstream encrypted, since it arrives in the same chain.
* A chain stays on its upstream (KV-cache affinity, as the prefix-aware routers
  of vLLM's production stack and Ray Serve do); a fork follows where it left.
  A conversation is one chain (``stickyScope: conversation``, its ``chainId``
  named alike by every proxy of one store): every response on it goes where
  the first one went.
* A new chain goes to the upstream with the fewest requests in flight, ties
  taken in turn.
* An upstream that refused a connection or answered 5xx is avoided for a
  while; a turn whose upstream is down goes elsewhere, with full history.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..bounded import Bounded

DOWN_FOR = 10.0  # seconds an upstream that failed is avoided
PROBE_AFTER = 1.0  # an upstream unheard of for this long is probed before use


@dataclass(frozen=True)
class Route:
    upstream: str
    reason: str
    moved: bool = False  # the turn's state lives elsewhere: it must travel as full history
    home: str | None = None  # where its state lives, when it moved or had to stay there


@dataclass
class Routes:
    upstreams: Sequence[str]
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    homes: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # chain or turn id -> upstream
    in_flight: dict[str, int] = field(default_factory=dict)
    _down_until: dict[str, float] = field(default_factory=dict)
    _heard: dict[str, float] = field(default_factory=dict)
    _chosen: dict[str, int] = field(default_factory=dict)  # when each upstream last got a new chain
    _turn: int = 0

    def choose(self, record: Mapping[str, Any], answered_by: str | None = None) -> Route:
        """Where this record's turn goes. ``answered_by``: who answered the
        turn it continues, as the chain index recorded it (another process
        or a restart routed it), where this process's memory has nothing."""
        resume = record.get("resumeFrom") or {}
        home = None
        for key in (resume.get("turnId"), record.get("previousTurnId"), record.get("chainId")):
            if key and (home := self.homes.hit(key)) is not None:
                break
        home = home or answered_by
        if home is not None and home in self.upstreams:
            if self.up(home):
                why = "its parent's state is there" if record.get("stickyScope") == "request_chain" \
                    else "its chain lives there"
                return Route(home, why)
            return Route(self._least_busy(exclude=home), f"its upstream {home} is down", moved=True, home=home)
        return Route(self._least_busy(), "a new chain: fewest requests in flight")

    def settle(self, record: Mapping[str, Any], upstream: str) -> None:
        """The turn went to ``upstream``: its chain and the turn live there now."""
        for key in (record.get("chainId"), record.get("turnId")):
            if key:
                self.homes.put(key, upstream)

    def up(self, upstream: str) -> bool:
        return self._down_until.get(upstream, 0.0) <= self.clock()

    def needs_probe(self, upstream: str) -> bool:
        return self.clock() - self._heard.get(upstream, float("-inf")) > PROBE_AFTER

    def heard_from(self, upstream: str) -> None:
        self._heard[upstream] = self.clock()
        self._down_until.pop(upstream, None)

    def failed(self, upstream: str) -> None:
        self._down_until[upstream] = self.clock() + DOWN_FOR

    def started(self, upstream: str) -> None:
        self.in_flight[upstream] = self.in_flight.get(upstream, 0) + 1

    def ended(self, upstream: str) -> None:
        self.in_flight[upstream] = max(0, self.in_flight.get(upstream, 0) - 1)

    def _least_busy(self, exclude: str | None = None) -> str:
        candidates = [u for u in self.upstreams if u != exclude and self.up(u)] \
            or [u for u in self.upstreams if u != exclude] or list(self.upstreams)
        fewest = min(self.in_flight.get(u, 0) for u in candidates)
        tied = [u for u in candidates if self.in_flight.get(u, 0) == fewest]
        chosen = min(tied, key=lambda u: self._chosen.get(u, -1))  # ties in turn: the least recently chosen
        self._turn += 1
        self._chosen[chosen] = self._turn
        return chosen
