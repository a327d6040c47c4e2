"""Random bytes from the kernel, read 4 KiB at a time.

``os.urandom`` releases the GIL around its system call, and the event loop
then waits to get it back from whichever thread took it meanwhile (the SQLite
store's): under 32 agents that wait was the addon's largest single cost per
request. The bytes are the kernel's CSPRNG output either way; each is handed
out once, under a lock, and a forked child starts from an empty pool, never
with its parent's bytes (a sealing nonce must never repeat).
"""

from __future__ import annotations

import os
import threading

POOL_SIZE = 4096


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            if self._at + n > len(self._bytes):
                self._bytes, self._at = os.urandom(max(POOL_SIZE, n)), 0
            start = self._at
            self._at += n
            return self._bytes[start:self._at]

    def forget(self) -> None:
        self._lock = threading.Lock()  # a lock held at the fork stays held in the child
        self._bytes, self._at = b"", 0


_POOL = _Pool()
os.register_at_fork(after_in_child=_POOL.forget)


def random_bytes(n: int) -> bytes:
    """``n`` bytes from the kernel's CSPRNG, never handed out before."""
    return _POOL.take(n)
