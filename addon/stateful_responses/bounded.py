"""A least-recently-used dict of at most ``limit`` entries: every in-memory
cache of the addon is one, so that memory stays bounded whatever the traffic."""

from __future__ import annotations

from collections import OrderedDict
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
