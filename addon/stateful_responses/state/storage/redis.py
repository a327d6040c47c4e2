"""The ``redis`` backend: Redis or Valkey, one server or a Redis Cluster,
shared by any number of proxies.

Records live in shards. A shard is every key under one hash tag, so that it
sits in one slot of a cluster and the Lua scripts below may touch all of it.
A server with cluster mode on (``INFO cluster`` says so at the first call,
whichever node of the cluster the URL names) gets ``SHARDS`` of them,
``{stateful-responses:<n>}:``, each in its own ``SHARDS``-th of the slot
space, so that they spread over the masters as evenly as the slots do. A
record's shard comes from the shard tag that leads its key (see
``SHARD_TAG_SIZE``): the records of one tag, in every table, are in one
shard. Any other server has a single shard, ``{stateful-responses}:``.
Layout of a shard, after its prefix:

  ``r:<table>:<key>``  a record: its value, with a key TTL (a log's length
                       record and its entries are records too, of one shard)
  ``i:<table>``        the shard's index of the table: a sorted set of its
                       record keys, scored by expiry in milliseconds of the
                       server's clock
  ``tables``           the set of table names that have an index in the shard

and, on their own, ``{stateful-responses}:secret``: the 32-byte secret, and
``{stateful-responses}:secrets``: every secret the store has used (see
``keyring``), no TTL either. Every write gives the secret back to a server
that lost it (restarted empty, or an eviction), in the same pipeline, ahead of
its records.

The indexes are what bound a table, what ``scan`` reads and what ``clear``
walks, so nothing ever SCANs the keyspace. A write is one script per shard it
touches, which keeps the shard's records and indexes in step atomically;
Redis expires the records themselves.

In a cluster nothing spans shards atomically: the scripts of a batch go out
together (one pipeline per master, the masters at once), a reader may see one
shard's part of a batch before another's, and a failure may leave some parts
written and others not: the error names the shards' parts that may be
unwritten (``StorageError.unwritten``), to be sent again. The records of one
shard tag are never seen half written. A part with appends is applied once
only: its script first sets ``once:<token>`` in the shard (``Batch.once``,
for ``ONCE_TTL``) and does nothing if it was there.

Bounds: a write keeps its shard's part of a table within the table's limit,
which on one server is the whole table, so the bound is exact. In a cluster, a
process that has put 1% of a table's limit into it since it last counted the
table counts every shard, and evicts the soonest-expiring records beyond the
limit. So a table outgrows its limit by about 1% for each process that writes
it, and what goes is the soonest-expiring, save when one shard holds more than
twice its share of it (that shard then loses less, until the next count).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from . import DEFAULT_TABLE_LIMIT, LOG_INDEX_SIZE, ONCE_TTL, SHARD_TAG_SIZE, Batch, StorageError, check_table

T = TypeVar("T")
Client = redis.asyncio.Redis | RedisCluster
logger = logging.getLogger(__name__)

# Shards of a cluster: enough to spread over a handful of masters, few enough
# that a scan, a clear or a trim (which visit them all) stays one pipeline per
# master. Every process sharing a cluster must agree on it.
SHARDS = 64
TRIM_SLACK = 100  # in a cluster, a writer counts a table after putting limit / TRIM_SLACK records into it

_NOW_MS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
"""

# A log's length record and its entries' indexes: LOG_INDEX_SIZE bytes,
# big-endian (exact in Lua's numbers up to 2^53 entries).
_LOG_INDEX = """
local function log_index(n)
    local bytes = {}
    for i = %d, 1, -1 do
        bytes[i] = n %% 256
        n = math.floor(n / 256)
    end
    return string.char(unpack(bytes))
end
local function log_length(record)
    local n = 0
    for i = 1, #record do
        n = n * 256 + string.byte(record, i)
    end
    return n
end
""" % LOG_INDEX_SIZE

