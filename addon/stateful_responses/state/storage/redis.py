"""The ``redis`` backend: Redis or Valkey, shared by any number of proxies.

Every key starts with one hash tag, ``{stateful-responses}:``, so the whole
state sits in one slot of a Redis Cluster and the Lua scripts below may touch
any of it. Layout, after that prefix:

  ``r:<table>:<key>``  a record: its value, with a key TTL (a log's length
                       record and its entries are records too)
  ``i:<table>``        the table's index: a sorted set of its record keys,
                       scored by expiry in milliseconds of the server's clock
  ``tables``           the set of table names that have an index
  ``secret``           the 32-byte secret, no TTL
  ``secrets``          every secret the store has used, no TTL (see ``keyring``)

The index is what bounds a table, what ``scan`` reads and what ``clear``
walks, so nothing ever SCANs the keyspace. It is kept atomically with the
records by the scripts; Redis expires the records themselves.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from . import DEFAULT_TABLE_LIMIT, LOG_INDEX_SIZE, Batch, StorageError, check_table

T = TypeVar("T")
logger = logging.getLogger(__name__)

_NOW_MS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
"""

# KEYS: index, tables set, record keys...  ARGV: ttl ms, limit, table name, values... (one per record key)
# Scores are printed with microseconds: records put one after another never tie.
# Long lists go to unpack() in slices of 1000: Lua's stack is limited.
PUT = _NOW_MS + """
local ttl = tonumber(ARGV[1])
local expires = string.format('%.3f', now + ttl)
for i = 3, #KEYS do
    redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ARGV[1])
    redis.call('ZADD', KEYS[1], expires, KEYS[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.3f', now))
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if over > 0 then
    local soonest = redis.call('ZRANGE', KEYS[1], 0, over - 1)
    for i = 1, #soonest, 1000 do
        redis.call('DEL', unpack(soonest, i, math.min(i + 999, #soonest)))
    end
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
end
if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
redis.call('SADD', KEYS[2], ARGV[3])
"""

# A log's length record and entry indexes: LOG_INDEX_SIZE bytes, big-endian
# (exact in Lua's doubles up to 2^53 entries).
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

# KEYS: index, tables set, the log's length record.  ARGV: ttl ms, limit, table
# name, "1" to start the log if it is not there, values... The entries are
# numbered here, inside the script: a concurrent append, from this process or
# another, takes the places after these.
APPEND = _NOW_MS + _LOG_INDEX + """
local ttl = tonumber(ARGV[1])
local length = redis.call('GET', KEYS[3])
if not length and ARGV[4] ~= '1' then
    return 0
end
local n = length and log_length(length) or 0
local expires = string.format('%.3f', now + ttl)
for i = 5, #ARGV do
    local entry = KEYS[3] .. log_index(n)
    redis.call('SET', entry, ARGV[i], 'PX', ARGV[1])
    redis.call('ZADD', KEYS[1], expires, entry)
    n = n + 1
end
local keep = math.max(redis.call('PTTL', KEYS[3]), ttl)
redis.call('SET', KEYS[3], log_index(n), 'PX', keep)
redis.call('ZADD', KEYS[1], string.format('%.3f', now + keep), KEYS[3])
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if over > 0 then
    local soonest = redis.call('ZRANGE', KEYS[1], 0, over - 1)
    for i = 1, #soonest, 1000 do
        redis.call('DEL', unpack(soonest, i, math.min(i + 999, #soonest)))
    end
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
end
if redis.call('PTTL', KEYS[1]) < keep then
    redis.call('PEXPIRE', KEYS[1], keep)
end
redis.call('SADD', KEYS[2], ARGV[3])
return n
"""

