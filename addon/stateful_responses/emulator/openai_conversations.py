"""OpenAI's Conversations API: a conversation is a list of items that belongs
to the credential that created it. ``POST /responses`` with ``conversation``
starts its context with those items and appends the response's input and output
items when it completes (model.py does that part, under its lock).

Shapes and refusals are OpenAI's as captured from the live API (docs/emulator.md
names the sources and the guesses). Nothing here knows HTTP or takes a lock: the
model calls in under its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import errors
from .shapes import is_item_reference, item_list, listed_item, new_id, page_parameters, reads_stored_reasoning

MAX_ITEMS_PER_REQUEST = 20  # on create and on adding items
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64  # characters (the API reference's limits)
MAX_METADATA_VALUE = 512
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"


@dataclass
class StoredConversation:
    id: str
    created_at: int
    metadata: dict
    items: list[dict] = field(default_factory=list)  # as the API lists them: typed, with ids, oldest first
    deleted: bool = False  # a deleted conversation is gone; its items stay stored

    def resource(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationsCall(NamedTuple):
    """One request to the Conversations API: the ids in its path, its JSON body
    (``{}`` when empty, None when not JSON) and its query as (name, value) pairs."""

    conversation_id: str = ""
    item_id: str = ""
    body: Any = None
    query: tuple[tuple[str, str], ...] = ()


class OpenAIConversations:
    """The endpoints, over each credential's conversations. ``find_stored_item``
    finds any item the credential's storage holds (a stored response's, or a
    conversation's): an item added by id is that stored item, as the API adds it."""

    def __init__(self, find_stored_item: Callable[[str, str], dict | None]) -> None:
        self._by_credential: dict[str, dict[str, StoredConversation]] = {}
        self._find_stored_item = find_stored_item

    def clear(self) -> None:
        self._by_credential.clear()

    # -- what POST /responses uses ---------------------------------------------

    def find(self, credential: str, conversation_id: Any) -> StoredConversation | None:
        """The credential's conversation with this id, unless deleted."""
        conversation = self._by_credential.get(credential, {}).get(conversation_id) \
            if isinstance(conversation_id, str) else None
        return None if conversation is None or conversation.deleted else conversation

    def get(self, credential: str, conversation_id: Any) -> StoredConversation:
        conversation = self.find(credential, conversation_id)
        if conversation is None:
            raise errors.conversation_not_found(conversation_id)
        return conversation

    def find_item(self, credential: str, item_id: str) -> dict | None:
        """An item of one of the credential's conversations, deleted ones too
        (deleting a conversation does not delete its items)."""
        for conversation in self._by_credential.get(credential, {}).values():
            for item in conversation.items:
                if item["id"] == item_id:
                    return item
        return None

    # -- the endpoints ------------------------------------------------------------

    def create(self, credential: str, call: ConversationsCall) -> dict:
        """``POST /conversations``: up to 20 initial items, up to 16 metadata pairs."""
        body = _object_body(call.body)
        metadata = _metadata(body.get("metadata"))
        items = self._new_items(credential, body.get("items"), present=[])
        conversation = StoredConversation(new_id("conv"), int(time.time()), metadata, items)
        self._by_credential.setdefault(credential, {})[conversation.id] = conversation
        return conversation.resource()

    def retrieve(self, credential: str, call: ConversationsCall) -> dict:
        return self.get(credential, call.conversation_id).resource()

    def update(self, credential: str, call: ConversationsCall) -> dict:
        """``POST /conversations/{id}``: its metadata replaced (``metadata`` is required; null clears it)."""
        conversation = self.get(credential, call.conversation_id)
        body = _object_body(call.body)
        if "metadata" not in body:
            raise errors.missing_parameter("metadata")
        conversation.metadata = _metadata(body["metadata"])
        return conversation.resource()

    def delete(self, credential: str, call: ConversationsCall) -> dict:
        conversation = self.get(credential, call.conversation_id)
        conversation.deleted = True
        return {"id": conversation.id, "object": "conversation.deleted", "deleted": True}

    def add_items(self, credential: str, call: ConversationsCall) -> dict:
        """``POST /conversations/{id}/items``: up to 20 items, answered as a list of the added items."""
        conversation = self.get(credential, call.conversation_id)
        body = _object_body(call.body)
        if "items" not in body:
            raise errors.missing_parameter("items")
        items = self._new_items(credential, body["items"], present=conversation.items)
        conversation.items.extend(items)
        include = _include(call.query)
        return item_list([_shown(item, include) for item in items], has_more=False)

    def list_items(self, credential: str, call: ConversationsCall) -> dict:
        """``GET /conversations/{id}/items``: ``limit``, ``order`` (default
        ``desc``, newest first), ``after`` (an item id) and ``include``."""
        conversation = self.get(credential, call.conversation_id)
        query = dict(call.query)
        limit, order = page_parameters(query)
        items = conversation.items if order == "asc" else conversation.items[::-1]
        ids = [item["id"] for item in items]
        if "after" in query and query["after"] not in ids:
            raise errors.no_item_found(query["after"], param="after")
        start, end = page_bounds(ids, query.get("after"), limit)
        include = _include(call.query)
        page = [_shown(item, include) for item in items[start:end]]
        return item_list(page, has_more=len(items) > end)

    def retrieve_item(self, credential: str, call: ConversationsCall) -> dict:
        conversation = self.get(credential, call.conversation_id)
        for item in conversation.items:
            if item["id"] == call.item_id:
                return _shown(item, _include(call.query))
        raise errors.no_item_found(call.item_id)

    def delete_item(self, credential: str, call: ConversationsCall) -> dict:
        """The item leaves the conversation; the API answers with the conversation."""
        conversation = self.get(credential, call.conversation_id)
        kept = [item for item in conversation.items if item["id"] != call.item_id]
        if len(kept) == len(conversation.items):
            raise errors.no_item_found(call.item_id)
        conversation.items = kept
        return conversation.resource()

    # -- items as a conversation keeps them -------------------------------------

    def _new_items(self, credential: str, raw: Any, present: list[dict]) -> list[dict]:
        """The items a request adds, as the conversation keeps them. One that
        is already in the conversation refuses the request."""
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise errors.invalid_type("items", "an array of input items", raw)
        if len(raw) > MAX_ITEMS_PER_REQUEST:
            raise errors.array_too_long("items", MAX_ITEMS_PER_REQUEST, len(raw))
        items = []
        for index, item in enumerate(raw):
            if not isinstance(item, dict):
                raise errors.invalid_type(f"items[{index}]", "an input item", item)
            items.append(self._kept(credential, item))
        present_ids = {item["id"] for item in present}
        if any(item["id"] in present_ids for item in items):
            raise errors.item_already_in_conversation()
        return items

    def _kept(self, credential: str, item: dict) -> dict:
        """An item given by id (a reference, or any item whose id the storage
        holds) is the stored item, whatever else was sent, as the API answers;
        a reasoning item with neither id nor encrypted content is refused; any
        other item is listed with an id of its own."""
        item_id = item.get("id")
        if isinstance(item_id, str) and item_id:
            stored = self._find_stored_item(credential, item_id)
            if stored is not None:
                return dict(stored)
            if is_item_reference(item) or reads_stored_reasoning(item):
                raise errors.item_not_found(item_id, param="items")
        elif item.get("type") == "reasoning" and not item.get("encrypted_content"):
            raise errors.invalid_item()
        return listed_item(item)


