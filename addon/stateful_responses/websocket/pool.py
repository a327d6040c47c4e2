"""The upstream sockets the proxy holds. Pure: a connection is any object that
says whether it is ``open``; the clock is given.

Sockets belong to one upstream + credential (a scope: the upgrade carried that
credential), each runs one turn at a time and remembers its most recent
completed response (its ``Tip``, under a namespace root that adds the model).
A turn takes the idle socket whose tip its history strictly extends (the
deepest), else one that remembers nothing, else a new socket while the scope
has fewer than ``max_per_scope``, else the least recently used idle one (its
memory is replaced), else none: it goes over HTTP. So parallel conversations, and two turns of one branch at
once, each get a socket of their own.

Bounded and expiring: at most ``max_per_scope`` sockets per scope and
``max_total`` in all; a socket idle for ``idle_s`` is closed, and one is
rotated before the API's 60 minutes (``ROTATE_AFTER``): no new turn starts on
it, and it is closed once its turn is over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .messages import Tip

ROTATE_AFTER = 55 * 60.0  # the API refuses a socket's turns after 60 minutes; clients rotate at 55
MAX_SOCKETS = 1024  # across every upstream + credential


@dataclass(eq=False)
class Held:
    """One socket the proxy holds, and what it is doing."""

    scope: str
    opened: float
    used: float
    connection: Any = None  # None while it opens
    tip: Tip | None = None
    busy: bool = True
    retired: bool = False  # no new turn starts on it: closed once its turn is over

    @property
    def open(self) -> bool:
        return self.connection is not None and bool(self.connection.open)


@dataclass(frozen=True)
class Choice:
    """The socket a turn takes (now busy), the tip it continues from (None:
    full history), and whether the caller must open its connection."""

    held: Held
    continued: Tip | None
    fresh: bool


class Pool:
    def __init__(self, clock: Callable[[], float], max_per_scope: int, idle_s: float,
                 max_total: int = MAX_SOCKETS, rotate_after: float = ROTATE_AFTER) -> None:
        self.clock = clock
        self.max_per_scope = max_per_scope
        self.idle_s = idle_s
        self.max_total = max_total
        self.rotate_after = rotate_after
        self._scopes: dict[str, list[Held]] = {}
        self._total = 0
        self._closing: list = []  # connections taken out of the pool, for the caller to close

    def __len__(self) -> int:
        return self._total

    def sockets(self, scope: str) -> list[Held]:
        return list(self._scopes.get(scope, ()))

    def choose(self, scope: str, root: bytes, digests: list[bytes], references: dict[bytes, str]) -> Choice | None:
        """The socket for a turn of ``scope`` whose history is ``digests``
        (``references``: which of them are item references, and to what id).
        Connections found expired on the way wait in ``take_closing``."""
        now = self.clock()
        self._expire(scope, now)
        sockets = self._scopes.get(scope, [])
        idle = [h for h in sockets if not h.busy]
        extended = [h for h in idle if h.tip is not None and h.tip.extended_by(root, digests, references)]
        if extended:
            held = max(extended, key=lambda h: h.tip.length if h.tip else 0)
            return Choice(self._take(held, now), held.tip, False)
        blank = [h for h in idle if h.tip is None]
        if blank:
            return Choice(self._take(blank[-1], now), None, False)
        if len(sockets) < self.max_per_scope and self._total < self.max_total:
            held = Held(scope, now, now)
            self._scopes.setdefault(scope, []).append(held)
            self._total += 1
            return Choice(held, None, True)
        if idle:
            held = min(idle, key=lambda h: h.used)
            return Choice(self._take(held, now), None, False)
        return None

    @staticmethod
    def _take(held: Held, now: float) -> Held:
        held.busy, held.used = True, now
        return held

    def opened(self, held: Held, connection: Any) -> None:
        """``held`` has a connection (new, or replacing one that broke)."""
        held.connection = connection
        held.opened = held.used = self.clock()
        held.tip = None

    def release(self, held: Held, tip: Tip | None) -> Any | None:
        """A turn is over: ``tip`` is what the socket now remembers (None:
        nothing). Returns the connection to close when the socket is not kept
        (closed, broken, retired or past its age)."""
        held.busy, held.used, held.tip = False, self.clock(), tip
        if held.open and not held.retired and held.used - held.opened < self.rotate_after:
            return None
        return self.remove(held)

    def remove(self, held: Held) -> Any | None:
        """Take ``held`` out of the pool (a connection that failed or broke); its connection, if any."""
        sockets = self._scopes.get(held.scope)
        if sockets is not None and held in sockets:
            sockets.remove(held)
            self._total -= 1
            if not sockets:
                del self._scopes[held.scope]
        held.retired = True
        return held.connection

    def sweep(self) -> list:
        """Every connection to close now: idle too long, past its age, or
        closed by the upstream while idle."""
        now = self.clock()
        for scope in list(self._scopes):
            self._expire(scope, now)
        return self.take_closing()

    def take_closing(self) -> list:
        closing, self._closing = self._closing, []
        return closing

    def _expire(self, scope: str, now: float) -> None:
        for held in list(self._scopes.get(scope, ())):
            if held.busy:
                held.retired = held.retired or now - held.opened >= self.rotate_after
                continue
            if not held.open or now - held.used >= self.idle_s or now - held.opened >= self.rotate_after:
                connection = self.remove(held)
                if connection is not None:
                    self._closing.append(connection)

    def close_all(self) -> list:
        """Every connection, busy or not: the proxy stops, or the bridge is turned off."""
        everything = [h for sockets in self._scopes.values() for h in sockets]
        return [c for c in (self.remove(h) for h in everything) if c is not None]
