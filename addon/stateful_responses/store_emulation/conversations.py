"""OpenAI's Conversations API, kept by the proxy for upstreams that lack it:
conversations and their items in the state store, sealed per tenant like
recorded turns; the API's endpoints answered from them; a response made in a
conversation expanded into the conversation's items + its input, and its
input and output appended once it completes.

One append-only log per conversation (``state.storage``: the store numbers
each append inside the transaction that writes it): the first entry creates
the conversation (id, time, metadata, first items), each later one adds
items, removes one, or replaces the metadata. Nothing is rewritten in place,
so two responses that complete at once on one conversation, on one proxy or
on two, both append, in the order the store took them, and neither is lost.
A conversation is its log replayed; a log missing an entry (evicted by the
store's bounds, expired) is gone, never served with a hole. Deleting a
conversation drops its log whole.

Every entry is sealed (``turns.Tenant``) with the log's key bound in: an entry
copied into another conversation or tenant does not open. In clear: the log's
key (a keyed hash), its length, sizes and expiry times.

Each credential has a share of the store (``Conversations.admit``): so many
conversations, and a tenth of the records the store keeps of them, counted
from its ledger (one more log: the key of each conversation it made, sealed).
The store's bounds evict the records that expire soonest, whosever they are;
the share keeps any one credential from making them someone else's.

Pure: reads go through the ``get`` the glue passes in, writes leave through an
outbox, and every answer is a status and a JSON body.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import msgspec

from ..bounded import Bounded
from ..entropy import random_bytes
from ..items import Ambiguous, is_compaction_trigger, strict_loads
from ..settings import Config
from ..state.outbox import Outbox, Write
from ..state.storage import log_entry, log_length
from .history import RENEW_SLACK, GetRecords, listed_item
from .turns import Tenant

CONVERSATIONS = "conversations"  # conversation key -> its log (see state.storage)
MAX_ITEMS_PER_REQUEST = 20  # the API's limit on creating and on adding items
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64  # characters (the API reference's limits)
MAX_METADATA_VALUE = 512
MAX_ITEMS = 10_000  # items one conversation holds at most (the proxy's bound, not the API's)
MAX_ENTRIES = 20_000  # entries of one conversation's log at most: its appends, removals and metadata changes
PREFETCH = 32  # log entries asked for with the length, on the chance they are there (one round trip)
READ_AT_ONCE = 512  # log entries per read: each read of a long log stays within the store's read timeout
OPEN_AT_ONCE = 64  # log entries opened and replayed between two turns of the event loop (about 2 ms)
TOUCH_AT_ONCE = 1024  # records renewed between two turns of the event loop (about 2 ms)
CACHE_BYTES = 64 * 1024 * 1024  # conversations kept in memory, their items' bytes at most
TENANT_SHARE = 10  # one credential's conversations hold at most this fraction (1/N) of the records the store keeps
RECOUNT_AFTER = 60.0  # seconds a replica counts a credential's share on from its own writes before reading it again
RECOUNT_WHEN_FULL = 10.0  # and at a credential's limit (what another replica deleted frees its place)
ID_BYTES = 24  # random bytes in an id the proxy mints: as long as OpenAI's, and never the upstream's
ENCRYPTED_REASONING = "reasoning.encrypted_content"

# The API's paths under a base URL, and which endpoint a method on each is.
PATH = re.compile(r"^(?P<base>.*?)/conversations"
                  r"(?:/(?P<conversation>[^/]+)(?P<items>/items(?:/(?P<item>[^/]+))?)?)?/?$")
ENDPOINTS = {
    ("POST", "conversations"): "create", ("GET", "conversation"): "retrieve", ("POST", "conversation"): "update",
    ("DELETE", "conversation"): "delete", ("POST", "items"): "add_items", ("GET", "items"): "list_items",
    ("GET", "item"): "retrieve_item", ("DELETE", "item"): "delete_item",
}


class ApiError(Exception):
    """A refusal, as the API words it: its status and body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def echoed_conversations(answer: Mapping) -> list[object]:
    """What a response's answer names as its conversation, in each spelling an
    upstream uses: OpenAI's ``conversation`` (an object with an ``id``, or the
    id), agentic-api's ``conversation_id``. Empty when it has no such field;
    a field that is null names None."""
    names: list[object] = []
    for key in ("conversation", "conversation_id"):
        if key in answer:
            echoed = answer[key]
            names.append(echoed.get("id") if isinstance(echoed, dict) else echoed)
    return names


def not_found(conversation_id: object) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.")


def mutually_exclusive() -> ApiError:
    """``conversation`` with ``previous_response_id``, before any conversation
    is looked up, worded (the names cut short) as public captures of the live
    API record it: OpenAI's documentation and SDK give no wording."""
    return ApiError(400, "Mutually exclusive parameters: ''. Ensure you are only providing one of: 'pre..._id' or"
                         " 'conversation'.", code="mutually_exclusive_parameters")