# One shard's part of a batch: its deletes, its drops, its puts, its appends,
# then its touches.
# KEYS: the shard's tables set; per delete section, the table's index then its
#   record keys; per drop section, the table's index then its logs' length
#   records; per put section, the index then its record keys; per append
#   section, the index then the log's length record; per touch section, the
#   index then its record keys.
#   With a once token, the token's key comes second, after the tables set.
# ARGV: the number of delete, drop, put, append and touch sections; the once
#   token's ttl ms ("" without a token); per delete and per drop section, its
#   number of keys; per put section, its number of
#   keys, ttl ms, limit, table name, then one value per record key; per append
#   section, its number of values, ttl ms, limit, table name, "1" to start the
#   log if it is not there, then the values; per touch section, its number of
#   keys and ttl ms (a record there that expires sooner is kept ttl from now).
# An append's entries are numbered here, inside the script: a concurrent
# append, from this process or another, takes the places after them.
# Scores are printed with microseconds: records put one after another never tie.
# Long lists go to unpack() in slices of 1000: Lua's stack is limited.
WRITE = _NOW_MS + _LOG_INDEX + """
local function keep_within(index, limit)
    redis.call('ZREMRANGEBYSCORE', index, '-inf', string.format('%.3f', now))
    local over = redis.call('ZCARD', index) - limit
    if over > 0 then
        local soonest = redis.call('ZRANGE', index, 0, over - 1)
        for i = 1, #soonest, 1000 do
            redis.call('DEL', unpack(soonest, i, math.min(i + 999, #soonest)))
        end
        redis.call('ZREMRANGEBYRANK', index, 0, over - 1)
    end
end
local k, a = 2, 7
if ARGV[6] ~= '' then
    if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[6]) then
        return 0  -- applied before: the batch is sent again after a failure that did not stop this part
    end
    k = 3
end
for _ = 1, tonumber(ARGV[1]) do
    local index, count = KEYS[k], tonumber(ARGV[a])
    for i = k + 1, k + count, 1000 do
        local last = math.min(i + 999, k + count)
        redis.call('DEL', unpack(KEYS, i, last))
        redis.call('ZREM', index, unpack(KEYS, i, last))
    end
    k, a = k + 1 + count, a + 1
end
for _ = 1, tonumber(ARGV[2]) do
    local index, count = KEYS[k], tonumber(ARGV[a])
    for i = k + 1, k + count do
        local length = redis.call('GET', KEYS[i])
        local doomed = {KEYS[i]}
        for n = 0, (length and log_length(length) or 0) - 1 do
            doomed[#doomed + 1] = KEYS[i] .. log_index(n)
        end
        for j = 1, #doomed, 1000 do
            local last = math.min(j + 999, #doomed)
            redis.call('DEL', unpack(doomed, j, last))
            redis.call('ZREM', index, unpack(doomed, j, last))
        end
    end
    k, a = k + 1 + count, a + 1
end
for _ = 1, tonumber(ARGV[3]) do
    local index, count, ttl, limit = KEYS[k], tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local expires = string.format('%.3f', now + ttl)
    for i = 1, count do
        redis.call('SET', KEYS[k + i], ARGV[a + 3 + i], 'PX', ttl)
        redis.call('ZADD', index, expires, KEYS[k + i])
    end
    keep_within(index, limit)
    if redis.call('PTTL', index) < ttl then
        redis.call('PEXPIRE', index, ttl)
    end
    redis.call('SADD', KEYS[1], ARGV[a + 3])
    k, a = k + 1 + count, a + 4 + count
end
for _ = 1, tonumber(ARGV[4]) do
    local index, log = KEYS[k], KEYS[k + 1]
    local count, ttl, limit = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local length = redis.call('GET', log)
    if length or ARGV[a + 4] == '1' then
        local n = length and log_length(length) or 0
        local expires = string.format('%.3f', now + ttl)
        for i = 1, count do
            local entry = log .. log_index(n)
            redis.call('SET', entry, ARGV[a + 4 + i], 'PX', ttl)
            redis.call('ZADD', index, expires, entry)
            n = n + 1
        end
        local keep = math.max(redis.call('PTTL', log), ttl)
        redis.call('SET', log, log_index(n), 'PX', keep)
        redis.call('ZADD', index, string.format('%.3f', now + keep), log)
        keep_within(index, limit)
        if redis.call('PTTL', index) < keep then
            redis.call('PEXPIRE', index, keep)
        end
        redis.call('SADD', KEYS[1], ARGV[a + 3])
    end
    k, a = k + 2, a + 5 + count
end
for _ = 1, tonumber(ARGV[5]) do
    local index, count, ttl = KEYS[k], tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    local expires = string.format('%.3f', now + ttl)
    for i = 1, count do
        local left = redis.call('PTTL', KEYS[k + i])
        if left > 0 and left < ttl then
            redis.call('PEXPIRE', KEYS[k + i], ttl)
            redis.call('ZADD', index, expires, KEYS[k + i])
        end
    end
    if redis.call('PTTL', index) < ttl then
        redis.call('PEXPIRE', index, ttl)
    end
    k, a = k + 1 + count, a + 2
end
"""

