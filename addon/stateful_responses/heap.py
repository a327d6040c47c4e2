"""Keeps the collector's full passes short while flows are in flight."""

from __future__ import annotations

import gc


class FrozenStartupHeap:
    """mitmproxy starts with about 90 K objects the cyclic collector tracks
    (functions, types, option trees), and each of its full passes walks them
    all: 30 to 60 ms on a busy 2-core machine, during which every flow waits.
    Reading bodies allocates enough to trigger such passes every few seconds.
    Once mitmproxy runs, those objects live as long as the process, so they
    are frozen out of every later pass (``gc.freeze``); a full pass then walks
    only what was made since, a few thousand objects."""

    def running(self) -> None:
        gc.collect()
        gc.freeze()
