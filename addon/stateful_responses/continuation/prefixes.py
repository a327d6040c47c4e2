"""The prefix store: which item sequences an upstream has provably stored.

Each stored response is one entry keyed by the rolling digest of its whole item
sequence (its inputs followed by its output, see ``items.ItemSequence``).
A request is continued from the deepest entry whose sequence it strictly
extends. Because the key is a digest of content, conversations that share a
prefix share entries, interleaved conversations never disturb each other, and a
fork continues from the deepest ancestor it still shares.

Entries are grouped into branches: an answer that extends a branch's tip
advances that branch; an answer from anywhere else starts a new one. Branches
are evicted least-recently-used beyond ``max_branches``, and a branch keeps at
most ``max_entries_per_branch`` entries (its newest), so memory is bounded by
``max_branches * max_entries_per_branch`` small entries whatever the traffic.
Each entry also expires (the upstream forgets stored responses after a while).

This is the in-process cache of what the addon knows; the backing store
holds the same entries (``StoredEntry``) for other processes and restarts,
keyed by their digests alone: on a Redis Cluster they spread one by one over
the shards, every conversation's and every tenant's, since no entry needs
another (a reader that misses one continues from a shorter prefix, or sends
the request whole).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec


@dataclass(eq=False)
class Branch:
    scope: str
    entries: list[bytes] = field(default_factory=list)

    @property
    def tip(self) -> bytes | None:
        return self.entries[-1] if self.entries else None


@dataclass(eq=False)
class Entry:
    response_id: str
    length: int
    branch: Branch
    expires: float


@dataclass(frozen=True)
class Match:
    digest: bytes
    response_id: str
    length: int


class PrefixStore:
    def __init__(self, max_branches: int, max_entries_per_branch: int = 128) -> None:
        if max_branches < 1 or max_entries_per_branch < 1:
            raise ValueError("bounds must be positive")
        self.max_branches = max_branches
        self.max_entries_per_branch = max_entries_per_branch
        self._entries: dict[bytes, Entry] = {}
        self._branches: OrderedDict[Branch, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def branch_count(self) -> int:
        return len(self._branches)

    def deepest(self, prefixes: Sequence[bytes], now: float) -> Match | None:
        """The deepest unexpired stored sequence that ``prefixes`` strictly extends.

        ``prefixes[k - 1]`` is the digest of the request's first k items; only
        k < len(prefixes) qualifies, so at least one item is always new.
        """
        for k in range(len(prefixes) - 1, 0, -1):
            entry = self._entries.get(prefixes[k - 1])
            if entry is None:
                continue
            if entry.expires <= now:
                self.forget(prefixes[k - 1])
                continue
            self._branches.move_to_end(entry.branch)
            return Match(prefixes[k - 1], entry.response_id, entry.length)
        return None

    def remember(
        self,
        digest: bytes,
        length: int,
        response_id: str,
        parent: bytes | None,
        scope: str,
        expires: float,
    ) -> None:
        """Record that ``response_id`` stores the sequence named by ``digest``."""
        existing = self._entries.get(digest)
        if existing is not None:
            # Same content stored again: the newer id is the one likelier to be
            # retained upstream.
            existing.response_id = response_id
            existing.expires = max(existing.expires, expires)
            self._branches.move_to_end(existing.branch)
            return
        parent_entry = self._entries.get(parent) if parent is not None else None
        if parent_entry is not None and parent_entry.branch.tip == parent:
            branch = parent_entry.branch
        else:
            branch = Branch(scope)
            self._branches[branch] = None
        branch.entries.append(digest)
        self._entries[digest] = Entry(response_id, length, branch, expires)
        self._branches.move_to_end(branch)
        while len(branch.entries) > self.max_entries_per_branch:
            self._entries.pop(branch.entries.pop(0), None)
        while len(self._branches) > self.max_branches:
            oldest, _ = self._branches.popitem(last=False)
            self._drop_branch_entries(oldest)

    def forget(self, digest: bytes) -> bool:
        """Forget one stored sequence (the upstream refused or lost it)."""
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        entry.branch.entries.remove(digest)
        if not entry.branch.entries:
            self._branches.pop(entry.branch, None)
        return True

    def forget_scope(self, scope: str) -> int:
        """Forget every branch of one scope (an upstream found not to store)."""
        doomed = [b for b in self._branches if b.scope == scope]
        for branch in doomed:
            del self._branches[branch]
            self._drop_branch_entries(branch)
        return len(doomed)

    def clear(self) -> None:
        self._entries.clear()
        self._branches.clear()

    def _drop_branch_entries(self, branch: Branch) -> None:
        for digest in branch.entries:
            self._entries.pop(digest, None)
        branch.entries.clear()


ENTRIES = "entries"  # sequence digest -> StoredEntry
REFS = "refs"  # namespace + output item id -> that item's digest (item_reference resolution)


class StoredEntry(msgspec.Struct, array_like=True, frozen=True):
    """A prefix-store entry as stored: which response stores a sequence."""

    response_id: str
    length: int
    scope: str
    expires: float


_ENTRY = msgspec.msgpack.Decoder(StoredEntry)
_ENCODE = msgspec.msgpack.Encoder().encode


def encode_entry(entry: StoredEntry) -> bytes:
    return _ENCODE(entry)


def decode_entry(data: bytes) -> StoredEntry | None:
    """None for a record this version cannot read (never an exception)."""
    try:
        return _ENTRY.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def entries_found(records: Mapping[bytes, bytes]) -> dict[bytes, StoredEntry]:
    """The readable entries among records read from the store."""
    found = {}
    for key, value in records.items():
        entry = decode_entry(value)
        if entry is not None:
            found[key] = entry
    return found