# KEYS: index. Returns key1, value1, key2, value2, ... of the unexpired records.
SCAN = _NOW_MS + """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%.3f', now), '+inf')
local found = {}
for i = 1, #members, 1000 do
    local values = redis.call('MGET', unpack(members, i, math.min(i + 999, #members)))
    for j = 1, #values do
        if values[j] then
            found[#found + 1] = members[i + j - 1]
            found[#found + 1] = values[j]
        end
    end
end
return found
"""

# KEYS: tables set.  ARGV: the index key prefix.
CLEAR = """
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local index = ARGV[1] .. name
    local members = redis.call('ZRANGE', index, 0, -1)
    for i = 1, #members, 1000 do
        redis.call('DEL', unpack(members, i, math.min(i + 999, #members)))
    end
    redis.call('DEL', index)
end
redis.call('DEL', KEYS[1])
"""

# KEYS: the secret, the secrets used.  ARGV: the secret to publish if there is
# none, and "1" if it is one this process used from this store. Returns the
# secret and every secret the store has used.
KEYRING = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local current = redis.call('GET', KEYS[1])
redis.call('SADD', KEYS[2], current)
if ARGV[2] == '1' then
    redis.call('SADD', KEYS[2], ARGV[1])
end
return {current, redis.call('SMEMBERS', KEYS[2])}
"""

# A cluster's table trim, shard by shard: how many records (SIZE), the soonest
# expiries (SOONEST), then evict the soonest up to a score (EVICT).
# KEYS: index. Drops expired members; returns how many are left.
SIZE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.3f', now))
return redis.call('ZCARD', KEYS[1])
"""

# KEYS: index.  ARGV: how many. Returns the scores of the soonest-expiring members.
SOONEST = """
local found = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
local scores = {}
for i = 2, #found, 2 do
    scores[#scores + 1] = found[i]
end
return scores
"""

# KEYS: index.  ARGV: a score, a count. Deletes the soonest records scored at
# most that, at most count of them.
EVICT = """
local soonest = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for i = 1, #soonest, 1000 do
    local last = math.min(i + 999, #soonest)
    redis.call('DEL', unpack(soonest, i, last))
    redis.call('ZREM', KEYS[1], unpack(soonest, i, last))
end
"""

ScriptCall = tuple[AsyncScript, list[bytes], list]


