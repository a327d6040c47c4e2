"""Store emulation's history: turns in, chains out. Pure: reads go through the
async ``get`` callables the glue passes in, writes leave through an outbox.

Memory keeps the recent turns and items (bounded); the backing store keeps
everything for other processes and restarts, until it expires.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from ..bounded import Bounded
from ..items import canonical_json
from ..settings import Config
from ..state.outbox import Outbox, Write
from .turns import ITEMS, TURNS, Tenant, TurnBody, TurnHeader, conflict
from .walk import ChainError, Link, walk

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


_CONFLICT = object()  # memory's mark of an id recorded with two contents


@dataclass
class History:
    config: Config = field(default_factory=Config)
    turns: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # turn key -> Turn, or its record
    items: Bounded = field(default_factory=lambda: Bounded(65536), repr=False)  # item key -> item JSON
    inputs: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # (tenant, input digest) -> id
    # (tenant, response id) -> (chain depth, the chain's item keys): an agent
    # loop's next turn is expanded without walking its chain again.
    contexts: Bounded = field(default_factory=lambda: Bounded(64), repr=False)
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {TURNS: 1_000_000, ITEMS: 4_000_000}

    @property
    def ttl(self) -> float:
        return self.config.ttl

    @property
    def max_depth(self) -> int:
        return self.config.settings.max_depth

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self.turns.clear()
        self.items.clear()
        self.inputs.clear()
        self.contexts.clear()
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
        ancestors: list[bytes] = []
        if previous_response_id is not None:
            parent_key = tenant.turn_key(previous_response_id)
            parent = self.turns.get(parent_key)
            ancestors = [parent_key] + (parent.header.ancestors if isinstance(parent, Turn) else [])
        key, header, record = tenant.seal_turn(body, created=self.config.clock(), size=size + len(body.response),
                                               stored_upstream=stored_upstream, fingerprint_of=fingerprint_of,
                                               ancestors=ancestors)
        known = self.turns.get(key)
        if isinstance(known, Turn) and known.header.fingerprint != header.fingerprint or known is _CONFLICT:
            self.turns.put(key, _CONFLICT)  # one id, two contents: never expanded (the store drops it too)
            self.contexts.clear()
        else:
            self.turns.put(key, Turn(header, body))
        if rolling:
            self.inputs.put((tenant.tag, rolling[-1]), response_id)
        parent_context = self.contexts.get((tenant.tag, previous_response_id)) if previous_response_id else None
        if parent_context is not None and self.turns.get(key) is not _CONFLICT:
            depth, keys = parent_context  # the next turn of an agent loop expands without a walk
            self.contexts.put((tenant.tag, response_id), (depth + 1, keys + input_keys + output_keys))
        self._outbox.append(Write(TURNS, key, record, self.ttl, merge=conflict, label=response_id))

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
        self.contexts.clear()  # a chain through it is "not found" now
        self._outbox.append(Write(TURNS, key, None))

    # -- reading -------------------------------------------------------------------

    async def turn(self, tenant: Tenant, response_id: str, get: GetRecords) -> Turn | None:
        """One recorded turn of this tenant, or None (unknown, expired, a
        conflict, sealed for someone else). Memory keeps turns opened; a turn
        read from the store brings its ancestors' records along."""
        key = tenant.turn_key(response_id)
        known = self.turns.hit(key)
        if isinstance(known, Turn):
            return known
        if known is _CONFLICT:
            return None
        record = known if isinstance(known, bytes) else (await get(TURNS, [key])).get(key)
        if record is None:
            return None
        opened = tenant.open_turn(response_id, key, record)
        if opened is None or opened[0].status == "conflict":
            self.turns.pop(key, None)
            return None
        turn = Turn(*opened)
        self.turns.put(key, turn)
        ancestors = turn.header.ancestors
        missing = [k for k in ancestors if k not in self.turns] if ancestors and ancestors[0] not in self.turns \
            else []
        if missing:  # the walk's next step would be a round trip: make it one for many steps
            for ancestor, ancestor_record in (await get(TURNS, missing)).items():
                self.turns.put(ancestor, ancestor_record)  # opened when the walk gets there
        return turn

    async def context(self, tenant: Tenant, previous_response_id: str, get: GetRecords) -> list[bytes]:
        """The items of the chain ending at ``previous_response_id``, oldest
        first: each turn's input, then its output. ChainError when it cannot
        be expanded (the API's error, the ids named)."""

        async def link(response_id: str) -> Link[Turn] | None:
            turn = await self.turn(tenant, response_id, get)
            if turn is None:
                return None
            return Link(response_id, turn.body.previous_response_id, turn.header.status, turn)

        cached = self.contexts.hit((tenant.tag, previous_response_id))
        if cached is not None and cached[0] <= self.max_depth:
            keys = cached[1]
        else:
            turns = await walk(link, previous_response_id, self.max_depth)
            keys = []
            for turn in turns:
                keys += await self._input_keys(tenant, turn, get, previous_response_id)
                keys += turn.body.output
            self.contexts.put((tenant.tag, previous_response_id), (len(turns), keys))
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


# How the API lists input items: typed, with an id (prefixed by kind), an easy
# message's text as one content part, and a status on the kinds that carry one.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}
_WITH_STATUS = frozenset({"message", "function_call", "function_call_output"})


def listed_items(raw_items: Sequence[bytes], response_id: str) -> list[dict]:
    """Input items as the API lists them (``GET /responses/{id}/input_items``);
    an item the client sent without an id gets a stable one."""
    listed = []
    for n, raw in enumerate(raw_items):
        item = json.loads(raw)
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or "message"
        made_up = f"{_ID_PREFIX.get(kind, 'item')}_{blake3(canonical_json([response_id, n])).hexdigest(12)}"
        entry = {"id": item.get("id") or made_up, "type": kind,
                 **{k: v for k, v in item.items() if k not in ("id", "type")}}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": item["content"]}]
            if part == "output_text":
                entry["content"][0]["annotations"] = []
        if kind in _WITH_STATUS and entry.get("status") is None:
            entry["status"] = "completed"
        listed.append(entry)
    return listed