def background_refused() -> ApiError:
    """A background response would complete where the proxy cannot see it:
    it could never join the conversation."""
    return ApiError(400, "Unsupported parameter: 'background' is not supported with a conversation this proxy "
                         "keeps for an upstream without the Conversations API.", param="background",
                    code="unsupported_parameter")


def duplicate_item(item_id: str) -> ApiError:
    """An input item whose id is already in the conversation, or twice in
    the input: the API's 400, worded as public captures of it record it."""
    return ApiError(400, f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try"
                         " again.", param="input")


def too_large(conversation_id: str, param: str) -> ApiError:
    return ApiError(400, f"Conversation '{conversation_id}' is full: this proxy keeps at most {MAX_ITEMS} items "
                         f"and {MAX_ENTRIES} changes per conversation. Start a new conversation.", param=param,
                    code="conversation_too_large")


def share_exhausted(conversations: int, records: int, param: str | None) -> ApiError:
    """The credential keeps as much as the proxy keeps for one: more would
    crowd out other credentials' conversations."""
    return ApiError(400, f"This credential's conversations are at this proxy's limit ({conversations} conversations, "
                         f"{records} records). Delete conversations you no longer need.", param,
                    "conversation_limit_exceeded")


def _unparsable() -> ApiError:
    return ApiError(400, "We could not parse the JSON body of your request. (HINT: This likely means you aren't using"
                         " your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was"
                         " not valid JSON.)")


