"""What the addon has learned about each upstream as seen by one credential
(a scope, ``Tenancy.scope``): one view every capability reads and writes, so
that what one learns holds for all the others at once.

Marks: ``unsupported`` (does not store responses), ``no_forced_store``
(refuses a forced ``store: true``), ``honours_previous`` (echoed a
``previous_response_id`` correctly: there, an answer that omits ``store`` may
be taken at the request's word), ``refuses_previous`` (refused or ignored a
``previous_response_id`` the record held). Each expires; setting one queues
the write that shares it with every process using the store.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Literal

from .settings import Config
from .state.outbox import Outbox, Write
from .tenancy import Tenancy

MARKS = "marks"  # kind + scope -> when it expires

MarkKind = Literal["unsupported", "no_forced_store", "honours_previous", "refuses_previous"]
MARK_KINDS = frozenset(MarkKind.__args__)  # type: ignore[attr-defined]

# Answers that say "not now", not "not this": the client's SDK retries them and
# the same answer would have come without the addon, so they teach nothing.
TRANSIENT_STATUSES = frozenset({408, 425, 429})


def _mark_key(kind: MarkKind, scope: str) -> bytes:
    return f"{kind}\x00{scope}".encode()


class Upstreams:
    tables = {MARKS: 10_000}

    def __init__(self, config: Config, tenancy: Tenancy) -> None:
        self.config = config
        self._expires: dict[tuple[str, str], float] = {}
        self._outbox = Outbox()
        tenancy.on_new_secret(self._expires.clear)  # scopes are named anew: the marks are unreachable

    def has(self, kind: MarkKind, scope: str) -> bool:
        expires = self._expires.get((kind, scope))
        return expires is not None and expires > self.config.clock()

    def mark(self, kind: MarkKind, scope: str) -> bool:
        """Set a mark; False when it was already set."""
        if self.has(kind, scope):
            return False
        expires = self.config.clock() + self.config.ttl
        self._expires[(kind, scope)] = expires
        self._outbox.append(Write(MARKS, _mark_key(kind, scope), struct.pack("!d", expires), self.config.ttl))
        return True

    def load(self, records: Mapping[bytes, bytes]) -> None:
        """Take in the marks other processes set (a scan of the store)."""
        for key, value in records.items():
            kind, _, scope = key.decode(errors="replace").partition("\x00")
            if kind in MARK_KINDS and len(value) == 8:
                expires = struct.unpack("!d", value)[0]
                self._expires[(kind, scope)] = max(expires, self._expires.get((kind, scope), 0.0))

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self._expires.clear()
        self._outbox.clear()
