"""Recorded turns for store emulation, sealed per tenant.

A turn is one completed response: its id, the id it continued, the request's
input items exactly as the client sent them, the output items as the upstream
returned them, and the response object. Items are stored once per tenant,
content-addressed, so a full-history client's conversation costs its distinct
items, not turns x history; a full-history turn names the earlier turn whose
input its own input extends (``input_base``) and adds only the rest.

Everything that is content is sealed with ChaCha20-Poly1305 under a
key derived from the request's credential material and the store's secret; the
key is never stored, so a copied store (file, dump, backup) reveals nothing
without the tenant's credential. The record's key is bound into the
associated data: a sealed record copied under another key, or opened with
another credential, fails to open and reads as "not found". In clear stay only
what bounds and conflicts need: status, time, size, a keyed fingerprint.

Every key of a tenant starts with its shard tag (``state.storage.shard_tag``)
in place of its digest's first bytes: on a Redis Cluster a tenant's turns,
items, item ids, marks and conversations are in one slot, so that a turn and
everything it names are written in one script and never seen apart; other
tenants land elsewhere. Keys made before tags (the whole digest) are still
read, after the tagged ones: a store written by an earlier version keeps
every id it handed out.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ..entropy import random_bytes
from ..state.storage import SHARD_TAG_SIZE, shard_tag

if TYPE_CHECKING:
    from ..tenancy import Tenancy

TURNS = "turns"  # turn key -> TurnHeader (body sealed)
ITEMS = "items"  # item key -> sealed item JSON
DEPENDENTS = "dependents"  # turn key -> nothing: some other turn continues or extends it
ITEM_IDS = "item-ids"  # item id key -> the key of the turn whose output holds it + the item's key
DELETIONS = "deletions"  # deletion key -> nothing: a client deleted that response through the proxy lately

KEY_SIZE = 16
ANCESTORS = 32
_NONCE = 12
_SEAL_CONTEXT = "stateful-responses 2026-11 recorded turn seal"


class TurnBody(msgspec.Struct, array_like=True, frozen=True):
    response_id: str
    previous_response_id: str | None
    input_base: str | None  # the response whose input this turn's input extends
    input: list[bytes]  # item keys after the base's input
    output: list[bytes]  # item keys
    response: bytes  # the response object without its output, as JSON


class TurnHeader(msgspec.Struct, array_like=True, frozen=True):
    # "completed"; "conflict": an id seen with two contents, never expanded;
    # "deleted": a client deleted it, its content stays only for the turns that rely on it
    status: str
    created: float
    size: int  # bytes this turn added to the store (items included)
    fingerprint: bytes  # keyed digest of the body: the same id recorded again with other content shows
    stored_upstream: bool  # the upstream's answer proved it stored this response itself
    sealed: bytes
    # Keys of the turns above it in its chain, nearest first (at most
    # ANCESTORS): a cold walk fetches them in one round trip, not one each.
    ancestors: list[bytes] = []


_BODY = msgspec.msgpack.Decoder(TurnBody)
_HEADER = msgspec.msgpack.Decoder(TurnHeader)
_ENCODE = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True)
class Tenant:
    """One credential's view of the record: its key namespace and its seal.
    Built from the credential material on every request; nothing of it is
    stored. Records are written under the store's current secret; ``older``
    are the same credential under secrets the store used before (a store that
    lost its secret and got another), which stay readable."""

    tag: bytes  # names the tenant inside keys (a keyed hash of the credential)
    _secret: bytes
    _aead: ChaCha20Poly1305
    older: tuple[Tenant, ...] = ()
    shard: bytes = b""  # leads each of its keys: the shard tag of ``tag``

    @classmethod
    def under(cls, tenancy: Tenancy, credential: bytes) -> Tenant:
        """``credential``'s tenant under the secrets and the seal key ``tenancy`` holds now."""
        return cls.of(tenancy.secret, credential, seal_key=tenancy.seal_key, older_secrets=tenancy.older_secrets)

    @classmethod
    def of(cls, secret: bytes, credential: bytes, *, seal_key: bytes = b"",
           older_secrets: tuple[bytes, ...] = ()) -> Tenant:
        """``seal_key``: a key that does not live in the store, mixed into
        every seal key, so that a copy of the store alone opens nothing, even
        for tenants without a credential."""
        return _tenant(secret, credential, seal_key, older_secrets)

    def _key(self, kind: bytes, name: bytes) -> bytes:
        """The untagged key: what versions before tags wrote."""
        return blake3(self.tag + kind + b"\x00" + name, key=self._secret).digest(KEY_SIZE)

    def _own_keys(self, kind: bytes, name: str) -> tuple[bytes, bytes]:
        """Under this tenant's secret: the key, and the untagged one."""
        untagged = self._key(kind, name.encode("utf-8", "surrogatepass"))
        return self.shard + untagged[SHARD_TAG_SIZE:], untagged

    def _keys(self, kind: bytes, name: str) -> list[bytes]:
        """Where a record may be: tagged under the current secret and the
        older ones, then untagged under each."""
        own = [t._own_keys(kind, name) for t in (self, *self.older)]
        return [tagged for tagged, _ in own] + [untagged for _, untagged in own]

    def record_keys(self, kind: bytes, name: str) -> list[bytes]:
        """Where a record of another capability's ``kind`` (a background job's, say) may be:
        its key under the current secret first, then the older ones."""
        return self._keys(kind, name)

    def turn_key(self, response_id: str) -> bytes:
        return self._own_keys(b"turn", response_id)[0]

    def turn_keys(self, response_id: str) -> list[bytes]:
        """Where a turn may be recorded: under the current secret, then the older ones."""
        return self._keys(b"turn", response_id)

    def item_key(self, digest: bytes, owner: str | None = None) -> bytes:
        """Where one item (the digest of its exact bytes) is, in this tenant
        only: by content alone, shared by every turn that holds those bytes;
        with ``owner`` (a response id), that turn's own, which goes with it."""
        scope = b"" if owner is None else owner.encode("utf-8", "surrogatepass") + b"\x00"
        return self.shard + self._key(b"item", scope + digest)[SHARD_TAG_SIZE:]

    def item_id_key(self, item_id: str) -> bytes:
        """Where the item an ``item_reference`` names is found, in this tenant only."""
        return self._own_keys(b"item-id", item_id)[0]

    def item_id_keys(self, item_id: str) -> list[bytes]:
        return self._keys(b"item-id", item_id)

    def deletion_key(self, response_id: str) -> bytes:
        """Where the mark of a deletion is, in this tenant only (the turn's shard tag: they land together)."""
        return self._own_keys(b"deleted", response_id)[0]

    def deletion_keys(self, response_id: str) -> list[bytes]:
        return self._keys(b"deleted", response_id)

    def conversation_key(self, conversation_id: str) -> bytes:
        """Where a conversation's log is, in this tenant only."""
        return self._own_keys(b"conversation", conversation_id)[0]

    def conversation_keys(self, conversation_id: str) -> list[bytes]:
        return self._keys(b"conversation", conversation_id)

    def ledger_key(self) -> bytes:
        """Where the list of this tenant's conversations is: what its share of the store is counted from."""
        return self._own_keys(b"conversations", "")[0]

    def seal(self, data: bytes, key: bytes) -> bytes:
        nonce = random_bytes(_NONCE)
        return nonce + self._aead.encrypt(nonce, data, key)

    def open(self, sealed: bytes, key: bytes) -> bytes | None:
        """The plaintext, or None when it was sealed for another key or tenant."""
        for tenant in (self, *self.older):
            try:
                return tenant._aead.decrypt(sealed[:_NONCE], sealed[_NONCE:], key)
            except (InvalidTag, ValueError):
                continue
        return None

    def seal_turn(self, body: TurnBody, *, created: float, size: int, stored_upstream: bool,
                  fingerprint_of: object, ancestors: list[bytes]) -> tuple[bytes, TurnHeader, bytes]:
        """(key, header, record) of one turn. ``fingerprint_of`` is what makes
        two recordings of one id the same content (whatever their compression)."""
        key = self.turn_key(body.response_id)
        fingerprint = blake3(self.tag + _ENCODE(fingerprint_of), key=self._secret).digest(KEY_SIZE)
        header = TurnHeader("completed", created, size, fingerprint, stored_upstream,
                            self.seal(_ENCODE(body), key), ancestors[:ANCESTORS])
        return key, header, _ENCODE(header)

    def deleted(self, header: TurnHeader, body: TurnBody, key: bytes) -> bytes:
        """The record of a deleted turn that other turns still rely on: what
        their chains need (its input and output), sealed again under the
        secret ``key`` was made with, without the response object; never
        retrieved or continued from again."""
        kept = msgspec.structs.replace(body, response=b"{}")
        sealed = self.recorder(body.response_id, key).seal(_ENCODE(kept), key)
        return _ENCODE(msgspec.structs.replace(header, status="deleted", sealed=sealed))

    def recorder(self, response_id: str, key: bytes) -> Tenant:
        """This credential under the secret the turn at ``key`` was recorded with."""
        return next((t for t in (self, *self.older) if key in t._own_keys(b"turn", response_id)), self)

    def open_turn(self, response_id: str, key: bytes, record: bytes) -> tuple[TurnHeader, TurnBody] | None:
        """A recorded turn (``key`` is its ``turn_key``), or None: unreadable,
        sealed for someone else, or under another id. Never someone else's
        content."""
        header = header_of(record)
        if header is None:
            return None
        plain = self.open(header.sealed, key)
        if plain is None:
            return None
        try:
            body = _BODY.decode(plain)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if body.response_id != response_id:
            return None
        return header, body