def _missing(param: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def invalid_type(param: str, expected: str, value: object) -> ApiError:
    kind = "null" if value is None else "a boolean" if isinstance(value, bool) else \
        "an integer" if isinstance(value, int) else "a string" if isinstance(value, str) else \
        "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else "a decimal number"
    return ApiError(400, f"Invalid type for '{param}': expected {expected}, but got {kind} instead.", param,
                    "invalid_type")


def _no_item(item_id: object, param: str | None = None) -> ApiError:
    return ApiError(404, f"No item found with id '{item_id}'", param)


def _invalid_limit(text: str) -> ApiError:
    try:
        number = int(text)
    except ValueError:
        return ApiError(400, f"Invalid 'limit': expected an integer, but got '{text}' instead.", "limit",
                        "invalid_type")
    if number < 1:
        return ApiError(400, f"Invalid 'limit': integer below minimum value. Expected a value >= 1, but got {number}"
                             " instead.", "limit", "integer_below_min_value")
    return ApiError(400, f"Invalid 'limit': integer above maximum value. Expected a value <= 100, but got {number}"
                         " instead.", "limit", "integer_above_max_value")


# -- the log ----------------------------------------------------------------------------


class Created(msgspec.Struct, tag="created", array_like=True, frozen=True):
    conversation_id: str
    created_at: int
    metadata: bytes  # a JSON object
    items: list[bytes]  # each as the API lists it


class Added(msgspec.Struct, tag="added", array_like=True, frozen=True):
    items: list[bytes]


class Removed(msgspec.Struct, tag="removed", array_like=True, frozen=True):
    item_id: str


class Retagged(msgspec.Struct, tag="retagged", array_like=True, frozen=True):
    metadata: bytes


Event = Created | Added | Removed | Retagged
_EVENT = msgspec.msgpack.Decoder(Event)
_PACK = msgspec.msgpack.Encoder().encode
_JSON = msgspec.json.Encoder(decimal_format="number").encode


class _Shape(msgspec.Struct):
    id: Any = None
    type: Any = None


_SHAPE = msgspec.json.Decoder(_Shape)


class Item(NamedTuple):
    """One item of a conversation: its id and type, and its JSON as listed."""

    id: str
    type: str
    raw: bytes

    @classmethod
    def of(cls, raw: bytes) -> Item:
        shape = _SHAPE.decode(raw)
        return cls(shape.id if isinstance(shape.id, str) else "", shape.type if isinstance(shape.type, str) else "",
                   raw)

    def shown(self, include: frozenset[str]) -> bytes:
        """As the API shows it: a reasoning item's encrypted content only when asked for."""
        if self.type != "reasoning" or ENCRYPTED_REASONING in include or b'"encrypted_content"' not in self.raw:
            return self.raw
        return _JSON({k: v for k, v in strict_loads(self.raw).items() if k != "encrypted_content"})


@dataclass(frozen=True)
class Conversation:
    """A conversation as its log says, up to ``length`` entries."""

    id: str
    key: bytes  # where its log is
    created_at: int
    metadata: bytes
    items: tuple[Item, ...]
    length: int
    size: int  # its items' bytes

    def resource(self, metadata: bytes | None = None) -> bytes:
        return b'{"id":' + _JSON(self.id) + b',"object":"conversation","created_at":' + _JSON(self.created_at) + \
            b',"metadata":' + (metadata if metadata is not None else self.metadata) + b"}"

    @property
    def full(self) -> bool:
        return len(self.items) >= MAX_ITEMS or self.length >= MAX_ENTRIES

    @cached_property
    def repeated(self) -> frozenset[str]:
        """The ids it lists more than once (see ``page_bounds``): counted once
        per version read, not on every page a client asks for."""
        ids = [item.id for item in self.items]
        if len(set(ids)) == len(ids):
            return frozenset()
        return frozenset(item_id for item_id, count in Counter(ids).items() if count > 1)


class _Replay:
    """A conversation rebuilt from its log, event after event (those after
    ``known``, or all of them), so that a long log is replayed a part at a
    time; a removal costs the items it removes, not the whole list."""

    def __init__(self, known: Conversation | None, conversation_id: str, key: bytes) -> None:
        self.known = known
        self.conversation_id = conversation_id
        self.key = key
        self.created_at = known.created_at if known is not None else None
        self.metadata = known.metadata if known is not None else b""
        self.items: list[Item] = list(known.items) if known is not None else []
        self.removed: set[int] = set()  # places in ``items``
        self._places: dict[str, list[int]] | None = None  # item id -> its places, from the first removal on
        self.applied = False

    def apply(self, events: Iterable[Event]) -> bool:
        """False when the log is not a conversation's: it must open with its
        creation, of this very id, and never be created again."""
        for event in events:
            self.applied = True
            if self.created_at is None:
                if not isinstance(event, Created) or event.conversation_id != self.conversation_id:
                    return False
                self.created_at, self.metadata = event.created_at, event.metadata
                self._add(event.items)
            elif isinstance(event, Added):
                self._add(event.items)
            elif isinstance(event, Removed):
                if self._places is None:
                    self._places = {}
                    for place, item in enumerate(self.items):
                        if place not in self.removed:
                            self._places.setdefault(item.id, []).append(place)
                places = self._places.get(event.item_id)
                if places:  # one item, its id's last place: a log may list an id twice (written before renaming)
                    self.removed.add(places.pop())
            elif isinstance(event, Retagged):
                self.metadata = event.metadata
            else:
                return False  # created twice: not a log this proxy wrote
        return True

    def _add(self, raws: list[bytes]) -> None:
        start = len(self.items)
        self.items += [Item.of(raw) for raw in raws]
        if self._places is not None:
            for place in range(start, len(self.items)):
                self._places.setdefault(self.items[place].id, []).append(place)

    def conversation(self, length: int) -> Conversation | None:
        if self.known is not None and not self.applied:
            return self.known
        if self.created_at is None:
            return None
        items = tuple(item for place, item in enumerate(self.items) if place not in self.removed) \
            if self.removed else tuple(self.items)
        return Conversation(self.conversation_id, self.key, self.created_at, self.metadata, items, length,
                            sum(len(item.raw) for item in items))


class _Recent:
    """The conversations read lately, by log key, least recently used out
    first, within a byte budget."""

    def __init__(self, budget: int) -> None:
        self._by_key: OrderedDict[bytes, Conversation] = OrderedDict()
        self._bytes = 0
        self._budget = budget

    def get(self, key: bytes) -> Conversation | None:
        conversation = self._by_key.get(key)
        if conversation is not None:
            self._by_key.move_to_end(key)
        return conversation

    def put(self, conversation: Conversation) -> None:
        self.pop(conversation.key)
        self._by_key[conversation.key] = conversation
        self._bytes += conversation.size
        while self._bytes > self._budget and len(self._by_key) > 1:
            self._bytes -= self._by_key.popitem(last=False)[1].size

    def pop(self, key: bytes) -> None:
        gone = self._by_key.pop(key, None)
        if gone is not None:
            self._bytes -= gone.size

    def clear(self) -> None:
        self._by_key.clear()
        self._bytes = 0


# -- the store of conversations ------------------------------------------------------------

Resolve = Callable[[list[str]], Awaitable[Mapping[str, bytes]]]


@dataclass(frozen=True)
class Call:
    """One request to the Conversations API: its endpoint, the ids its path
    names, its body and its query (name, value) pairs."""

    endpoint: str
    conversation_id: str = ""
    item_id: str = ""
    body: bytes = b""
    query: tuple[tuple[str, str], ...] = ()


def route(method: str, path: str) -> tuple[str, Call] | None:
    """The base path and the call a request to one of the API's endpoints
    makes (its body and query still to fill in), or None."""
    match = PATH.match(path)
    if match is None:
        return None
    names = "item" if match["item"] else "items" if match["items"] else \
        "conversation" if match["conversation"] else "conversations"
    endpoint = ENDPOINTS.get((method.upper(), names))
    if endpoint is None:
        return None
    return match["base"], Call(endpoint, match["conversation"] or "", match["item"] or "")


def named(value: Any) -> str:
    """The id a response's ``conversation`` field names: the id, or ``{"id": …}``."""
    conversation_id = value.get("id") if isinstance(value, dict) else value
    if not isinstance(conversation_id, str):
        raise invalid_type("conversation", "one of a string or an object", value)
    return conversation_id


@dataclass
class _Tally:
    """One credential's share: its living conversations and their records
    (log entries and lengths, and its ledger's), as last counted from the
    store, with what this replica wrote since."""

    conversations: int
    records: int
    counted_at: float


@dataclass
class Conversations:
    """Every tenant's conversations: read fresh from the store whenever one is
    used (another replica may have appended to it, or deleted it), memory
    holding what was read so that only new entries are fetched."""

    config: Config = field(default_factory=Config)
    _recent: _Recent = field(default_factory=lambda: _Recent(CACHE_BYTES), repr=False)
    _renewed: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # log key -> kept until
    _tallies: Bounded = field(default_factory=lambda: Bounded(4096), repr=False)  # ledger key -> _Tally
    _outbox: Outbox = field(default_factory=Outbox, repr=False)

    tables = {CONVERSATIONS: 4_000_000}

    @property
    def keep(self) -> float:
        """How long what is written now is kept: the TTL and a slack, so that
        renewing a whole conversation is due once per slack, not on every use."""
        return self.config.ttl + min(RENEW_SLACK, self.config.ttl / 10)

    def take_writes(self) -> list[Write]:
        return self._outbox.take()

    def clear(self) -> None:
        self._recent.clear()
        self._renewed.clear()
        self._tallies.clear()
        self._outbox.clear()

    @property
    def conversations_per_tenant(self) -> int:
        return self.config.settings.conversations_per_credential

    @property
    def records_per_tenant(self) -> int:
        """A share of the records the store keeps of conversations, as the
        state store bounds its tables (``Settings.record_cap``)."""
        return self.config.settings.record_cap(self.tables[CONVERSATIONS]) // TENANT_SHARE

    # -- reading -----------------------------------------------------------------

    async def find(self, tenant: Tenant, conversation_id: str, get: GetRecords) -> Conversation | None:
        """The tenant's conversation as the store has it now, or None: unknown,
        deleted, another tenant's, or no longer whole. One round trip when
        memory holds what came before and a few entries were added since."""
        keys = tenant.conversation_keys(conversation_id)
        known = next((c for key in keys if (c := self._recent.get(key)) is not None), None)
        start = known.length if known is not None else 0
        ahead = [log_entry(known.key if known is not None else keys[0], n) for n in range(start, start + PREFETCH)]
        found = dict(await get(CONVERSATIONS, [*keys, *ahead]))
        key = next((key for key in keys if key in found), None)
        length = log_length(found.get(key)) if key is not None else 0
        if key is None or not 0 < length <= 2 * MAX_ENTRIES:
            return self._gone(keys)
        if known is None or known.key != key or length < known.length:
            known, start = None, 0
        replay = _Replay(known, conversation_id, key)
        for at in range(start, length, READ_AT_ONCE):
            part = [log_entry(key, n) for n in range(at, min(at + READ_AT_ONCE, length))]
            missing = [entry for entry in part if entry not in found]
            if missing:
                found.update(await get(CONVERSATIONS, missing))
            for first in range(0, len(part), OPEN_AT_ONCE):
                if length - start > OPEN_AT_ONCE:
                    await asyncio.sleep(0)  # a long log: other flows go on between its parts
                events: list[Event] = []
                for entry in part[first:first + OPEN_AT_ONCE]:
                    sealed = found.pop(entry, None)
                    plain = tenant.open(sealed, key) if sealed is not None else None
                    if plain is None:
                        return self._gone(keys)
                    try:
                        events.append(_EVENT.decode(plain))
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        return self._gone(keys)
                if not replay.apply(events):
                    return self._gone(keys)
        conversation = replay.conversation(length)
        if conversation is None:
            return self._gone(keys)
        self._recent.put(conversation)
        return conversation

    def _gone(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._recent.pop(key)
            self._renewed.pop(key, None)

    # -- writing -----------------------------------------------------------------

    def create(self, tenant: Tenant, items: list[bytes], metadata: bytes) -> Conversation:
        conversation_id = "conv_" + random_bytes(ID_BYTES).hex()
        key = tenant.conversation_key(conversation_id)
        now = self.config.clock()
        conversation = Conversation(conversation_id, key, int(now), metadata, tuple(Item.of(raw) for raw in items),
                                    1, sum(map(len, items)))
        self._write(tenant, key, Created(conversation_id, int(now), metadata, items), "start")
        ledger = tenant.ledger_key()
        self._outbox.append(Write(CONVERSATIONS, ledger, tenant.seal(key, ledger), self.keep, log="start"))
        self._recent.put(conversation)
        self._renewed.put(key, now + self.keep)
        return conversation

    def add(self, tenant: Tenant, conversation: Conversation, items: list[bytes]) -> None:
        """Append items; the store numbers them after whatever was appended meanwhile."""
        self._write(tenant, conversation.key, Added(items), "append")

    def remove(self, tenant: Tenant, conversation: Conversation, item_id: str) -> None:
        self._write(tenant, conversation.key, Removed(item_id), "append")

    def retag(self, tenant: Tenant, conversation: Conversation, metadata: bytes) -> None:
        self._write(tenant, conversation.key, Retagged(metadata), "append")

    def delete(self, tenant: Tenant, conversation: Conversation) -> None:
        """Its log goes whole; its ledger entry stays until the ledger is next rewritten."""
        self._outbox.append(Write(CONVERSATIONS, conversation.key, None, log="drop"))
        self._gone([conversation.key])
        tally = self._tallies.get(tenant.ledger_key())
        if tally is not None:
            tally.conversations -= 1
            tally.records -= conversation.length + 1

    def _write(self, tenant: Tenant, key: bytes, event: Event, log: str) -> None:
        self._outbox.append(Write(CONVERSATIONS, key, tenant.seal(_PACK(event), key), self.keep, log=log))  # type: ignore[arg-type]

    async def renew(self, conversation: Conversation) -> None:
        """Every use keeps the conversation at least the TTL from now: its
        whole log is touched once per slack."""
        now = self.config.clock()
        if self._renewed.get(conversation.key, 0.0) >= now + self.config.ttl:
            return
        self._renewed.put(conversation.key, now + self.keep)
        await self._touch(conversation.key, conversation.length)

    async def _touch(self, log: bytes, length: int) -> None:
        """Keep the log's length record and its first ``length`` entries
        ``keep`` from now, queued a part at a time, other flows going on
        between the parts."""
        keep = self.keep
        self._outbox.append(Write(CONVERSATIONS, log, None, keep, touch=True))
        for at in range(0, length, TOUCH_AT_ONCE):
            if at:
                await asyncio.sleep(0)
            for n in range(at, min(at + TOUCH_AT_ONCE, length)):
                self._outbox.append(Write(CONVERSATIONS, log_entry(log, n), None, keep, touch=True))

    # -- each credential's share -------------------------------------------------------------

    async def admit(self, tenant: Tenant, get: GetRecords, *, conversations: int = 0, records: int = 1,
                    param: str | None = None) -> None:
        """Refuse (``ApiError``) what would take the credential past its share
        of the store, so that no credential, whatever it sends, crowds out
        another's conversations (the store's bounds evict the records that
        expire soonest, whosever they are). The count is the store's, taken
        again once a minute, with this replica's writes since: replicas
        writing for one credential at once may each let that much past it."""
        ledger = tenant.ledger_key()
        now = self.config.clock()
        tally = self._tallies.hit(ledger)
        if tally is None or now - tally.counted_at >= RECOUNT_AFTER or (
                self._over(tally, conversations, records) and now - tally.counted_at >= RECOUNT_WHEN_FULL):
            tally = await self._count(tenant, ledger, get)
            self._tallies.put(ledger, tally)
        if self._over(tally, conversations, records):
            raise share_exhausted(self.conversations_per_tenant, self.records_per_tenant, param)
        tally.conversations += conversations
        tally.records += records

    def _over(self, tally: _Tally, conversations: int, records: int) -> bool:
        return (conversations > 0 and tally.conversations + conversations > self.conversations_per_tenant) or \
            tally.records + records > self.records_per_tenant

    async def _count(self, tenant: Tenant, ledger: bytes, get: GetRecords) -> _Tally:
        """The credential's share from its ledger (one entry per conversation
        it made: the key of its log) and the lengths of those logs that are
        still there. A ledger mostly of conversations gone is rewritten with
        the living ones; a lost ledger entry leaves its conversation uncounted."""
        found = dict(await get(CONVERSATIONS, [ledger, *(log_entry(ledger, n) for n in range(PREFETCH))]))
        # Read whole, however long conversations made and deleted by the thousand
        # left it (each entry counts in the share until a rewrite, which bounds
        # it): an entry not read would be dropped by the rewrite, uncounted.
        length = log_length(found.get(ledger))
        entries = [log_entry(ledger, n) for n in range(length)]
        missing = [entry for entry in entries if entry not in found]
        for at in range(0, len(missing), READ_AT_ONCE):
            found.update(await get(CONVERSATIONS, missing[at:at + READ_AT_ONCE]))
        made: dict[bytes, None] = {}
        for at in range(0, length, OPEN_AT_ONCE):
            if length > OPEN_AT_ONCE:
                await asyncio.sleep(0)  # a long ledger: other flows go on between its parts
            for entry in entries[at:at + OPEN_AT_ONCE]:
                sealed = found.get(entry)
                key = tenant.open(sealed, ledger) if sealed is not None else None
                if key is not None:
                    made[key] = None
        keys, lengths = list(made), {}
        for at in range(0, len(keys), READ_AT_ONCE):
            lengths.update(await get(CONVERSATIONS, keys[at:at + READ_AT_ONCE]))
        living = [key for key in keys if key in lengths]
        now = self.config.clock()
        if length - len(living) > max(len(living), PREFETCH):
            self._outbox.append(Write(CONVERSATIONS, ledger, None, log="drop"))
            for key in living:
                self._outbox.append(Write(CONVERSATIONS, ledger, tenant.seal(key, ledger), self.keep, log="start"))
            self._renewed.put(ledger, now + self.keep)
            length = len(living)
        elif self._renewed.get(ledger, 0.0) < now + self.config.ttl:
            self._renewed.put(ledger, now + self.keep)
            await self._touch(ledger, length)
        records = sum(log_length(lengths[key]) + 1 for key in living) + length + 1
        return _Tally(len(living), records, now)

    # -- the API's endpoints ---------------------------------------------------------------

    async def answer(self, tenant: Tenant, call: Call, conversation: Conversation | None, resolve: Resolve,
                     get: GetRecords) -> tuple[int, bytes]:
        """The API's answer to ``call``, on ``conversation`` (None only for
        ``create``), as a status and a JSON body; changes go to the outbox
        (``get`` reads the credential's share)."""
        try:
            if call.endpoint == "create":
                body = _object(call.body)
                metadata = _metadata(body.get("metadata"))
                items = await _new_items(body.get("items"), (), resolve)
                await self.admit(tenant, get, conversations=1, records=3)  # its log's length, first entry, ledger's
                return 200, self.create(tenant, items, metadata).resource()
            if conversation is None:
                raise not_found(call.conversation_id)
            if call.endpoint != "delete":
                await self.renew(conversation)
            return 200, await getattr(self, "_" + call.endpoint)(tenant, call, conversation, resolve, get)
        except ApiError as e:
            return e.status, json.dumps(e.body).encode()

    async def _retrieve(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                        get: GetRecords) -> bytes:
        return conversation.resource()

    async def _update(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                      get: GetRecords) -> bytes:
        body = _object(call.body)
        if "metadata" not in body:
            raise _missing("metadata")
        metadata = _metadata(body["metadata"])
        if conversation.length >= MAX_ENTRIES:
            raise too_large(conversation.id, "metadata")
        await self.admit(tenant, get, param="metadata")
        self.retag(tenant, conversation, metadata)
        return conversation.resource(metadata)

    async def _delete(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                      get: GetRecords) -> bytes:
        self.delete(tenant, conversation)
        return _JSON({"id": conversation.id, "object": "conversation.deleted", "deleted": True})

    async def _add_items(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                         get: GetRecords) -> bytes:
        body = _object(call.body)
        if "items" not in body:
            raise _missing("items")
        items = await _new_items(body["items"], conversation.items, resolve)
        if conversation.full or len(conversation.items) + len(items) > MAX_ITEMS:
            raise too_large(conversation.id, "items")
        await self.admit(tenant, get, param="items")
        self.add(tenant, conversation, items)
        include = _include(call.query)
        return _listed([Item.of(raw).shown(include) for raw in items], [Item.of(raw).id for raw in items], False)

    async def _list_items(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                          get: GetRecords) -> bytes:
        query = dict(call.query)
        limit_text, order = query.get("limit", "20"), query.get("order", "desc")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise _invalid_limit(limit_text)
        if order not in ("asc", "desc"):
            raise ApiError(400, f"Invalid value: '{order}'. Supported values are: 'asc' and 'desc'.", "order",
                           "invalid_value")
        items = conversation.items if order == "asc" else conversation.items[::-1]
        start, end = page_bounds(items, query.get("after"), int(limit_text), conversation.repeated)
        page = items[start:end]
        include = _include(call.query)
        return _listed([item.shown(include) for item in page], [item.id for item in page], len(items) > end)

    async def _retrieve_item(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                             get: GetRecords) -> bytes:
        for item in conversation.items:
            if item.id == call.item_id:
                return item.shown(_include(call.query))
        raise _no_item(call.item_id)

    async def _delete_item(self, tenant: Tenant, call: Call, conversation: Conversation, resolve: Resolve,
                           get: GetRecords) -> bytes:
        """The item leaves the conversation; the API answers with the conversation."""
        if not any(item.id == call.item_id for item in conversation.items):
            raise _no_item(call.item_id)
        if conversation.length >= MAX_ENTRIES:
            raise too_large(conversation.id, "item_id")
        await self.admit(tenant, get, param="item_id")
        self.remove(tenant, conversation, call.item_id)
        return conversation.resource()

    # -- responses in a conversation ---------------------------------------------------------

    def join(self, tenant: Tenant, conversation: Conversation, listed_input: Sequence[bytes],
             output: Sequence[Any]) -> None:
        """A completed response joins its conversation: its input items (as
        ``listed``), then its output items."""
        items = list(listed_input)
        taken = {item.id for item in conversation.items} | {Item.of(raw).id for raw in items}
        for item in output:
            if not isinstance(item, dict):
                continue
            if not item.get("id") or item["id"] in taken:
                # An upstream that repeats an id (its numbering restarted) gets one of the proxy's: the API never
                # lists one id twice, and a client deleting an item by id deletes the one it means.
                item = listed_item({**item, "id": None}, new_id)
            taken.add(item["id"])
            items.append(_JSON(item))
        self.add(tenant, conversation, items)


def refuse_duplicates(conversation: Conversation, listed_input: Sequence[bytes]) -> None:
    """The API's 400 (``duplicate_item``) for an input item (as ``listed``)
    whose id is already in the conversation or earlier in the input: such
    an item would be in the conversation twice."""
    seen = {item.id for item in conversation.items}
    for raw in listed_input:
        item_id = Item.of(raw).id
        if item_id in seen:
            raise duplicate_item(item_id)
        seen.add(item_id)


def page_bounds(items: Sequence[Item], after: str | None, limit: int, repeated: frozenset[str]) -> tuple[int, int]:
    """Where a page of ``items`` starts and ends, so that paging by ``after``
    always advances and ends, even over an id listed twice (``repeated``: an
    item added twice by one request, as the API takes it): ``after`` names
    the id's last place, and a page ends only on an id's last place. It
    stops short of an earlier copy, or, when only earlier copies fit,
    starts past them (each is listed again further on). An ``after`` not
    listed is the API's 404."""
    ids = [item.id for item in items] if after is not None or repeated else []
    if after is not None and after not in ids:
        raise _no_item(after, "after")
    if not repeated:
        start = ids.index(after) + 1 if after is not None else 0
        return start, min(start + limit, len(items))
    last = dict(zip(ids, range(len(ids)), strict=True))  # an id's last place: later places overwrite earlier

    def end_from(start: int) -> int:
        end = min(start + limit, len(ids))
        while end > start and last[ids[end - 1]] != end - 1:
            end -= 1
        return end

    start = last[after] + 1 if after is not None else 0
    end = end_from(start)
    if end == start < len(ids):
        while last[ids[start]] != start:
            start += 1
        end = end_from(start)
    return start, end


def listed(raw_input: Sequence[bytes]) -> list[bytes]:
    """A response's input items as its conversation will list them, each
    with an id of its own: what the upstream is sent too, so that the next
    turn's history starts with this turn's very bytes (a full-history turn
    recorded after it then shares them, see ``History.record``). A compaction
    trigger gets no id (the API refuses one) and is never listed (``join``)."""
    return [raw if is_compaction_trigger(raw) else _JSON(listed_item(strict_loads(raw), new_id)) for raw in raw_input]


# -- the answer names its conversation -------------------------------------------------------

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def named_in(response: bytes, conversation_id: str) -> bytes | None:
    """A response object (JSON) naming its conversation as the API's do,
    every other field's bytes its own; None when it is not a JSON object."""
    try:
        fields = _FIELDS.decode(response)
    except (msgspec.DecodeError, RecursionError):
        return None
    fields["conversation"] = msgspec.Raw(b'{"id":' + _JSON(conversation_id) + b"}")
    return b"{" + b",".join(_JSON(key) + b":" + bytes(value) for key, value in fields.items()) + b"}"


class Echo:
    """An SSE answer passed on with every ``response`` object its events
    carry naming the conversation (``named_in``); each event goes on once it
    is whole, every other byte as it came."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        """What goes on to the client now; ``b""`` is the end: the rest."""
        if not data:
            rest, self._pending = self._pending, b""
            return [rest] if rest else []
        buffer = self._pending + data
        ends = [match.end() for match in _EVENT_END.finditer(buffer)]
        if not ends:
            self._pending = buffer
            return []
        self._pending = buffer[ends[-1]:]
        starts = [0, *ends[:-1]]
        return [self._event(buffer[start:end]) for start, end in zip(starts, ends, strict=True)]

    def _event(self, block: bytes) -> bytes:
        if b'"response"' not in block:
            return block
        lines = block.split(b"\n")
        data = [n for n, line in enumerate(lines) if line.startswith(b"data:")]
        if len(data) != 1:
            return block  # one JSON document per event is what servers send; anything else passes as it is
        line = lines[data[0]]
        body_start = 6 if line.startswith(b"data: ") else 5
        payload, ending = (line[body_start:-1], b"\r") if line.endswith(b"\r") else (line[body_start:], b"")
        try:
            fields = _FIELDS.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return block
        response = fields.get("response")
        named = named_in(bytes(response), self.conversation_id) if response is not None else None
        if named is None:
            return block
        fields["response"] = msgspec.Raw(named)
        lines[data[0]] = line[:body_start] + b"{" + b",".join(
            _JSON(key) + b":" + bytes(value) for key, value in fields.items()) + b"}" + ending
        return b"\n".join(lines)


def new_id(prefix: str) -> str:
    """An id the proxy mints: random, as long as OpenAI's (which no upstream repeats)."""
    return f"{prefix}_{random_bytes(ID_BYTES).hex()}"


def _object(body: bytes) -> dict:
    """A request body as the API takes it: a JSON object (nothing is none)."""
    if not body.strip():
        return {}
    try:
        parsed = strict_loads(body)
    except (ValueError, Ambiguous, RecursionError):
        raise _unparsable() from None
    if not isinstance(parsed, dict):
        raise _unparsable()
    return parsed


def _metadata(value: Any) -> bytes:
    """Metadata as the API takes it: an object of at most 16 pairs, keys of
    at most 64 characters, values strings of at most 512; null is none."""
    if value is None:
        return b"{}"
    if not isinstance(value, dict):
        raise invalid_type("metadata", "a metadata object", value)
    if len(value) > MAX_METADATA_PAIRS:
        raise ApiError(400, f"Invalid 'metadata': too many properties. Expected an object with at most "
                            f"{MAX_METADATA_PAIRS} properties, but got an object with {len(value)} properties "
                            "instead.", "metadata", "object_above_max_properties")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise ApiError(400, f"Invalid 'metadata': key too long. Expected a key with maximum length "
                                f"{MAX_METADATA_KEY}, but got a key with length {len(key)} instead.", "metadata",
                           "key_above_max_length")
        if not isinstance(text, str):
            raise invalid_type(f"metadata.{key}", "a string", text)
        if len(text) > MAX_METADATA_VALUE:
            raise ApiError(400, f"Invalid 'metadata.{key}': string too long. Expected a string with maximum length "
                                f"{MAX_METADATA_VALUE}, but got a string with length {len(text)} instead.",
                           f"metadata.{key}", "string_above_max_length")
    return _JSON(value)


def _is_reference(item: dict) -> bool:
    """``{"type": "item_reference", "id": …}``, or an id alone (no type, no role)."""
    return item.get("type") == "item_reference" or (item.get("type") is None and "id" in item and "role" not in item)


async def _new_items(raw: Any, present: Sequence[Item], resolve: Resolve) -> list[bytes]:
    """The items a request adds, as the conversation keeps them: each typed,
    with an id; a reference is the item it names (``resolve``). An item
    already in the conversation refuses the request."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_type("items", "an array of input items", raw)
    if len(raw) > MAX_ITEMS_PER_REQUEST:
        raise ApiError(400, f"Invalid 'items': array too long. Expected an array with maximum length "
                            f"{MAX_ITEMS_PER_REQUEST}, but got an array with length {len(raw)} instead.", "items",
                       "array_above_max_length")
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise invalid_type(f"items[{index}]", "an input item", item)
    present_ids = {item.id for item in present}
    references = [item["id"] for item in raw if _is_reference(item) and isinstance(item.get("id"), str)]
    found = await resolve(references) if references else {}
    kept = []
    for item in raw:
        if _is_reference(item):
            if item.get("id") in present_ids:
                raise ApiError(400, "Item already in conversation", "items", "item_already_in_conversation")
            stored = found.get(item.get("id"))  # type: ignore[arg-type]
            if stored is None:
                raise ApiError(404, f"Item with id '{item.get('id')}' not found.", "items")
            kept.append(_JSON(listed_item(strict_loads(stored), new_id)))
        elif item.get("type") == "reasoning" and not item.get("id") and not item.get("encrypted_content"):
            raise ApiError(400, "Invalid item", "item", "invalid_item")
        else:
            kept.append(_JSON(listed_item(item, new_id)))
    if any(Item.of(raw).id in present_ids for raw in kept):
        raise ApiError(400, "Item already in conversation", "items", "item_already_in_conversation")
    return kept


def _include(query: Iterable[tuple[str, str]]) -> frozenset[str]:
    """``include`` as the openai SDK sends it (``include[]=…``, repeated), or plain."""
    return frozenset(value for name, value in query if name in ("include", "include[]"))


def _listed(shown: list[bytes], ids: list[str], has_more: bool) -> bytes:
    """The API's list envelope; an empty page has null ids."""
    return b'{"object":"list","data":[' + b",".join(shown) + b'],"first_id":' + \
        _JSON(ids[0] if ids else None) + b',"last_id":' + _JSON(ids[-1] if ids else None) + \
        b',"has_more":' + _JSON(has_more) + b"}"