def cluster_shards(tag: str, shards: int = SHARDS) -> list[bytes]:
    """The key prefix of each shard of a cluster, ``{<tag>:<n>}:``: for the
    s-th, the first n whose slot lies in the s-th ``shards``-th of the slot
    space, so that the shards spread over the masters as the slots do."""
    found: dict[int, bytes] = {}
    n = 0
    while len(found) < shards:
        name = f"{tag}:{n}".encode()
        found.setdefault(key_slot(name) * shards // REDIS_CLUSTER_HASH_SLOTS, name)
        n += 1
    return [b"{" + found[shard] + b"}:" for shard in range(shards)]


class RedisStorage:
    """Records on a Redis server or a Redis Cluster. Bounds evict the records
    that expire soonest (the oldest written, for a table written with one
    ttl). Calls fail fast (``timeout``) instead of retrying, save that a
    cluster call that fails to connect is tried once more (the first call on a
    pooled connection to a restarted master fails so); MOVED and ASK
    redirections are followed. After a connection failure the idle pooled
    connections are dropped too: one that a vanished server left half-open
    would otherwise cost another timeout when next used. A cluster client then
    also learns the cluster's layout anew."""

    def __init__(
        self,
        url: str,
        limits: Mapping[str, int] | None = None,
        *,
        connect_timeout: float = 0.5,
        timeout: float = 2.0,  # a reply's wait: the request path's reads set shorter bounds of their own
        prefix: str = "stateful-responses",
        default_limit: int = DEFAULT_TABLE_LIMIT,
    ):
        parts = urlsplit(url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        database = parts.path.removeprefix("/") or "0"
        self.name = f"{parts.scheme}://{host}:{parts.port or 6379}/{database}"
        self._url = url
        self._database = int(database)
        self._limits = dict(limits or {})
        self._default_limit = default_limit
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._tag = prefix
        self._secret_key = b"{" + prefix.encode() + b"}:secret"
        self._secrets_key = b"{" + prefix.encode() + b"}:secrets"
        self._secret: bytes | None = None  # the store's, as last read: every write publishes it again
        self._policy_checked = False
        self._client: Client | None = None
        self._connecting = asyncio.Lock()
        self._shards: list[bytes] = []  # each shard's key prefix, once connected
        self._uncounted: dict[str, int] = {}  # in a cluster, per table: records put since it was last counted

    async def _connection(self) -> Client:
        if self._client is None:
            async with self._connecting:  # one client, when the first calls come at once
                if self._client is None:
                    self._client = await self._connect()
        return self._client

    async def _connect(self) -> Client:
        """A client of the server, or of the cluster it is a node of."""
        timeouts = {"socket_connect_timeout": self._connect_timeout, "socket_timeout": self._timeout}
        # Database 0, which every server has: a cluster node refuses to SELECT another.
        probe = redis.asyncio.Redis.from_url(urlsplit(self._url)._replace(path="").geturl(),
                                             retry=Retry(NoBackoff(), 0), **timeouts)
        try:
            clustered = (await probe.info("cluster")).get("cluster_enabled") == 1
        finally:
            await probe.aclose()
        client: Client
        if clustered:
            if self._database != 0:
                raise StorageError(f"{self.name}: a Redis Cluster has database 0 only")
            # No retries inside redis-py: a cluster pipeline retries by closing every
            # connection of the client, the other masters' pipelines in flight with
            # them. ``_call`` refreshes the slots and retries a read itself.
            client = RedisCluster.from_url(self._url, retry=Retry(NoBackoff(), 0), **timeouts)
            self._shards = cluster_shards(self._tag)
        else:
            client = redis.asyncio.Redis.from_url(self._url, retry=Retry(NoBackoff(), 0), **timeouts)
            self._shards = [b"{" + self._tag.encode() + b"}:"]
        self._write_script = client.register_script(WRITE)
        self._scan_script = client.register_script(SCAN)
        self._clear_script = client.register_script(CLEAR)
        self._keyring_script = client.register_script(KEYRING)
        self._size_script = client.register_script(SIZE)
        self._soonest_script = client.register_script(SOONEST)
        self._evict_script = client.register_script(EVICT)
        return client

    async def _call(self, operation: Callable[[Client], Awaitable[T]], *, idempotent: bool = False) -> T:
        """``operation`` on the client. One that may run twice (a read) and
        lost its connection is tried once more: on a new connection (the
        server restarted, or closed an idle one), and in a cluster on the
        slots' owners as it now names them (a failover moved them)."""
        client = None
        try:
            client = await self._connection()
            return await operation(client)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            if client is not None and isinstance(
                    exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
                await self._after_lost_connection(client)
                if idempotent:
                    return await self._call(operation)
            raise StorageError(f"{self.name}: {_describe(exc)}") from exc

    @staticmethod
    async def _after_lost_connection(client: Client) -> None:
        """Drop idle connections (a server that restarted closed them), or in a
        cluster ask a node again which master serves each slot. Connections in
        use stay: other calls are in flight on them."""
        if not isinstance(client, RedisCluster):
            await client.connection_pool.disconnect(inuse_connections=False)
            return
        try:
            await client.nodes_manager.initialize()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError):
            pass  # no node answered: the next call finds the same slots and fails as this one did

    @classmethod
    async def _run(cls, client: Client, calls: Sequence[ScriptCall]) -> list:
        """Each script's result; the first error is raised."""
        results = await cls._results(client, calls)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    @staticmethod
    async def _results(client: Client, calls: Sequence[ScriptCall]) -> list:
        """Each script on the shard its keys name, its result or its error in
        its place: one call, or one pipeline (in a cluster, one per master,
        all at once, so that a master that fails fails its calls only). A
        master that lost its scripts (restarted, or new) is given them and the
        calls run again."""
        if len(calls) == 1:
            script, keys, args = calls[0]
            try:
                return [await script(keys=keys, args=args)]
            except redis.exceptions.RedisError as exc:
                return [exc]
        results = await _per_master(client, calls)
        unknown = [i for i, result in enumerate(results) if isinstance(result, redis.exceptions.NoScriptError)]
        if unknown:
            for script in {calls[i][0] for i in unknown}:
                await client.script_load(script.script)  # in a cluster, on every master
            for i, result in zip(unknown, await _per_master(client, [calls[i] for i in unknown])):
                results[i] = result
        return results

    def _shard(self, key: bytes) -> int:
        return zlib.crc32(key[:SHARD_TAG_SIZE]) % len(self._shards)

    def _record_prefix(self, shard: int, table: str) -> bytes:
        return self._shards[shard] + b"r:" + table.encode() + b":"

    def _index(self, shard: int, table: str) -> bytes:
        return self._shards[shard] + b"i:" + table.encode()

    def _limit(self, table: str) -> int:
        return self._limits.get(table, self._default_limit)

    async def open(self) -> None:
        await self.ping()
        if not self._policy_checked:
            self._policy_checked = True
            await self._warn_about_eviction()

    async def _warn_about_eviction(self) -> None:
        """Records carry TTLs and the secret carries none: a policy that evicts
        keys without a TTL can evict the secret and every record's meaning with
        it. Servers that refuse CONFIG GET (managed ones) are not asked twice."""
        try:
            reply = await self._call(lambda client: client.config_get("maxmemory-policy"))
        except StorageError:
            return
        policy = {_text(k): _text(v) for k, v in reply.items()}.get("maxmemory-policy", "")
        if policy.startswith("allkeys"):
            logger.warning("stateful-responses: %s evicts keys without a TTL (maxmemory-policy %s): set noeviction "
                           "or a volatile-* policy, or the store's secret may be evicted", self.name, policy)

    async def keyring(self, ours: bytes | None = None) -> tuple[bytes, tuple[bytes, ...]]:
        reply = await self._call(lambda client: self._keyring_script(
            keys=[self._secret_key, self._secrets_key], args=[ours or os.urandom(32), b"1" if ours else b"0"]),
            idempotent=True)  # it sets the secret only where there is none: twice is once
        self._secret = bytes(reply[0])
        return self._secret, tuple(bytes(s) for s in reply[1] if bytes(s) != self._secret)

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        check_table(table)
        if not keys:
            return {}

        async def read(client: Client) -> list[bytes | None]:
            names = [self._record_prefix(self._shard(key), table) + key for key in keys]
            if isinstance(client, RedisCluster):
                return await client.mget_nonatomic(names)  # one MGET per slot, pipelined
            return await client.mget(names)

        values = await self._call(read, idempotent=True)
        return {key: value for key, value in zip(keys, values) if value is not None}

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        await self.write(Batch(puts=[(table, records, ttl)]))

    async def delete(self, table: str, keys: Sequence[bytes]) -> None:
        await self.write(Batch(deletes=[(table, keys)]))

    async def write(self, batch: Batch) -> None:
        for table, *_ in (*batch.deletes, *batch.drops, *batch.puts, *batch.appends, *batch.touches):
            check_table(table)
        if not any(keys for _, keys in batch.deletes) and not any(records for _, records, _ in batch.puts) \
                and not any(keys for _, keys, _ in batch.touches) and not any(logs for _, logs in batch.drops) \
                and not any(values for _, _, values, _, _ in batch.appends):
            return
        secret = self._secret
        unwritten: list[Batch | None] = [None]

        async def in_one_script_per_shard(client: Client) -> None:
            parts = self._shard_parts(batch)
            calls = [(self._write_script, keys, args) for _, keys, args in parts]
            if secret is not None:  # a server that restarted empty gets the secret back ahead of any record
                calls.insert(0, (self._keyring_script, [self._secret_key, self._secrets_key], [secret, b"1"]))
            results = (await self._results(client, calls))[len(calls) - len(parts):]
            failed = {shard for (shard, _, _), result in zip(parts, results) if isinstance(result, BaseException)}
            if failed:
                unwritten[0] = self._part_of(batch, failed) if len(failed) < len(parts) else batch
                raise next(result for result in results if isinstance(result, BaseException))

        try:
            await self._call(in_one_script_per_shard)
        except StorageError as e:
            e.unwritten = unwritten[0]
            raise
        if len(self._shards) > 1:
            await self._keep_bounds(batch)

    async def _keep_bounds(self, batch: Batch) -> None:
        """In a cluster, count a table over every shard once 1% of its limit
        was put into it since it was last counted. A count that fails is made
        at a later write."""
        written = [(table, len(records)) for table, records, _ in batch.puts] + \
            [(table, len(values) + 1) for table, _, values, _, _ in batch.appends]
        for table, count in written:
            self._uncounted[table] = self._uncounted.get(table, 0) + count
        for table in {table for table, count in written if count}:
            limit = self._limit(table)
            if self._uncounted[table] > limit // TRIM_SLACK:
                try:
                    await self._call(lambda client: self._trim(client, table, limit))
                except StorageError:
                    return
                self._uncounted[table] = 0

    def _shard_parts(self, batch: Batch) -> list[tuple[int, list[bytes], list]]:
        """Each shard's part of ``batch``: the shard, the WRITE script's keys and arguments."""
        deletes: dict[int, dict[str, list[bytes]]] = {}
        for table, keys in batch.deletes:
            for key in keys:
                shard = self._shard(key)
                deletes.setdefault(shard, {}).setdefault(table, []).append(self._record_prefix(shard, table) + key)
        puts: dict[int, dict[int, tuple[list[bytes], list[bytes]]]] = {}  # shard, then which put of the batch
        for n, (table, records, _) in enumerate(batch.puts):
            for key, value in records.items():
                shard = self._shard(key)
                names, values = puts.setdefault(shard, {}).setdefault(n, ([], []))
                names.append(self._record_prefix(shard, table) + key)
                values.append(value)
        touches: dict[int, dict[int, list[bytes]]] = {}  # shard, then which touch of the batch
        for n, (table, keys, _) in enumerate(batch.touches):
            for key in keys:
                shard = self._shard(key)
                touches.setdefault(shard, {}).setdefault(n, []).append(self._record_prefix(shard, table) + key)
        drops: dict[int, dict[str, list[bytes]]] = {}  # a log, its length record and entries, is in one shard
        for table, logs in batch.drops:
            for log in logs:
                shard = self._shard(log)
                drops.setdefault(shard, {}).setdefault(table, []).append(self._record_prefix(shard, table) + log)
        appends: dict[int, list[int]] = {}  # shard -> which appends of the batch, in order
        for n, (_, log, values, _, _) in enumerate(batch.appends):
            if values:
                appends.setdefault(self._shard(log), []).append(n)
        parts = []
        for shard in {*deletes, *drops, *puts, *appends, *touches}:
            keys = [self._shards[shard] + b"tables"]
            args: list = [len(deletes.get(shard, {})), len(drops.get(shard, {})), len(puts.get(shard, {})),
                          len(appends.get(shard, [])), len(touches.get(shard, {})), b""]
            if batch.once and shard in appends:
                keys.append(self._shards[shard] + b"once:" + batch.once)
                args[5] = math.ceil(ONCE_TTL * 1000)
            for table, names in deletes.get(shard, {}).items():
                keys += [self._index(shard, table), *names]
                args.append(len(names))
            for table, names in drops.get(shard, {}).items():
                keys += [self._index(shard, table), *names]
                args.append(len(names))
            for n, (names, values) in puts.get(shard, {}).items():
                table, _, ttl = batch.puts[n]
                keys += [self._index(shard, table), *names]
                args += [len(names), max(1, math.ceil(ttl * 1000)), self._limit(table), table, *values]
            for n in appends.get(shard, []):
                table, log, entries, ttl, start = batch.appends[n]
                keys += [self._index(shard, table), self._record_prefix(shard, table) + log]
                args += [len(entries), max(1, math.ceil(ttl * 1000)), self._limit(table), table,
                         b"1" if start else b"0", *entries]
            for n, names in touches.get(shard, {}).items():
                table, _, ttl = batch.touches[n]
                keys += [self._index(shard, table), *names]
                args += [len(names), max(1, math.ceil(ttl * 1000))]
            parts.append((shard, keys, args))
        return parts

    def _part_of(self, batch: Batch, shards: set[int]) -> Batch:
        """What ``batch`` writes to ``shards``."""
        def ours(key: bytes) -> bool:
            return self._shard(key) in shards

        return Batch(puts=[(table, {k: v for k, v in records.items() if ours(k)}, ttl)
                           for table, records, ttl in batch.puts],
                     deletes=[(table, [k for k in keys if ours(k)]) for table, keys in batch.deletes],
                     touches=[(table, [k for k in keys if ours(k)], ttl) for table, keys, ttl in batch.touches],
                     appends=[append for append in batch.appends if ours(append[1])],
                     drops=[(table, [log for log in logs if ours(log)]) for table, logs in batch.drops],
                     once=batch.once)

    async def _trim(self, client: Client, table: str, limit: int) -> None:
        """Evict the soonest-expiring records of ``table`` beyond ``limit``,
        over every shard: count them all, take from each shard its soonest
        (up to twice its share of those to evict, and one more), and evict the
        soonest among them."""
        indexes = [self._index(shard, table) for shard in range(len(self._shards))]
        sizes = await self._run(client, [(self._size_script, [index], []) for index in indexes])
        total = sum(sizes)
        over = total - limit
        if over <= 0:
            return
        heads = {shard: min(size, over, 2 * math.ceil(over * size / total) + 1)
                 for shard, size in enumerate(sizes) if size}
        soonest = await self._run(client, [(self._soonest_script, [indexes[shard]], [count])
                                           for shard, count in heads.items()])
        chosen = heapq.nsmallest(over, ((float(score), shard) for shard, scores in zip(heads, soonest)
                                        for score in scores))
        evictions: dict[int, tuple[float, int]] = {}
        for score, shard in chosen:  # ascending: the last score of a shard is its highest
            evictions[shard] = (score, evictions.get(shard, (score, 0))[1] + 1)
        await self._run(client, [(self._evict_script, [indexes[shard]], [score, count])
                                 for shard, (score, count) in evictions.items()])

    async def scan(self, table: str) -> dict[bytes, bytes]:
        check_table(table)

        async def read(client: Client) -> dict[bytes, bytes]:
            shards = range(len(self._shards))
            flats = await self._run(client, [(self._scan_script, [self._index(shard, table)], []) for shard in shards])
            found = {}
            for shard, flat in zip(shards, flats):
                prefix = self._record_prefix(shard, table)
                found.update((flat[i].removeprefix(prefix), flat[i + 1]) for i in range(0, len(flat), 2))
            return found

        return await self._call(read, idempotent=True)

    async def clear(self) -> None:
        await self._call(lambda client: self._run(
            client, [(self._clear_script, [shard + b"tables"], [shard + b"i:"]) for shard in self._shards]))

    async def ping(self) -> None:
        await self._call(lambda client: client.ping(target_nodes=RedisCluster.PRIMARIES)
                         if isinstance(client, RedisCluster) else client.ping(), idempotent=True)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


async def _per_master(client: Client, calls: Sequence[ScriptCall]) -> list:
    """Each call's result or error in its place: one pipeline, or in a
    cluster one per master, all at once, so that a master out of reach (an
    error for its whole pipeline) fails only the calls of its own slots."""
    if not isinstance(client, RedisCluster):
        return await _pipelined(client, calls)
    await client.initialize()  # the slots' owners, if the client has not asked for them yet
    masters: dict[str, list[int]] = {}
    for i, (_, keys, _) in enumerate(calls):
        try:
            node = client.get_node_from_key(keys[0])
        except redis.exceptions.RedisClusterException:  # a slot no master serves: its call fails alone
            node = None
        masters.setdefault(node.name if node is not None else "", []).append(i)
    outcomes = await asyncio.gather(*(_pipelined(client, [calls[i] for i in group]) for group in masters.values()),
                                    return_exceptions=True)
    results: list = [None] * len(calls)
    for group, outcome in zip(masters.values(), outcomes):
        for n, i in enumerate(group):
            results[i] = outcome if isinstance(outcome, BaseException) else outcome[n]
    return results


async def _pipelined(client: Client, calls: Sequence[ScriptCall]) -> list:
    """EVALSHA of each call in one pipeline, each result or error in its
    place. (A cluster pipeline blocks its evalsha() method, which cannot load a
    script a master lacks; ``RedisStorage._results`` does. The command itself
    goes to the master of its keys' slot.)"""
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    return await pipe.execute(raise_on_error=False)


def _text(value: bytes | str) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _describe(exc: BaseException) -> str:
    """What failed, in words safe to log: redis-py's messages can carry the
    server's reply, so only the kind and the server's error code are kept."""
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return "authentication failed"
    if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, (redis.exceptions.ConnectionError, OSError)):
        return "unreachable"
    if isinstance(exc, redis.exceptions.ClusterDownError):
        return "the cluster is down"
    if isinstance(exc, redis.exceptions.ClusterError):
        return "redirected too often (slots moving)"
    if isinstance(exc, redis.exceptions.RedisClusterException):
        return "no cluster to be reached"
    if isinstance(exc, redis.exceptions.ResponseError):
        code = str(exc).split(" ", 1)[0]
        return f"refused the command ({code})" if code.isalpha() and code.isupper() else "refused the command"
    return f"failed ({type(exc).__name__})"