# KEYS: index, the logs' length records... Each log goes whole: its length
# record and every entry it counts.
DROP = _LOG_INDEX + """
for k = 2, #KEYS do
    local length = redis.call('GET', KEYS[k])
    local n = length and log_length(length) or 0
    local doomed = {KEYS[k]}
    for i = 0, n - 1 do
        doomed[#doomed + 1] = KEYS[k] .. log_index(i)
    end
    for i = 1, #doomed, 1000 do
        local slice = {unpack(doomed, i, math.min(i + 999, #doomed))}
        redis.call('DEL', unpack(slice))
        redis.call('ZREM', KEYS[1], unpack(slice))
    end
end
"""

# KEYS: index, record keys...  ARGV: ttl ms. Records that are there and expire
# sooner are kept ttl from now; absent ones stay absent.
TOUCH = _NOW_MS + """
local ttl = tonumber(ARGV[1])
local expires = string.format('%.3f', now + ttl)
for i = 2, #KEYS do
    local left = redis.call('PTTL', KEYS[i])
    if left > 0 and left < ttl then
        redis.call('PEXPIRE', KEYS[i], ARGV[1])
        redis.call('ZADD', KEYS[1], expires, KEYS[i])
    end
end
if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
"""

# KEYS: secret, secrets.  ARGV: the secret to publish if there is none, and
# "1" if it is one this process used from this store. Returns the secret and
# every secret the store has used.
KEYRING = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local current = redis.call('GET', KEYS[1])
redis.call('SADD', KEYS[2], current)
if ARGV[2] == '1' then
    redis.call('SADD', KEYS[2], ARGV[1])
end
return {current, redis.call('SMEMBERS', KEYS[2])}
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


