"""What the other addons use of the state store, as an interface: they are
handed the store (``state.addon.StateStore``) and need only this of it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol


class StateAccess(Protocol):
    async def ready(self) -> None:
        """Until the first attempt to reach the store is over (at start only)."""

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Records among ``keys``; nothing when the store is down or slow."""

    async def get_strict(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Records among ``keys``; StorageError when the store cannot say."""

    async def learn_secrets(self) -> bool:
        """Read the store's secrets again (another replica may have made one
        this process has not met yet); whether they changed."""

    def flush(self) -> asyncio.Future | None:
        """Queue every outbox for the store; the future is done once written."""

    async def written(self, done: asyncio.Future | None, timeout: float = ..., *,
                      through_outage: bool = ...) -> bool:
        """Wait, ``timeout`` at most, until writes are durable and visible to
        the other processes (``through_outage``: also once the store is back
        from a failure); whether they are."""
