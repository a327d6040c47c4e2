"""One HTTP request answered over an upstream socket. Pure: asyncio, a socket
and the client's answer (``loopback.Answer``).

Never worse than no bridge. Until a byte reached the client, every failure is
invisible: a socket that closes or breaks, an error event about the socket's
state (``STATE_ERRORS``), any refusal of a continuation, or a continuation the
upstream did not echo, sends the turn again with its full history on a fresh
socket (a socket lost or worn out continues it again there instead, when the
response it continues is stored and proven readable), and then over HTTP (the
client's own request, sent as mitmproxy sends it). A refusal of the client's
own request goes once over HTTP, whose answer is the client's; other error
events become the HTTP status and body the API gives (a 429 stays a 429, so
the SDK retries). Once a streaming client has bytes, a broken socket breaks
the client's stream, as a dropped HTTP stream would.

Bounded in time: an upstream that took the turn and sends nothing never holds
the client and the socket for good. No first event within ``first_event_s``,
or no next one within ``silence_s``, drops the socket; before a byte reached
the client the turn goes over HTTP, after, the client's stream breaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from websockets.exceptions import ConnectionClosed

from .connect import Refused, Unreachable, UpstreamSocket
from .loopback import Answer
from .messages import (
    STATE_ERRORS,
    UNUSABLE_SOCKET_ERRORS,
    Event,
    Tip,
    answered_response,
    echoed_previous,
    error_answer,
    read_event,
    retried_on_a_socket,
    retried_over_http,
    tip_after,
)
from .pool import Held, Pool

HttpAnswer = tuple[int, Sequence[tuple[bytes, bytes]], bytes]


@dataclass
class Outcome:
    """How the turn was finally answered, for the flow, the record and the counters."""

    transport: Literal["websocket", "http"] = "websocket"
    previous_response_id: str | None = None  # what the answer was continued from
    items_sent: int = 0
    retries: list[str] = field(default_factory=list)  # why each further attempt was made
    refused_upgrade: int | None = None  # the status an upgrade was refused with
    unverified: bool = False  # a continuation came back without its previous_response_id
    dropped: str | None = None  # why the client's stream was cut after it had bytes (the socket broke or fell silent)
    status: int | None = None  # the HTTP status the client got
    abandoned: bool = False  # the client went away before any answer: the turn was not sent over HTTP
    response: bytes | None = None  # the response object answered over the socket, as a JSON client gets it
    refused_continuation: Any = None  # the error code (or status) a continuation was refused with
    refused_the_field: bool = False  # ... by an error that names previous_response_id (not the socket's state)
    closes_unused: bool = False  # sockets opened for this turn, two in a row, closed before their first event
    sent_bytes: int = 0  # the messages sent over sockets for it, every attempt's
    missed_memory: int = 0  # continuations the socket answered previous_response_not_found (a cache miss: no refusal)


@dataclass
class Turn:
    """A request to answer over a socket: its messages (the whole input, and
    the continuation when a socket's tip is extended), what the tip check and
    the next tip need, and how to reach the upstream otherwise."""

    streamed: bool
    root: bytes
    digests: list[bytes]  # the request's whole input, item references resolved against the continued tip
    whole: Callable[[], bytes]  # builds the message with the whole input (see full_message)
    items_total: int
    open_socket: Callable[[], Awaitable[UpstreamSocket]]
    over_http: Callable[[Outcome], Awaitable[HttpAnswer]]  # given how the socket failed
    # told how it went just before the answer's last bytes; what it returns, if awaitable, is awaited first
    settle: Callable[[Outcome], Awaitable[None] | None]
    first_event_s: float  # the longest wait for a turn's first event (the API sends response.created at once)
    silence_s: float  # the longest wait for each next one (a reasoning model may think between events)
    continued: Tip | None = None
    delta_message: bytes | None = None
    items_sent: int = 0
    fresh: bool = False  # its socket was opened for it
    stored: bool = False  # continued from a stored response (hydrated), not from the socket's own memory
    # the response continued is stored and proven readable: a fresh socket continues it too (hydrated)
    rehydrate: bool = False
    _full_message: bytes | None = field(default=None, repr=False)

    @property
    def full_message(self) -> bytes:
        """The message with the whole input, built once it is to be sent (a
        full turn, or a continuation's retry): for a long history it costs
        tens of milliseconds of the event loop and the body's size in memory,
        which a continuation answered at once never needs."""
        if self._full_message is None:
            self._full_message = self.whole()
        return self._full_message


@dataclass(frozen=True)
class _Exchange:
    kind: Literal["answered", "refused", "fault", "unverified", "dropped", "silent"]
    event: Event | None = None
    response: msgspec.Raw | None = None
    done_items: dict[int, msgspec.Raw] = field(default_factory=dict)
    waited: float = 0.0  # how long a silent socket was waited for


async def relay(turn: Turn, held: Held, pool: Pool, answer: Answer) -> Outcome:
    """Answer ``turn`` on ``held`` (busy, ours until this returns) into
    ``answer``. The socket goes back to the pool, with what it now remembers,
    before the client has the answer's end: the client's next request finds it."""
    outcome = Outcome()
    continued = turn.continued
    worn_out = False  # the socket cannot take the turn (its age, or a response still running): a fresh one does
    fresh, unused_closes = turn.fresh, 0
    for attempt in (1, 2):
        if not held.open or worn_out:
            if not await _reopen(turn, held, pool, outcome):
                break
            fresh = True
        previous = continued.response_id if continued is not None else None
        message = turn.delta_message if continued is not None else turn.full_message
        assert message is not None
        outcome.sent_bytes += len(message)
        exchange = await _exchange(held.connection, message, previous, turn, answer)
        if exchange.kind == "answered":
            outcome.previous_response_id = previous
            outcome.items_sent = turn.items_sent if continued is not None else turn.items_total
            outcome.status = 200
            _release(pool, held, tip_after(turn.root, turn.digests, exchange.response, exchange.done_items, continued))
            if exchange.response is not None:
                outcome.response = answered_response(exchange.response, exchange.done_items)
            await _settle(turn, outcome)
            if turn.streamed:
                await answer.end_stream()
            else:
                assert outcome.response is not None
                await answer.json(200, outcome.response)
            return outcome
        if exchange.kind == "silent" and not answer.started:
            outcome.retries.append(f"no event within {exchange.waited:g} s")
            held.connection.abort()  # it may still be running the turn: nothing more is read from it
            break
        if exchange.kind in ("dropped", "silent"):
            outcome.dropped = "the socket broke" if exchange.kind == "dropped" else \
                f"the socket fell silent for {exchange.waited:g} s"
            held.connection.abort()
            _release(pool, held, None)
            await _settle(turn, outcome)
            answer.drop()
            return outcome
        if exchange.kind == "unverified":
            outcome.unverified = True
            outcome.retries.append(f"the answer did not echo previous_response_id {previous}")
            held.connection.abort()  # its turn still runs: nothing more is read from it
            break
        if exchange.kind == "fault":
            outcome.retries.append("the socket closed before the first event")
            held.connection.abort()
            unused_closes += fresh
            outcome.closes_unused = unused_closes >= 2  # as an upstream that takes no turn on its sockets does
            continued = continued if turn.rehydrate else None
            continue
        event = exchange.event
        assert event is not None
        reason = f"the socket refused it ({event.error_code or event.http_status})"
        if continued is not None and retried_on_a_socket(event, True) and event.error_code in STATE_ERRORS:
            outcome.missed_memory += event.error_code == "previous_response_not_found"
        elif continued is not None and retried_on_a_socket(event, True) and event.http_status < 500:  # a refusal
            outcome.refused_continuation = event.error_code or event.http_status
            outcome.refused_the_field = event.error is not None and b"previous_response_id" in bytes(event.error)
        if attempt == 1 and retried_on_a_socket(event, continued is not None):
            outcome.retries.append(reason)
            if event.error_code in UNUSABLE_SOCKET_ERRORS:
                held.connection.close_soon()
                worn_out = True
                continued = continued if turn.rehydrate else None
            else:
                continued = None
            continue
        if not retried_over_http(event):
            outcome.status, headers, body = error_answer(event)
            _release(pool, held, None)
            await _settle(turn, outcome)
            await answer.whole(outcome.status, headers, body)
            return outcome
        outcome.retries.append(reason)
        break
    # Over HTTP, the client's own request; a socket still open goes back to the pool.
    _release(pool, held, None)
    if answer.abandoned:  # the client went away: over HTTP the turn would be made, and billed, for nobody
        outcome.abandoned = True
        await _settle(turn, outcome)
        answer.drop()
        return outcome
    outcome.transport = "http"
    outcome.items_sent = turn.items_total
    outcome.status, headers, body = await turn.over_http(outcome)
    await _settle(turn, outcome)
    await answer.whole(outcome.status, headers, body)
    return outcome


async def _settle(turn: Turn, outcome: Outcome) -> None:
    """Tell the turn how it went, and wait for what that started (what it
    taught, on its way to the shared store) before the answer's end."""
    learned = turn.settle(outcome)
    if learned is not None:
        await learned


async def _reopen(turn: Turn, held: Held, pool: Pool, outcome: Outcome) -> bool:
    """A fresh connection for ``held``; False (and why) when there is none."""
    try:
        pool.opened(held, await turn.open_socket())
    except Refused as e:
        outcome.refused_upgrade = e.status
        outcome.retries.append(f"the upgrade was refused ({e.status})")
        return False
    except Unreachable as e:
        outcome.retries.append(f"no socket could be opened ({e})")
        return False
    return True


async def _exchange(socket: UpstreamSocket, message: bytes, previous: str | None, turn: Turn,
                    answer: Answer) -> _Exchange:
    """Send one ``response.create`` and relay its events up to the terminal
    one (the stream's end, or a JSON client's body, is the caller's to write).
    A continuation's events are held back until one carrying the response
    shows it echoes ``previous`` (the first, ``response.created``). The wait
    for each event is bounded by ``turn``'s bounds: past one, ``silent``."""
    try:
        await socket.send(message)
    except (ConnectionClosed, OSError):
        return _Exchange("fault")
    streamed, verified = turn.streamed, previous is None
    held_back: list[tuple[Any, bytes]] = []
    done_items: dict[int, msgspec.Raw] = {}
    wait = turn.first_event_s
    try:
        while True:
            try:
                async with asyncio.timeout(wait):  # no task per event, as wait_for would make
                    text = await socket.recv()
            except TimeoutError:
                return _Exchange("silent", waited=wait)
            wait = turn.silence_s
            event = read_event(text)
            if event.type == "error" and not answer.started:
                return _Exchange("refused", event)
            if not verified and event.response is not None:
                echoed = echoed_previous(event.response)
                if echoed is msgspec.UNSET and not event.terminal:
                    pass  # no echo in this event (some servers give it on the terminal one only): held back still
                elif echoed != previous:
                    return _Exchange("unverified")
                else:
                    verified = True
            if event.type == "response.output_item.done" and event.item is not None \
                    and isinstance(event.output_index, int):
                done_items[event.output_index] = event.item
            if streamed:
                held_back.append((event.type, text))
                if verified:
                    for event_type, held in held_back:
                        await answer.event(event_type if isinstance(event_type, str) else None, held)
                    held_back.clear()
            if event.terminal:
                if not verified:
                    return _Exchange("unverified")
                if not streamed and event.response is None:
                    return _Exchange("fault")
                return _Exchange("answered", event, event.response, done_items)
    except (ConnectionClosed, OSError):
        return _Exchange("dropped" if answer.started else "fault")


def _release(pool: Pool, held: Held, tip: Tip | None) -> None:
    """The turn is over on ``held``: kept with ``tip``, or closed (in the background)."""
    connection = pool.release(held, tip)
    if connection is not None:
        connection.close_soon()
