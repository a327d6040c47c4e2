"""Responses kept by the emulator, per credential: what ``GET /responses/{id}``,
``previous_response_id`` and item references find."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackgroundJob:
    """A background response still to finish: it is queued for the first half
    of its delay, in progress for the second, then finishes."""

    body: dict
    context: list
    fault: dict | None
    record: dict  # its line in the log, completed when it finishes
    started: float  # time.monotonic()
    delay: float  # seconds
    conversation_id: str | None = None  # the conversation it joins when it completes
    own_items: list = field(default_factory=list)  # its input items as listed: what it adds to the conversation

    def status_at(self, now: float) -> str:
        if now < self.started + self.delay / 2:
            return "queued"
        return "in_progress" if now < self.started + self.delay else "finished"


@dataclass
class StoredResponse:
    response: dict  # as GET returns it now
    chain: list  # every item up to and including its output, as sent: what a continuation starts from
    input_items: list  # the same inputs as the API lists them: typed, with ids
    continuable: bool  # completed and stored: usable as previous_response_id and by item references
    job: BackgroundJob | None = None


@dataclass
class ResponseStore:
    _by_credential: dict[str, dict[str, StoredResponse]] = field(default_factory=dict)

    def put(self, credential: str, stored: StoredResponse) -> None:
        self._by_credential.setdefault(credential, {})[stored.response["id"]] = stored

    def get(self, credential: str, response_id: Any) -> StoredResponse | None:
        if not isinstance(response_id, str):
            return None
        return self._by_credential.get(credential, {}).get(response_id)

    def pop(self, credential: str, response_id: str) -> StoredResponse | None:
        return self._by_credential.get(credential, {}).pop(response_id, None)

    def forget(self, response_id: str) -> None:
        for responses in self._by_credential.values():
            responses.pop(response_id, None)

    def clear(self) -> None:
        self._by_credential.clear()

    def continuable_count(self) -> int:
        return sum(s.continuable for s in self.all())

    def all(self) -> Iterator[StoredResponse]:
        for responses in self._by_credential.values():
            yield from list(responses.values())

    def find_item(self, credential: str, item_id: str) -> dict | None:
        """The stored item with this id, input or output, newest response first."""
        for stored in reversed(list(self._by_credential.get(credential, {}).values())):
            if not stored.continuable:
                continue
            for item in (*stored.response["output"], *stored.input_items):
                if item.get("id") == item_id:
                    return item
        return None
