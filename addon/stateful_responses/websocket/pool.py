"""The upstream sockets the proxy holds. Pure: a connection is any object that
says whether it is ``open``; the clock is given.

Sockets belong to one upstream + credential (a scope: the upgrade carried that
credential), each runs one turn at a time and remembers its most recent
completed response (its ``Tip``, under a namespace root that adds the model).
A turn takes the idle socket whose tip its history strictly extends (the
deepest), else one that remembers nothing, else a new socket while the scope
has fewer than ``max_per_scope``, else the least recently used idle socket
whose tip is stale (its memory is replaced), else, where the upstream +
credential reads stored responses back (``hydrates``), the least recently used
one whose tip is stored (its conversation goes on from storage on any socket,
by ``previous_response_id``), else none: it goes over HTTP (``Declined``).
A live tip held by this socket alone is never replaced: with more conversations than
sockets, replacing the memory the next turn needs makes every turn whole (the
pool thrashes), while leaving the sockets to the conversations that hold them
keeps those continued and sends the others over HTTP, where forward mode
continues them as it would without the bridge. A tip is live while its
conversation's next turn may still come: for ``live_s`` after its use while
the conversation has not shown its pace, else ``LIVE_GAPS`` times the longest
wait between its turns (at least ``MIN_LIVE_S``), so that a conversation that
ended gives its socket to a new one soon. So parallel conversations, and two
turns of one branch at once, each get a socket of their own.

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
LIVE_S = 60.0  # a tip of unknown pace is live this long: an agent loop's next turn follows within seconds
LIVE_GAPS = 3.0  # else live for this many times the longest wait between its conversation's turns
MIN_LIVE_S = 2.0  # and at least this long
# What befalls the pool's sockets, counted by name (telemetry reads ``Pool.events``): a fixed set.
EVENTS = ("opened", "continued", "closed", "declined_busy", "declined_live", "refused", "unreachable")


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
    gap: float = 0.0  # the longest wait between its conversation's turns (0: none seen yet)
    before: tuple[float, float] = (0.0, 0.0)  # its last use and gap before the current turn took it

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


@dataclass(frozen=True)
class Declined:
    """No socket for the turn: every one is ``busy`` (at the caps), or each
    idle one holds a ``live`` conversation's memory (the turn goes over HTTP
    as it would without the bridge, and so will its next ones)."""

    reason: str  # "busy" or "live"


class Pool:
    def __init__(self, clock: Callable[[], float], max_per_scope: int, idle_s: float,
                 max_total: int = MAX_SOCKETS, rotate_after: float = ROTATE_AFTER, live_s: float = LIVE_S) -> None:
        self.clock = clock
        self.live_s = live_s
        self.max_per_scope = max_per_scope
        self.idle_s = idle_s
        self.max_total = max_total
        self.rotate_after = rotate_after
        self._scopes: dict[str, list[Held]] = {}
        self._total = 0
        self._closing: list = []  # connections taken out of the pool, for the caller to close
        self.events: dict[str, int] = dict.fromkeys(EVENTS, 0)  # every name present: read from another thread

    def __len__(self) -> int:
        return self._total

    def sockets(self, scope: str) -> list[Held]:
        return list(self._scopes.get(scope, ()))

    def choose(self, scope: str, root: bytes, digests: list[bytes],
               references: dict[bytes, str], hydrates: bool = False) -> Choice | Declined:
        """The socket for a turn of ``scope`` whose history is ``digests``
        (``references``: which of them are item references, and to what id;
        ``hydrates``: the scope's upstream proved it reads stored responses
        back). Connections found expired on the way wait in ``take_closing``."""
        now = self.clock()
        self._expire(scope, now)
        sockets = self._scopes.get(scope, [])
        idle = [h for h in sockets if not h.busy]
        extended = [h for h in idle if h.tip is not None and h.tip.extended_by(root, digests, references)]
        if extended:
            held = max(extended, key=lambda h: h.tip.length if h.tip else 0)
            held.gap = max(held.gap, now - held.used)
            self.events["continued"] += 1
            return Choice(self._take(held, now), held.tip, False)
        blank = [h for h in idle if h.tip is None]
        if blank:
            return Choice(self._take(blank[-1], now, anew=True), None, False)
        if len(sockets) < self.max_per_scope and self._total < self.max_total:
            held = Held(scope, now, now)
            self._scopes.setdefault(scope, []).append(held)
            self._total += 1
            return Choice(held, None, True)
        replaceable = [h for h in idle if now - h.used >= self._live_for(h)] \
            or [h for h in idle if hydrates and h.tip is not None and h.tip.stored]
        if replaceable:
            held = min(replaceable, key=lambda h: h.used)
            return Choice(self._take(held, now, anew=True), None, False)
        reason = "live" if idle else "busy"
        self.events[f"declined_{reason}"] += 1
        return Declined(reason)

    def _live_for(self, held: Held) -> float:
        return self.live_s if held.gap == 0 else max(MIN_LIVE_S, LIVE_GAPS * held.gap)

    @staticmethod
    def _take(held: Held, now: float, anew: bool = False) -> Held:
        """``held`` is busy from ``now``; ``anew``: with another conversation than the one it remembers."""
        held.before = (held.used, held.gap)
        held.busy, held.used = True, now
        if anew:
            held.gap = 0.0
        return held

    def opened(self, held: Held, connection: Any) -> None:
        """``held`` has a connection (new, or replacing one that broke)."""
        if held.connection is not None:
            self.events["closed"] += 1  # the one it replaces
        held.connection = connection
        held.opened = held.used = self.clock()
        self.events["opened"] += 1
        held.tip = None

    def release(self, held: Held, tip: Tip | None) -> Any | None:
        """A turn is over: ``tip`` is what the socket now remembers (None:
        nothing). Returns the connection to close when the socket is not kept
        (closed, broken, retired or past its age)."""
        held.busy, held.used, held.tip = False, self.clock(), tip
        if held.open and not held.retired and held.used - held.opened < self.rotate_after:
            return None
        return self.remove(held)

    def give_back(self, held: Held) -> Any | None:
        """A turn took ``held`` and made none on it (it went over HTTP, or its
        flow never came): idle again as it was, its memory and that memory's
        pace untouched. A give-back is no turn of the conversation it
        remembers: stamped as one, a conversation that ended would look live
        again, and keep its socket from the ones still going."""
        used, gap = held.before
        tip = held.tip
        connection = self.release(held, tip)
        if connection is None and used:
            held.used, held.gap = used, gap
        return connection

    def remove(self, held: Held) -> Any | None:
        """Take ``held`` out of the pool (a connection that failed or broke); its connection, if any."""
        sockets = self._scopes.get(held.scope)
        if sockets is not None and held in sockets:
            sockets.remove(held)
            self._total -= 1
            if held.connection is not None:
                self.events["closed"] += 1
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
