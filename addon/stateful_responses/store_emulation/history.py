"""Store emulation's history: turns in, chains out. Pure: reads go through the
async ``get`` callables the glue passes in, writes leave through an outbox.

Memory keeps the recent turns and items (bounded); the backing store keeps
everything for other processes and restarts, until it expires.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from ..bounded import Bounded, Weighed
from ..items import canonical_json, normalize_item, strict_loads, window_start
from ..settings import Config
from ..state.outbox import Outbox, Write
from .turns import (
    DELETIONS,
    DEPENDENTS,
    ITEM_IDS,
    ITEMS,
    KEY_SIZE,
    TURNS,
    Tenant,
    TurnBody,
    TurnHeader,
    conflict,
    header_of,
)
from .walk import ChainError, Link, not_found, walk

GetRecords = Callable[[str, Sequence[bytes]], Awaitable[Mapping[bytes, bytes]]]
RENEW_SLACK = 86400.0  # at most a day: see History.slack
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
    key: bytes  # where it is recorded


_CONFLICT = object()  # memory's mark of an id recorded with two contents
MEMORY_BYTES = 64 * 1024 * 1024  # of recorded turns, and of items, kept in memory


def _weight(known: Turn | bytes | object) -> int:
    """What a turn in memory weighs: its sealed record (the body it opens to is as large)."""
    if isinstance(known, Turn):
        return 2 * len(known.header.sealed)
    return len(known) if isinstance(known, bytes) else 0


@dataclass
class History:
    config: Config = field(default_factory=Config)
    # turn key -> Turn, or its record; item key -> item JSON: what clients send may be large (files inlined)
    turns: Weighed = field(default_factory=lambda: Weighed(4096, MEMORY_BYTES, _weight), repr=False)
    items: Weighed = field(default_factory=lambda: Weighed(65536, MEMORY_BYTES), repr=False)
    inputs: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # (tenant, input digest) -> id
    # (tenant, response id) -> (chain depth, the chain's item keys): an agent
    # loop's next turn is expanded without walking its chain again.
    contexts: Bounded = field(default_factory=lambda: Bounded(64), repr=False)
    # (tenant, response id) -> until when every record below that turn is kept
    # (its own record and items apart): see ``record`` and ``renew``.
    renewed: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {TURNS: 1_000_000, ITEMS: 4_000_000, DEPENDENTS: 1_000_000, ITEM_IDS: 1_000_000, DELETIONS: 100_000}

    @property
    def ttl(self) -> float:
        return self.config.ttl

    @property
    def slack(self) -> float:
        """How much longer than the TTL a renewal keeps a chain: renewing it
        whole is due once per slack, not on every turn."""
        return min(RENEW_SLACK, self.ttl / 10)

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
        self.renewed.clear()
        self._outbox.clear()

    # -- recording ---------------------------------------------------------------

    def record(self, tenant: Tenant, *, response: Mapping[str, Any], previous_response_id: str | None,
               raw_input: Sequence[bytes], stored_upstream: bool) -> list[str]:
        """One completed answer: its turn and its items go to the outbox (and
        memory, so that this process finds it at once). Returns the turns it
        relies on whose whole chains are due for renewal (``renew``)."""
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
        # A continuation's input and every output are this turn's own: no
        # other turn can hold them, so they go with it (see ``delete``). A
        # full-history turn's input is history that other turns resend: shared
        # by content.
        own_input = response_id if previous_response_id is not None else None
        turn_key = tenant.turn_key(response_id)
        size = 0
        input_keys = []
        for raw, digest in zip(raw_input[start:], digests[start:], strict=True):
            input_keys.append(key := self._item(tenant, raw, digest, own_input))
            size += len(raw)
            self._index(tenant, _item_id(raw), turn_key + key)
        output_keys = []
        for raw, item in zip(output, response.get("output") or [], strict=True):
            output_keys.append(key := self._item(tenant, raw, exact_digest(raw), response_id))
            size += len(raw)
            self._index(tenant, item.get("id") if isinstance(item, dict) else None, turn_key + key)
        shell = {k: v for k, v in response.items() if k != "output"}
        body = TurnBody(response_id, previous_response_id, base, input_keys, output_keys, _ENCODE(shell))
        fingerprint_of = (previous_response_id, rolling[-1] if rolling else b"", output_keys)
        ancestors: list[bytes] = []
        if previous_response_id is not None:
            parent = self._known(tenant, previous_response_id)
            ancestors = [parent.key, *parent.header.ancestors] if parent else [tenant.turn_key(previous_response_id)]
        key, header, record = tenant.seal_turn(body, created=self.config.clock(), size=size + len(body.response),
                                               stored_upstream=stored_upstream, fingerprint_of=fingerprint_of,
                                               ancestors=ancestors)
        known = self.turns.get(key)
        if isinstance(known, Turn) and known.header.fingerprint != header.fingerprint or known is _CONFLICT:
            self.turns.put(key, _CONFLICT)  # one id, two contents: never expanded (the store drops it too)
            self.contexts.clear()
        else:
            self.turns.put(key, Turn(header, body, key))
        if rolling:
            self.inputs.put((tenant.tag, rolling[-1]), response_id)
        parent_context = self.contexts.get((tenant.tag, previous_response_id)) if previous_response_id else None
        if parent_context is not None and self.turns.get(key) is not _CONFLICT:
            depth, keys = parent_context  # the next turn of an agent loop expands without a walk
            own, cut = input_keys + output_keys, window_start([*raw_input, *output], [(len(raw_input), len(output))])
            self.contexts.put((tenant.tag, response_id), (depth + 1, own[cut:] if cut is not None else keys + own))
        self._outbox.append(Write(TURNS, key, record, self.ttl, merge=conflict, label=response_id))
        return self._relied_on(tenant, response_id, [d for d in (previous_response_id, base) if d is not None])

    async def forget_gone_bases(self, tenant: Tenant, raw_input: Sequence[bytes], get: GetRecords) -> None:
        """Before a full-history turn is recorded (``record``): the turns whose
        input its own extends, as memory knows them, that the store no longer
        has (deleted through another replica, expired, or not taken yet) are
        forgotten as bases, so that the turn keeps its whole input itself
        instead of relying on one that is gone."""
        rolling = _rolling([exact_digest(raw) for raw in raw_input])
        for k in range(len(rolling) - 1, 0, -1):
            base = self.inputs.get((tenant.tag, rolling[k - 1]))
            if base is None:
                continue
            if await get(TURNS, tenant.turn_keys(base)):
                return
            for where in [w for w, v in self.inputs.items() if w[0] == tenant.tag and v == base]:
                del self.inputs[where]

    def _item(self, tenant: Tenant, raw: bytes, digest: bytes, owner: str | None) -> bytes:
        """Record one item (``owner``: the turn whose own it is). Written again
        even when memory knows it: another turn may hold the same shared item,
        and this turn must keep it as long as it lives."""
        key = tenant.item_key(digest, owner)
        self.items.put(key, raw)
        self._outbox.append(Write(ITEMS, key, tenant.seal(raw, key), self.ttl))
        return key

    def _index(self, tenant: Tenant, item_id: object, where: bytes) -> None:
        """An item with an id can be named by an ``item_reference``: where it
        is (its turn's key and its own; keyed hashes both: nothing to seal)."""
        if isinstance(item_id, str) and item_id:
            self._outbox.append(Write(ITEM_IDS, tenant.item_id_key(item_id), where, self.ttl))

    def _relied_on(self, tenant: Tenant, response_id: str, dependencies: list[str]) -> list[str]:
        """A turn relies on the turn it continues and the one whose input it
        extends, and on everything those rely on: all of it must live as long
        as it does. Their own records are kept from now on; the records below
        them were kept long enough if a renewal said so, else they are due."""
        now, keep = self.config.clock(), self.ttl + self.slack
        below, due = now + keep, []
        for dependency in dependencies:
            known = self._known(tenant, dependency)
            for key in [known.key] if known is not None else tenant.turn_keys(dependency):
                self._outbox.append(Write(DEPENDENTS, key, b"", self.ttl))
                self._outbox.append(Write(TURNS, key, None, keep, touch=True))
            if known is not None:
                for item in (*known.body.input, *known.body.output):
                    self._outbox.append(Write(ITEMS, item, None, keep, touch=True))
            renewed = self.renewed.get((tenant.tag, dependency))
            if known is None or renewed is None or renewed < now + self.ttl:
                due.append(dependency)
            else:
                below = min(below, renewed)
        self.renewed.put((tenant.tag, response_id), below)
        return due

    def _known(self, tenant: Tenant, response_id: str) -> Turn | None:
        """The turn as memory has it, wherever it is recorded."""
        return next((t for k in tenant.turn_keys(response_id) if isinstance(t := self.turns.get(k), Turn)), None)

    async def renew(self, tenant: Tenant, response_id: str, get: GetRecords) -> None:
        """Keep everything ``response_id``'s turn relies on for the TTL and a
        slack from now: every turn of its chain and of the inputs they extend,
        their items, and their marks as relied on."""
        keep = self.ttl + self.slack
        turn_keys, item_keys = await self._closure(tenant, response_id, get)
        for key in turn_keys:
            self._outbox.append(Write(TURNS, key, None, keep, touch=True))
            self._outbox.append(Write(DEPENDENTS, key, None, keep, touch=True))
        for key in item_keys:
            self._outbox.append(Write(ITEMS, key, None, keep, touch=True))
        self.renewed.put((tenant.tag, response_id), self.config.clock() + keep)

    async def _closure(self, tenant: Tenant, response_id: str, get: GetRecords) -> tuple[list[bytes], list[bytes]]:
        """The keys of every turn and item ``response_id``'s turn relies on, its own included."""
        turn_keys: list[bytes] = []
        item_keys: list[bytes] = []
        for turn in await walk(self._link(tenant, get), response_id, self.max_depth):
            turn_keys.append(turn.key)
            inputs, bases = await self._input_keys(tenant, turn, get, response_id)
            turn_keys += bases
            item_keys += inputs + turn.body.output
        return turn_keys, list(dict.fromkeys(item_keys))

    async def delete(self, tenant: Tenant, response_id: str, get: GetRecords) -> bool:
        """A client deleted the response: it is never retrieved or continued
        from again. What other turns rely on stays, for them only (the record
        keeps its input and output, not the response object); a turn nothing
        relies on goes with its own items and the item ids naming them (a
        full-history turn's input, shared by content, expires). False when
        nothing (living) was recorded."""
        turn = await self.turn(tenant, response_id, get, as_target=True)
        if turn is None:
            return False
        relied_on = await get(DEPENDENTS, [turn.key])
        self._outbox.append(Write(DELETIONS, tenant.deletion_key(response_id), b"", self.ttl))
        if relied_on:
            self._outbox.append(Write(TURNS, turn.key, tenant.deleted(turn.header, turn.body, turn.key), self.ttl))
        else:
            self._outbox.append(Write(TURNS, turn.key, None))
            await self._remove_own(tenant, turn, get)
        self.turns.pop(turn.key, None)
        self.contexts.pop((tenant.tag, response_id), None)
        self.renewed.pop((tenant.tag, response_id), None)
        for where in [k for k, v in self.inputs.items() if k[0] == tenant.tag and v == response_id]:
            del self.inputs[where]
        return True

    def forget_item_ids(self, tenant: Tenant, item_ids: Iterable[str]) -> None:
        """Items no ``item_reference`` may name any more (a deleted
        conversation's): their ids are removed, whichever turn recorded them."""
        for item_id in dict.fromkeys(item_ids):
            if item_id:
                for key in tenant.item_id_keys(item_id):
                    self._outbox.append(Write(ITEM_IDS, key, None))

    async def deleted_lately(self, tenant: Tenant, response_id: str, get: GetRecords) -> bool:
        """Whether a client deleted the response through the proxy (its mark
        holds no content, only that it was; it lives as long as the record
        would have), so that a DELETE retried after the proxy's 503, or sent
        again through another replica, is answered as done, and ``always``
        mode never serves the id again. A mark found is written again: an
        answer that waits for that write waits for the deletion too (writes
        land in order)."""
        if not await get(DELETIONS, tenant.deletion_keys(response_id)):
            return False
        self._outbox.append(Write(DELETIONS, tenant.deletion_key(response_id), b"", self.ttl))
        return True

    async def _remove_own(self, tenant: Tenant, turn: Turn, get: GetRecords) -> None:
        """Remove a turn's own items (those under keys of its own: an item
        shared by content may be another turn's too) and the item ids that
        still name it."""
        keys = list(dict.fromkeys((*turn.body.input, *turn.body.output)))
        items = {k: v for k in keys if (v := self.items.get(k)) is not None}
        for key, sealed in (await get(ITEMS, [k for k in keys if k not in items])).items():
            if (raw := tenant.open(sealed, key)) is not None:
                items[key] = raw
        recorder, response_id = tenant.recorder(turn.body.response_id, turn.key), turn.body.response_id
        id_keys: dict[bytes, bytes] = {}
        for key, raw in items.items():
            if key == recorder.item_key(exact_digest(raw), response_id):
                self._outbox.append(Write(ITEMS, key, None))
                self.items.pop(key, None)
            if (item_id := _item_id(raw)) is not None:
                id_keys.update(dict.fromkeys(tenant.item_id_keys(item_id), key))
        for id_key, where in (await get(ITEM_IDS, list(id_keys))).items():
            if where == turn.key + id_keys[id_key]:
                self._outbox.append(Write(ITEM_IDS, id_key, None))

    # -- reading -------------------------------------------------------------------

    async def turn(self, tenant: Tenant, response_id: str, get: GetRecords, *, as_target: bool = False,
                   fresh: bool = False) -> Turn | None:
        """One recorded turn of this tenant, or None (unknown, expired, a
        conflict, sealed for someone else).

        As the target of a request (continued from, retrieved, deleted), the
        store decides whether it still exists and a deleted one is None:
        memory may have missed a DELETE on another replica or an expiry
        (``fresh`` asks the store too, and returns a deleted turn as such). As
        a turn a chain passes through, memory's copy serves, deleted or not:
        deleting a response never takes away what others rely on. A turn read
        from the store brings its ancestors' records along."""
        keys = tenant.turn_keys(response_id)
        records: Mapping[bytes, Any] = {}
        fresh = fresh or as_target
        if not fresh:
            for key in keys:
                known = self.turns.hit(key)
                if isinstance(known, Turn):
                    return known
                if known is _CONFLICT:
                    return None
            records = {k: known for k in keys if isinstance(known := self.turns.get(k), bytes)}
        if not records:
            records = await get(TURNS, keys)
        for key in keys:
            record = records.get(key)
            if record is None:
                if fresh:
                    self.turns.pop(key, None)
                continue
            turn = self._opened(tenant, response_id, key, record)
            if turn is None:
                return None
            await self._prefetch_ancestors(turn, get)
            return turn if not as_target or turn.header.status == "completed" else None
        return None

    def _opened(self, tenant: Tenant, response_id: str, key: bytes, record: bytes) -> Turn | None:
        known = self.turns.get(key)
        header = header_of(record)
        if isinstance(known, Turn) and known.header == header:
            return known
        opened = tenant.open_turn(response_id, key, record)
        if opened is None or opened[0].status == "conflict":
            self.turns.pop(key, None)
            return None
        turn = Turn(*opened, key)
        self.turns.put(key, turn)
        return turn

    async def _prefetch_ancestors(self, turn: Turn, get: GetRecords) -> None:
        """The walk's next step would be a round trip: make it one for many steps."""
        ancestors = turn.header.ancestors
        if ancestors and ancestors[0] not in self.turns:
            missing = [k for k in ancestors if k not in self.turns]
            for ancestor, ancestor_record in (await get(TURNS, missing)).items():
                self.turns.put(ancestor, ancestor_record)  # opened when the walk gets there

    def _link(self, tenant: Tenant, get: GetRecords) -> Callable[[str], Awaitable[Link[Turn] | None]]:
        async def link(response_id: str) -> Link[Turn] | None:
            turn = await self.turn(tenant, response_id, get)
            if turn is None:
                return None
            status = "completed" if turn.header.status == "deleted" else turn.header.status
            return Link(response_id, turn.body.previous_response_id, status, turn)

        return link

    async def context(self, tenant: Tenant, previous_response_id: str, get: GetRecords, *,
                      as_target: bool = True) -> list[bytes]:
        """The items of the chain ending at ``previous_response_id``, oldest
        first: each turn's input, then its output. ChainError when it cannot
        be expanded (the API's error, the ids named): as a request's target,
        a deleted or unknown response is not found; as the chain a living turn
        relies on (``as_target=False``), a deleted one still serves."""
        if as_target and await self.turn(tenant, previous_response_id, get, as_target=True) is None:
            raise not_found(previous_response_id)
        cached = self.contexts.hit((tenant.tag, previous_response_id))
        if cached is not None and cached[0] <= self.max_depth:
            keys = cached[1]
        else:
            turns = await walk(self._link(tenant, get), previous_response_id, self.max_depth)
            keys, spans = [], []
            for turn in turns:
                input_keys = (await self._input_keys(tenant, turn, get, previous_response_id))[0]
                keys += input_keys
                keys += turn.body.output
                spans.append((len(input_keys), len(turn.body.output)))
            items = await self._items(tenant, keys, get, previous_response_id)
            start = window_start(items, spans) or 0  # a compaction: never the history it replaced
            self.contexts.put((tenant.tag, previous_response_id), (len(turns), keys[start:]))
            return items[start:]
        return await self._items(tenant, keys, get, previous_response_id)

    async def output_items(self, tenant: Tenant, turn: Turn, get: GetRecords) -> list[bytes]:
        return await self._items(tenant, list(turn.body.output), get, turn.body.response_id)

    async def input_items(self, tenant: Tenant, turn: Turn, get: GetRecords) -> list[bytes]:
        """The input a turn's request carried, as the client sent it."""
        keys, _ = await self._input_keys(tenant, turn, get, turn.body.response_id)
        return await self._items(tenant, keys, get, turn.body.response_id)

    async def resolve_references(self, tenant: Tenant, items: list[bytes], get: GetRecords) -> list[bytes]:
        """``items`` with every ``item_reference`` to a recorded item replaced
        by that item; references the record does not know stay."""
        ids = {i: ref for i, raw in enumerate(items) if (ref := reference_id(raw)) is not None}
        if not ids:
            return items
        found = await self.referenced(tenant, list(ids.values()), get)
        return [found.get(ids[i], raw) if i in ids else raw for i, raw in enumerate(items)]

    async def referenced(self, tenant: Tenant, item_ids: Sequence[str], get: GetRecords) -> dict[str, bytes]:
        """The recorded items ``item_ids`` name (an ``item_reference``): outputs,
        and input items that carried an id (the one recorded last, when several
        did), by id; ids of no recorded item, or of a response since deleted,
        are left out."""
        keys = {key: item_id for item_id in dict.fromkeys(item_ids) for key in tenant.item_id_keys(item_id)}
        owners: dict[str, tuple[bytes, bytes]] = {}  # item id -> (its turn's key, its own key)
        for key, value in (await get(ITEM_IDS, list(keys))).items():
            if len(value) == 2 * KEY_SIZE:
                owners.setdefault(keys[key], (value[:KEY_SIZE], value[KEY_SIZE:]))
        living = {key for key, record in (await get(TURNS, [turn for turn, _ in owners.values()])).items()
                  if (header := header_of(record)) is not None and header.status == "completed"}
        found = {}
        for item_id, (turn_key, item_key) in owners.items():
            if turn_key in living:  # a deleted or expired response's items are not referenced again
                try:
                    found[item_id] = (await self._items(tenant, [item_key], get, item_id))[0]
                except ChainError:
                    continue
        return found

    async def _input_keys(self, tenant: Tenant, turn: Turn, get: GetRecords,
                          asked: str) -> tuple[list[bytes], list[bytes]]:
        """A turn's whole input (item keys), and the keys of the turns whose
        input it extends. That chain is the proxy's own way of storing a
        full-history conversation once (one link per turn): it is not the
        client's chain, so ``stateful_max_depth`` does not bound it; each turn
        extends one recorded before it, and a chain that comes back to a turn
        (a record not this proxy's) is unavailable."""
        keys, bases = list(turn.body.input), []
        base, seen = turn.body.input_base, {turn.body.response_id}
        while base is not None:
            based_on = await self.turn(tenant, base, get) if base not in seen else None
            seen.add(base)
            if based_on is None:
                raise ChainError("session_chain_unavailable",
                                 f"The input of a response in the chain ending at '{asked}' is no longer "
                                 f"available (it extends '{base}').", asked, base)
            keys = based_on.body.input + keys
            bases.append(based_on.key)
            base = based_on.body.input_base
        return keys, bases

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


class _Named(msgspec.Struct):
    id: Any = None
    type: Any = None
    role: Any = None


_NAMED = msgspec.json.Decoder(_Named)


def _item_id(raw: bytes) -> str | None:
    """The id an item carries (a client's own ``msg_…``, ``fco_…``, an output
    echoed back), never the id a reference names."""
    if b'"id"' not in raw:
        return None
    try:
        item = _NAMED.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not isinstance(item.id, str) or not item.id or item.type == "item_reference" \
            or (item.type is None and item.role is None):
        return None
    return item.id


def _rolling(digests: Sequence[bytes]) -> list[bytes]:
    hasher, out = blake3(), []
    for d in digests:
        hasher.update(d)
        out.append(hasher.digest(16))
    return out


def response_json(turn: Turn, output: Sequence[bytes]) -> bytes:
    """The stored response object, whole again (for GET /responses/{id}),
    naming the response it continued as the API does: the upstream answered
    an expanded request, so its own answer says null."""
    shell = turn.body.response
    items = b"[" + b",".join(output) + b"]"
    parent = json.dumps(turn.body.previous_response_id).encode()
    if shell == b"{}":
        return b'{"previous_response_id":' + parent + b',"output":' + items + b"}"
    fields = {k: v for k, v in msgspec.json.decode(shell, type=dict[str, msgspec.Raw]).items()
              if k != "previous_response_id"}
    return b"{" + b",".join(json.dumps(k).encode() + b":" + bytes(v) for k, v in fields.items()) + \
        b',"previous_response_id":' + parent + b',"output":' + items + b"}"


# How the API lists input items: typed, with an id (prefixed by kind), an easy
# message's text as one content part, and a status on the kinds that carry one.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "custom_tool_call": "ctc", "custom_tool_call_output": "ctco", "compaction": "cmp"}
_WITH_STATUS = frozenset({"message", "function_call", "function_call_output"})


def listed_items(raw_items: Sequence[bytes], response_id: str) -> list[dict]:
    """Input items as the API lists them (``GET /responses/{id}/input_items``);
    an item the client sent without an id gets a stable one."""
    listed = []
    for n, raw in enumerate(raw_items):
        item = json.loads(raw)
        if isinstance(item, dict):
            stable = blake3(canonical_json([response_id, n])).hexdigest(12)
            listed.append(listed_item(item, lambda prefix: f"{prefix}_{stable}"))
    return listed


def listed_item(item: dict, new_id: Callable[[str], str]) -> dict:
    """An item as the API stores and lists it: typed, with an id (``new_id``
    of its kind's prefix when it has none), an easy message's text as one
    content part, and a status on the kinds that carry one."""
    kind = item.get("type") or "message"
    entry = {"id": item.get("id") or new_id(_ID_PREFIX.get(kind, "item")), "type": kind,
             **{k: v for k, v in item.items() if k not in ("id", "type")}}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        entry["content"] = [{"type": part, "text": item["content"]}]
        if part == "output_text":
            entry["content"][0]["annotations"] = []
    if kind in _WITH_STATUS and entry.get("status") is None:
        entry["status"] = "completed"
    return entry


def reference_id(raw: bytes) -> str | None:
    """The id an ``item_reference`` item names (typed, or an id alone), else None."""
    if b'"id"' not in raw or (b"item_reference" not in raw and b'"type"' in raw) or b'"role"' in raw:
        return None
    try:
        item = normalize_item(strict_loads(raw))
    except (ValueError, RecursionError):
        return None
    if item.get("type") == "item_reference" and item.keys() == {"type", "id"} and isinstance(item["id"], str):
        return item["id"]
    return None


def without_unreadable_reasoning(items: list[bytes]) -> tuple[list[bytes], int]:
    """Items without the reasoning items an upstream that persists nothing
    cannot read: those named by id only (OpenAI answers 404 "Items are not
    persisted when `store` is set to false"). Reasoning carried with its
    ``encrypted_content`` travels; how many were dropped."""
    kept = [raw for raw in items
            if b'"reasoning"' not in raw or b'"encrypted_content"' in raw or not _is_reasoning_by_id(raw)]
    return kept, len(items) - len(kept)


def _is_reasoning_by_id(raw: bytes) -> bool:
    try:
        item = json.loads(raw)
    except ValueError:
        return False
    return isinstance(item, dict) and item.get("type") == "reasoning" and not item.get("encrypted_content")