SEAL_KEY_VARIABLE = "STATEFUL_RESPONSES_SEAL_KEY"
MIN_SEAL_KEY = 16


def seal_key(path: str, environ: Mapping[str, str] = os.environ) -> bytes:
    """The key that does not live in the store: the file's bytes, or the
    environment variable's; empty when neither is set. OSError when the file
    cannot be read, ValueError when the key is too short to protect anything."""
    if path:
        with open(os.path.expanduser(path), "rb") as f:
            key = f.read().strip()
    else:
        key = environ.get(SEAL_KEY_VARIABLE, "").encode()
    if key and len(key) < MIN_SEAL_KEY:
        raise ValueError(f"a seal key needs at least {MIN_SEAL_KEY} bytes")
    return key


_SEAL_CONTEXT_WITH_KEY = "stateful-responses 2026-12 recorded turn seal with a key outside the store"


@functools.lru_cache(maxsize=256)
def _tenant(secret: bytes, credential: bytes, seal_key: bytes, older_secrets: tuple[bytes, ...]) -> Tenant:
    """One Tenant per credential while it is in use: deriving its key and
    setting up its cipher on every request would cost more than sealing."""
    tag = blake3(b"tenant\x00" + credential, key=secret).digest(KEY_SIZE)
    if seal_key:
        material = blake3(seal_key).digest() + secret + credential
        key = blake3(material, derive_key_context=_SEAL_CONTEXT_WITH_KEY).digest(32)
    else:
        key = blake3(secret + credential, derive_key_context=_SEAL_CONTEXT).digest(32)
    older = tuple(_tenant(s, credential, seal_key, ()) for s in older_secrets if s != secret)
    return Tenant(tag, secret, ChaCha20Poly1305(key), older, shard_tag(tag))


def header_of(record: bytes) -> TurnHeader | None:
    """The clear part of a record (for conflicts), without opening it."""
    try:
        return _HEADER.decode(record)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def conflict(existing: bytes, new: bytes) -> bytes | None:
    """When one id arrives with two different contents (an upstream that
    reuses ids: a restarted server counting from 1), the tombstone to store in
    its place: continuing from it is "not found", never a wrong context.
    The same turn recorded again: None, or the existing record if a client
    deleted it meanwhile."""
    old, fresh = header_of(existing), header_of(new)
    if old is None or fresh is None:
        return None  # an unreadable old record is simply replaced
    if old.status == "conflict" or old.fingerprint != fresh.fingerprint:
        return _ENCODE(TurnHeader("conflict", fresh.created, 0, fresh.fingerprint, False, b""))
    return existing if old.status == "deleted" else None  # a deleted turn stays deleted
