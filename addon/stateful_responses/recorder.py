"""Store emulation's record: turns in, chains out. Pure: reads go through the
async ``get`` callables the glue passes in, writes leave through an outbox.

Memory keeps the recent turns and items (bounded); the backing store keeps
everything for other processes and restarts, until it expires.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from .chain import ChainError, Link, walk
from .items import canonical_json
from .state import Bounded, Write
from .turns import ITEMS, TURNS, Tenant, TurnBody, TurnHeader

GetRecords = Callable[[str, Sequence[bytes]], Awaitable[Mapping[bytes, bytes]]]
_ENCODE = msgspec.json.Encoder(decimal_format="number").encode


def exact_digest(raw: bytes) -> bytes:
    return blake3(raw).digest(16)


def string_input_item(raw_string: bytes) -> bytes:
    """A string ``input`` is one user message (the API's rule), its text
    byte for byte the client's."""
    return b'{"role":"user","content":' + raw_string + b"}"


@dataclass
class Turn:
    header: TurnHeader
    body: TurnBody


@dataclass
class Recorder:
    ttl: float
    max_depth: int = 1000
    clock: Callable[[], float] = field(default=time.time, repr=False)
    turns: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # turn key -> record
    items: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # item key -> item JSON
    inputs: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # (tenant, input digest) -> id
    _outbox: list[Write] = field(default_factory=list, repr=False)

    def take_writes(self) -> list[Write]:
        writes, self._outbox = self._outbox, []
        return writes

    def clear(self) -> None:
        self.turns.clear()
        self.items.clear()
        self.inputs.clear()
        self._outbox.clear()

    # -- recording ---------------------------------------------------------------

    def record(self, tenant: Tenant, *, response: Mapping[str, Any], previous_response_id: str | None,
               raw_input: Sequence[bytes], stored_upstream: bool) -> None:
        """One completed answer: its turn and its new items go to the outbox
        (and memory, so that this process finds it at once)."""
        response_id = response["id"]
        output = [_ENCODE(item) for item in response.get("output") or []]
        digests = [exact_digest(raw) for raw in raw_input]
        rolling = _rolling(digests)
        base, start = None, 0
        if previous_response_id is None:  # a full-history turn: share the input it extends
            for k in range(len(rolling) - 1, 0, -1):
                base = self.inputs.hit((tenant.tag, rolling[k - 1]))
                if base is not None:
                    start = k
                    break
        size = 0
        input_keys = []
        for raw, digest in zip(raw_input[start:], digests[start:], strict=True):
            input_keys.append(self._item(tenant, raw, digest))
            size += len(raw)
        output_keys = []
        for raw in output:
            output_keys.append(self._item(tenant, raw, exact_digest(raw)))
            size += len(raw)
        shell = {k: v for k, v in response.items() if k != "output"}
        body = TurnBody(response_id, previous_response_id, base, input_keys, output_keys, _ENCODE(shell))
        fingerprint_of = (previous_response_id, rolling[-1] if rolling else b"", output_keys)
        key, record = tenant.seal_turn(body, created=self.clock(), size=size + len(body.response),
                                       stored_upstream=stored_upstream, fingerprint_of=fingerprint_of)
        self.turns.put(key, record)
        if rolling:
            self.inputs.put((tenant.tag, rolling[-1]), response_id)
        self._outbox.append(Write(TURNS, key, record, self.ttl, new=True, label=response_id))

    def _item(self, tenant: Tenant, raw: bytes, digest: bytes) -> bytes:
        key = tenant.item_key(digest)
        if self.items.hit(key) is None:
            self.items.put(key, raw)
            self._outbox.append(Write(ITEMS, key, tenant.seal(raw, key), self.ttl))
        return key

    def forget(self, tenant: Tenant, response_id: str) -> None:
        """A deleted response: continuing from it is "not found" from now on."""
        key = tenant.turn_key(response_id)
        self.turns.pop(key, None)
        self._outbox.append(Write(TURNS, key, None))

    # -- reading -------------------------------------------------------------------

    async def turn(self, tenant: Tenant, response_id: str, get: GetRecords) -> Turn | None:
        """One recorded turn of this tenant, or None (unknown, expired, a
        conflict, sealed for someone else)."""
        key = tenant.turn_key(response_id)
        record = self.turns.hit(key)
        if record is None:
            record = (await get(TURNS, [key])).get(key)
            if record is None:
                return None
            self.turns.put(key, record)
        opened = tenant.open_turn(response_id, record)
        if opened is None or opened[0].status == "conflict":
            return None
        return Turn(*opened)

    async def context(self, tenant: Tenant, previous_response_id: str, get: GetRecords) -> list[bytes]:
        """The items of the chain ending at ``previous_response_id``, oldest
        first: each turn's input, then its output. ChainError when it cannot
        be expanded (the API's error, the ids named)."""

        async def link(response_id: str) -> Link[Turn] | None:
            turn = await self.turn(tenant, response_id, get)
            if turn is None:
                return None
            return Link(response_id, turn.body.previous_response_id, turn.header.status, turn)

        turns = await walk(link, previous_response_id, self.max_depth)
        keys: list[bytes] = []
        for turn in turns:
            keys += await self._input_keys(tenant, turn, get, previous_response_id)
            keys += turn.body.output
        return await self._items(tenant, keys, get, previous_response_id)

    async def output_items(self, tenant: Tenant, turn: Turn, get: GetRecords) -> list[bytes]:
        return await self._items(tenant, list(turn.body.output), get, turn.body.response_id)

    async def input_items(self, tenant: Tenant, turn: Turn, get: GetRecords) -> list[bytes]:
        """The input a turn's request carried, as the client sent it."""
        keys = await self._input_keys(tenant, turn, get, turn.body.response_id)
        return await self._items(tenant, keys, get, turn.body.response_id)

    async def _input_keys(self, tenant: Tenant, turn: Turn, get: GetRecords, asked: str) -> list[bytes]:
        keys = list(turn.body.input)
        base, depth = turn.body.input_base, 0
        while base is not None:
            depth += 1
            based_on = await self.turn(tenant, base, get) if depth <= self.max_depth else None
            if based_on is None:
                raise ChainError("session_chain_unavailable",
                                 f"The input of a response in the chain ending at '{asked}' is no longer "
                                 f"available (it extends '{base}').", asked, base)
            keys = based_on.body.input + keys
            base = based_on.body.input_base
        return keys

    async def _items(self, tenant: Tenant, keys: list[bytes], get: GetRecords, asked: str) -> list[bytes]:
        found = {k: v for k in keys if (v := self.items.hit(k)) is not None}
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        if missing:
            for key, sealed in (await get(ITEMS, missing)).items():
                raw = tenant.open(sealed, key)
                if raw is not None:
                    found[key] = raw
                    self.items.put(key, raw)
        if len(found) < len(set(keys)):
            raise ChainError("session_chain_unavailable",
                             f"Items of the chain ending at '{asked}' are no longer available.", asked)
        return [found[k] for k in keys]


def _rolling(digests: Sequence[bytes]) -> list[bytes]:
    hasher, out = blake3(), []
    for d in digests:
        hasher.update(d)
        out.append(hasher.digest(16))
    return out


def response_json(turn: Turn, output: Sequence[bytes]) -> bytes:
    """The stored response object, whole again (for GET /responses/{id})."""
    shell = turn.body.response
    items = b"[" + b",".join(output) + b"]"
    if shell == b"{}":
        return b'{"output":' + items + b"}"
    return shell[:-1] + b',"output":' + items + b"}"


def listed_items(raw_items: Sequence[bytes], response_id: str) -> list[dict]:
    """Input items as the API lists them: each with an id (made stable for
    items the client sent without one)."""
    listed = []
    for n, raw in enumerate(raw_items):
        item = json.loads(raw)
        if isinstance(item, dict) and "id" not in item:
            item = {"id": "msg_" + blake3(canonical_json([response_id, n])).hexdigest(12), **item}
            if item.get("type") is None and "role" in item:
                item["type"] = "message"
        listed.append(item)
    return listed
