"""A backend whose every call is timed and told to an observer (telemetry's
store metrics), without changing what the call does or returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import Storage

# The backend calls that are timed: the ``Storage`` interface's, a fixed set (a metric's label values).
OPERATIONS = ("open", "keyring", "get", "put", "delete", "write", "scan", "clear", "ping", "close")
# backend kind, operation, seconds, whether it failed (raised, or was given up: a read past its wait)
Observer = Callable[[str, str, float, bool], None]


class Observed:
    """``storage`` as it is, each call of ``OPERATIONS`` timed for ``observe``."""

    def __init__(self, storage: Storage, kind: str, observe: Observer) -> None:
        self.storage = storage
        self.kind = kind
        self.observe = observe

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.storage, name)
        if name not in OPERATIONS:
            return attribute

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start, failed = time.perf_counter(), True
            try:
                result = await attribute(*args, **kwargs)
                failed = False
                return result
            finally:
                self.observe(self.kind, name, time.perf_counter() - start, failed)

        return timed