class RedisStorage:
    """Records on a Redis server. Bounds evict the records that expire
    soonest (the oldest written, for a table written with one ttl). Calls
    fail fast (``timeout``) instead of retrying. After a connection failure
    the idle pooled connections are dropped too: one that a vanished server
    left half-open would otherwise cost another timeout when next used."""

    def __init__(
        self,
        url: str,
        limits: Mapping[str, int] | None = None,
        *,
        connect_timeout: float = 0.5,
        timeout: float = 0.5,
        prefix: str = "stateful-responses",
        default_limit: int = DEFAULT_TABLE_LIMIT,
    ):
        parts = urlsplit(url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        self.name = f"{parts.scheme}://{host}:{parts.port or 6379}/{parts.path.removeprefix('/') or 0}"
        self._url = url
        self._limits = dict(limits or {})
        self._default_limit = default_limit
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._prefix = b"{" + prefix.encode() + b"}:"
        self._secret: bytes | None = None  # the store's, as last read: every write publishes it again
        self._client: redis.asyncio.Redis | None = None
        self._policy_checked = False

    def _connection(self) -> redis.asyncio.Redis:
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(
                self._url,
                socket_connect_timeout=self._connect_timeout,
                socket_timeout=self._timeout,
                retry=Retry(NoBackoff(), 0),
            )
            self._put_script = self._client.register_script(PUT)
            self._touch_script = self._client.register_script(TOUCH)
            self._keyring_script = self._client.register_script(KEYRING)
            self._scan_script = self._client.register_script(SCAN)
            self._clear_script = self._client.register_script(CLEAR)
            self._append_script = self._client.register_script(APPEND)
            self._drop_script = self._client.register_script(DROP)
        return self._client

    async def _call(self, operation: Callable[[redis.asyncio.Redis], Awaitable[T]]) -> T:
        client = self._connection()
        try:
            return await operation(client)
        except (redis.exceptions.RedisError, OSError) as exc:
            if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
                await client.connection_pool.disconnect(inuse_connections=False)
            raise StorageError(f"{self.name}: {_describe(exc)}") from exc

    def _record_prefix(self, table: str) -> bytes:
        return self._prefix + b"r:" + check_table(table).encode() + b":"

    def _index(self, table: str) -> bytes:
        return self._prefix + b"i:" + table.encode()

    async def open(self) -> None:
        await self._call(lambda client: client.ping())
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
        secret_key, secrets_key = self._prefix + b"secret", self._prefix + b"secrets"
        reply = await self._call(lambda client: self._keyring_script(
            keys=[secret_key, secrets_key], args=[ours or os.urandom(32), b"1" if ours else b"0"]))
        self._secret = bytes(reply[0])
        return self._secret, tuple(bytes(s) for s in reply[1] if bytes(s) != self._secret)

    async def get(self, table: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        prefix = self._record_prefix(table)
        if not keys:
            return {}
        values = await self._call(lambda client: client.mget([prefix + key for key in keys]))
        return {key: value for key, value in zip(keys, values) if value is not None}

    async def put(self, table: str, records: Mapping[bytes, bytes], ttl: float) -> None:
        await self.write(Batch(puts=[(table, records, ttl)]))

    async def delete(self, table: str, keys: Sequence[bytes]) -> None:
        await self.write(Batch(deletes=[(table, keys)]))

    async def write(self, batch: Batch) -> None:
        for table, *_ in (*batch.deletes, *batch.drops, *batch.puts, *batch.appends, *batch.touches):
            check_table(table)
        deletes = [(self._index(table), [self._record_prefix(table) + key for key in keys])
                   for table, keys in batch.deletes if keys]
        drops = [[self._index(table), *(self._record_prefix(table) + log for log in logs)]
                 for table, logs in batch.drops if logs]
        appends = [([self._index(table), self._prefix + b"tables", self._record_prefix(table) + log],
                    [max(1, math.ceil(ttl * 1000)), self._limits.get(table, self._default_limit), table,
                     b"1" if start else b"0", *values])
                   for table, log, values, ttl, start in batch.appends if values]
        puts = [([self._index(table), self._prefix + b"tables", *(self._record_prefix(table) + key for key in records)],
                 [max(1, math.ceil(ttl * 1000)), self._limits.get(table, self._default_limit), table,
                  *records.values()])
                for table, records, ttl in batch.puts if records]
        touches = [([self._index(table), *(self._record_prefix(table) + key for key in keys)],
                    [max(1, math.ceil(ttl * 1000))])
                   for table, keys, ttl in batch.touches if keys]
        if not deletes and not drops and not puts and not appends and not touches:
            return
        secret = self._secret

        async def in_one_transaction(client: redis.asyncio.Redis) -> None:
            async with client.pipeline(transaction=True) as pipe:
                if secret is not None:  # a server that restarted empty gets the secret back before any record
                    pipe.set(self._prefix + b"secret", secret, nx=True)
                    pipe.sadd(self._prefix + b"secrets", secret)
                for index, record_keys in deletes:
                    pipe.delete(*record_keys)
                    pipe.zrem(index, *record_keys)
                for keys in drops:
                    await self._drop_script(keys=keys, client=pipe)
                for keys, args in puts:
                    await self._put_script(keys=keys, args=args, client=pipe)
                for keys, args in appends:
                    await self._append_script(keys=keys, args=args, client=pipe)
                for keys, args in touches:
                    await self._touch_script(keys=keys, args=args, client=pipe)
                await pipe.execute()

        await self._call(in_one_transaction)

    async def scan(self, table: str) -> dict[bytes, bytes]:
        prefix = self._record_prefix(table)
        flat = await self._call(lambda client: self._scan_script(keys=[self._index(table)]))
        return {flat[i].removeprefix(prefix): flat[i + 1] for i in range(0, len(flat), 2)}

    async def clear(self) -> None:
        await self._call(lambda client: self._clear_script(keys=[self._prefix + b"tables"], args=[self._prefix + b"i:"]))

    async def ping(self) -> None:
        await self._call(lambda client: client.ping())

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


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
    if isinstance(exc, redis.exceptions.ResponseError):
        code = str(exc).split(" ", 1)[0]
        return f"refused the command ({code})" if code.isalpha() and code.isupper() else "refused the command"
    return f"failed ({type(exc).__name__})"
