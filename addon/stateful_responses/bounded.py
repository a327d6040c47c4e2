"""A least-recently-used dict of at most ``limit`` entries: every in-memory
cache of the addon is one, so that memory stays bounded whatever the traffic;
caches whose values may be large (a client's items, a recorded turn) are bounded
by their values' bytes too."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class Bounded(OrderedDict):
    """A least-recently-used dict of at most ``limit`` entries."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def hit(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value


_ABSENT = object()


class Weighed(Bounded):
    """A ``Bounded`` whose values also weigh at most ``max_bytes`` in all
    (``weigh`` of each); changed through ``put``, ``pop`` and ``clear`` only."""

    def __init__(self, limit: int, max_bytes: int, weigh: Callable[[Any], int] = len) -> None:
        super().__init__(limit)
        self.max_bytes = max_bytes
        self.weigh = weigh
        self.bytes = 0

    def put(self, key: Any, value: Any) -> None:
        """A value heavier than the whole bound is not kept (nor does it push the others out)."""
        self.pop(key)
        weight = self.weigh(value)
        if weight > self.max_bytes:
            return
        self[key] = value
        self.bytes += weight
        while self and (len(self) > self.limit or self.bytes > self.max_bytes):
            _, gone = self.popitem(last=False)
            self.bytes -= self.weigh(gone)

    def pop(self, key: Any, default: Any = None) -> Any:
        value = super().pop(key, _ABSENT)
        if value is _ABSENT:
            return default
        self.bytes -= self.weigh(value)
        return value

    def clear(self) -> None:
        super().clear()
        self.bytes = 0
