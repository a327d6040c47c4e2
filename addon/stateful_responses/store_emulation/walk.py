"""The chain walk of store emulation (seed 000), as a pure function given a ``get``.

From the response a client names in ``previous_response_id`` back to the first
turn, newest to oldest, with the seed's guards in the seed's order: depth,
cycle, missing, not completed. The context of the chain is every turn's input
items followed by its output items, oldest first; earlier turns'
``instructions`` are not part of it (the API does not inherit them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Link(Generic[T]):
    """What the walk needs of one recorded turn."""

    response_id: str
    previous_response_id: str | None
    status: str
    turn: T


class ChainError(Exception):
    """A chain that cannot be expanded, with the API's error code and a
    message naming the ids (never content)."""

    def __init__(self, code: str, message: str, response_id: str, previous_response_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.response_id = response_id
        self.previous_response_id = previous_response_id

    @property
    def body(self) -> dict:
        """The API's error body: the code clients' fallbacks key on."""
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": "previous_response_id", "code": self.code}}


def not_found(response_id: str) -> ChainError:
    return ChainError("previous_response_not_found", f"Previous response with id '{response_id}' not found.",
                      response_id)


async def walk(get: Callable[[str], Awaitable[Link[T] | None]], response_id: str, max_depth: int) -> list[T]:
    """The turns of the chain ending at ``response_id``, oldest first."""
    turns: list[T] = []
    visited: set[str] = set()
    current: str | None = response_id
    child: str | None = None
    while current:
        if len(turns) >= max_depth:
            raise ChainError("session_chain_depth_exceeded",
                             f"The chain ending at response '{response_id}' is deeper than {max_depth} responses "
                             f"(walked back to '{current}').", response_id, current)
        if current in visited:
            raise ChainError("session_chain_cycle_detected",
                             f"The chain ending at response '{response_id}' comes back to '{current}'.",
                             response_id, current)
        visited.add(current)
        link = await get(current)
        if link is None:
            if current == response_id:
                raise not_found(response_id)
            raise ChainError("previous_response_not_found",
                             f"Previous response with id '{current}' not found (an ancestor of "
                             f"'{response_id}', through '{child}').", response_id, current)
        if link.status != "completed":
            raise ChainError("session_chain_unavailable",
                             f"Response '{current}' in the chain ending at '{response_id}' is {link.status}, "
                             f"not completed.", response_id, current)
        turns.append(link.turn)
        child, current = current, link.previous_response_id
    turns.reverse()
    return turns