def page_bounds(ids: list[str], after: str | None, limit: int) -> tuple[int, int]:
    """Where a page of the listed ``ids`` starts and ends, so that paging by
    ``after`` always advances and ends, even over an id listed twice (an
    item added twice by one request): ``after`` names the id's last place,
    and a page ends only on an id's last place. It stops short of an
    earlier copy, or, when only earlier copies fit, starts past them (each
    is listed again further on)."""
    last = {item_id: place for place, item_id in enumerate(ids)}

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


def _object_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise errors.unparsable_json()
    return body


def _metadata(value: Any) -> dict:
    """Metadata as the API takes it: an object of at most 16 pairs, keys of
    at most 64 characters, values strings of at most 512; null is none."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.invalid_type("metadata", "a metadata object", value)
    if len(value) > MAX_METADATA_PAIRS:
        raise errors.too_many_properties("metadata", MAX_METADATA_PAIRS, len(value))
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise errors.key_too_long("metadata", MAX_METADATA_KEY, len(key))
        if not isinstance(text, str):
            raise errors.invalid_type(f"metadata.{key}", "a string", text)
        if len(text) > MAX_METADATA_VALUE:
            raise errors.string_too_long(f"metadata.{key}", MAX_METADATA_VALUE, len(text))
    return dict(value)


def _include(query: tuple[tuple[str, str], ...]) -> set[str]:
    """``include`` as the openai SDK sends it (``include[]=…``, repeated), or plain."""
    return {value for name, value in query if name in ("include", "include[]")}


def _shown(item: dict, include: set[str]) -> dict:
    """A stored item as listed: a reasoning item's encrypted content only when asked for."""
    if item.get("type") == "reasoning" and "encrypted_content" in item and INCLUDE_ENCRYPTED_REASONING not in include:
        return {key: value for key, value in item.items() if key != "encrypted_content"}
    return item
