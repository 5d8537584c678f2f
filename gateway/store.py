"""Everything the gateway keeps in Redis. All keys are named here, and redis errors become `StoreError` here.

Keys (prefix configurable, default `rg:`). Every key of one session shares the hash tag `{id}`, so a
session's multi-key writes stay in one Redis Cluster slot; what crosses slots is idempotent (DESIGN §8):

- `rg:{id}:meta` (hash): `SessionMeta.to_redis()` — status, metadata JSON, reward, sample_count, timestamps,
  replica; plus `stream_id`, set (HSETNX) by whoever delivered the session to the trajectories stream first, and
  `revision`, counted up by every sample write (a process's copy of the samples is current while it matches).
- `rg:{id}:sample:{n}` (hash): `Sample.to_redis()` — binary arrays (see gateway/trajectory.py), in chunks, so
  that a write extending the sample adds what is new instead of rewriting it all; and `writer`, the turn that
  wrote it last, so that turns of one session on two processes at once never replace each other's (`save_sample`).
- `rg:trajectories` (stream): one entry per finished session: `session_id`, `group_id`, `reward`, `samples`.
  A session may be XADDed twice after a crash; the entry whose id equals the meta's `stream_id` is the real
  one, the trainer acknowledges and skips any other (exactly-once delivery after ack).
- `rg:pending` (counter): finished sessions delivered but not yet acknowledged by a trainer (backpressure).
- `rg:sessions:active` (sorted set, score = last activity): for the idle sweeper (abandoned sessions).
- `rg:sessions:undelivered` (set): finished sessions not yet confirmed in the stream (for the repair sweeper).
- `rg:abandoned` (stream): sessions closed as abandoned — recorded, never delivered as trajectories.
- `rg:weights` (hash): `version`, `state`, `source`, `updated_at` — the weight version the pool serves.
- `rg:weights:lock` (string, PX TTL): held by the one gateway process that coordinates an update.
- `rg:control` (pub/sub channel): JSON events that let the other gateway processes follow an update.

Lifetimes: a session's keys live `session_idle_ttl_s + ttl_s` after its last write while it is active, and
`ttl_s` once it is finished or abandoned. The global keys (both streams, both sets, the counter) have no TTL:
the trainer trims `rg:trajectories` and `rg:abandoned` is capped (approximate MAXLEN).

`TrajectoryStore` owns the session lifecycle on these keys (DESIGN §3, §5, §8, §10):

- Samples are written at segment boundaries and turn ends, one atomic script per write on the session's slot,
  never per token. While Redis is unreachable the latest version of each sample waits in a bounded in-memory
  buffer that a background flusher retries; a full buffer makes the write fail loudly, it never drops one.
- `finish` is idempotent, shielded from cancellation, retried for `retry_budget_s`, and returns only once the
  session is in `rg:trajectories` (what it returns is acknowledged and durable per the server's AOF policy).
  Its steps, each idempotent, so a crash between any two is repaired by re-running them (`repair_undelivered`):
  (1) flush the session's buffered writes; SADD `rg:sessions:undelivered`; (2) one WATCHed transaction on the
  session slot: status finished, reward, metadata, finished_at, EXPIRE ttl_s on meta and samples; ZREM
  `rg:sessions:active` (a finish with no metadata to merge, every one-turn session's, sends the SADD, a script
  doing (2) on an active session, and the ZREM as one pipeline; a session that is not active goes the way just
  described); (3) XADD `rg:trajectories`; (4) HSETNX meta `stream_id` (a script: only on an existing
  meta, returns the stored id) — the writer whose entry id is stored INCRs `rg:pending`, a loser XDELs its
  duplicate; (5) SREM `rg:sessions:undelivered`.
- Consumers (the trainer): an entry is real iff its id equals its session meta's `stream_id`; skip (ack) any
  other; an entry whose meta has no `stream_id` yet is not arbitrated yet: leave it pending and look again.
  The trainer does `DECR rg:pending` once per acknowledged real entry, and deletes or expires its data.
- `rg:pending` is a backpressure gauge, not a ledger: it is INCRed at most once per real entry (never resent by
  the client's retry policy), so a crash or connection loss around that INCR can undercount by one, never over.
  `create_session` answers `Overloaded` (429 + Retry-After) while it is ≥ `max_pending`; existing sessions go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import random
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import Conflict, GatewayError, InvalidRequest, Overloaded, SessionNotFound, StoreError
from gateway.redis_batch import Build, PipelineBatcher
from gateway.redis_packing import with_hiredis_packing
from gateway.trajectory import CHUNKED, Sample, SampleSaved, SessionMeta, StoredChunks

if TYPE_CHECKING:
    from gateway.config import RedisConfig, StoreConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Compare-and-delete: release the lock only if we still own it (it may have expired and been taken).
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key the gateway uses, from one prefix."""

    prefix: str = "rg:"

    def meta(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:meta"

    def sample(self, session_id: str, index: int) -> str:
        return f"{self.prefix}{{{session_id}}}:sample:{index}"

    @property
    def trajectories(self) -> str:
        return f"{self.prefix}trajectories"

    @property
    def pending(self) -> str:
        return f"{self.prefix}pending"

    @property
    def active_sessions(self) -> str:
        return f"{self.prefix}sessions:active"

    @property
    def undelivered(self) -> str:
        return f"{self.prefix}sessions:undelivered"

    @property
    def abandoned(self) -> str:
        return f"{self.prefix}abandoned"

    @property
    def weights(self) -> str:
        return f"{self.prefix}weights"

    @property
    def weights_lock(self) -> str:
        return f"{self.prefix}weights:lock"

    @property
    def control(self) -> str:
        return f"{self.prefix}control"


@dataclass(frozen=True, slots=True)
class WeightsRecord:
    version: int
    state: str
    source: str | None


def connect(url: str, socket_timeout_s: float = 5.0, max_connections: int = 512) -> aioredis.Redis:
    """One pooled client. Commands retry on connection loss (a Redis restart) with backoff (~2.5 s in all).

    The pool blocks (up to `socket_timeout_s`) for a free connection when all `max_connections` are busy: the
    default pool fails at once with "Too many connections", which under a burst of concurrent sessions turned
    ordinary turns into 503s.

    Commands are packed by hiredis (`gateway.redis_packing`), not by the asyncio client's Python packer.

    The asyncio client needs `redis.asyncio.retry.Retry`: given the sync `redis.retry.Retry`, its
    `call_with_retry` only returns the coroutine and every error escapes the retry loop (no retry at all).
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    pool.connection_class = with_hiredis_packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


async def _call(awaitable: Awaitable[T], what: str) -> T:
    try:
        return await awaitable
    except RedisError as exc:
        raise StoreError(f"redis: {what} failed: {exc}") from exc


def _meta_of(session_id: str, flat: list[Any]) -> SessionMeta:
    """The meta of a script's HGETALL answer (field, value, field, value, ...)."""
    return SessionMeta.from_redis(session_id, dict(zip(flat[::2], flat[1::2], strict=True)))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def metadata_additions(stored: Mapping[str, Any], metadata: Mapping[str, str], session_id: str) -> dict[str, str]:
    """The keys of a request's `metadata` (OpenAI's, str → str) that a session holding `stored` does not have yet.
    A key it holds with another value is `InvalidRequest`: a session's metadata (its task, its GRPO group) never
    changes under a trainer's feet. A stored non-string value (`POST /v1/sessions` takes any JSON) equals the string
    of its JSON (4 and "4")."""
    added: dict[str, str] = {}
    for key, value in metadata.items():
        if key not in stored:
            added[key] = value
        elif (old := stored[key]) != value and (isinstance(old, str) or orjson.dumps(old).decode() != value):
            raise InvalidRequest(
                f"metadata.{key} = {value!r} conflicts with session {session_id}'s {key} = {old!r}; a session's "
                "metadata keys are set once",
                param="metadata",
            )
    return added


class WeightsBus:
    """Coordinates weight updates between gateway processes sharing one Redis (DESIGN §5, §13).

    The process that receives `POST /admin/weights` takes `rg:weights:lock`, announces `pausing`, drives the
    update, records the result in `rg:weights` and announces `serving`; the others stop dispatching while it
    works and adopt the new version when it is done.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, origin: str) -> None:
        self.client = client
        self.keys = keys
        self.origin = origin

    async def acquire(self, token: str, ttl_s: float) -> bool:
        result = await _call(self.client.set(self.keys.weights_lock, token, nx=True, px=int(ttl_s * 1000)), "lock")
        return bool(result)

    async def release(self, token: str) -> None:
        await _call(self.client.eval(_RELEASE_LOCK, 1, self.keys.weights_lock, token), "unlock")

    async def read(self) -> WeightsRecord | None:
        found = await _call(self.client.hgetall(self.keys.weights), "read weights")
        raw = {_text(k): _text(v) for k, v in found.items()}
        if "version" not in raw:
            return None
        return WeightsRecord(int(raw["version"]), raw.get("state", "serving"), raw.get("source") or None)

    async def record(self, version: int, state: str, source: str | None) -> None:
        mapping = {"version": version, "state": state, "source": source or "", "updated_at": time.time()}
        await _call(self.client.hset(self.keys.weights, mapping=mapping), "record weights")  # type: ignore[arg-type]

    async def announce(self, event: dict[str, Any]) -> None:
        payload = orjson.dumps(event | {"origin": self.origin})
        await _call(self.client.publish(self.keys.control, payload), "publish control event")

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Control events from the other processes, forever; reconnects after a Redis outage."""
        delay = 0.1
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.control)
                delay = 0.1
                while True:
                    message = await pubsub.get_message(timeout=30.0)
                    if message is None or message.get("type") != "message":
                        continue
                    event: dict[str, Any] = orjson.loads(message["data"])
                    if event.get("origin") != self.origin:
                        yield event
            except (RedisError, OSError) as exc:
                logger.warning("control channel lost (%s); resubscribing in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]


# ----------------------------------------------------------------------------------------------------------------
# Trajectory store: sessions, samples, the trajectories stream (DESIGN §3, §8, §10)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Lua:
    """A server-side script: run by SHA, sent in full only when the server does not know it (e.g. after restart)."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# One atomic write per sample on the session's slot. A script rather than MULTI or WATCH: the write must be
# refused when the session is no longer active (a finished trajectory never changes after delivery) and
# `sample_count` must only grow; MULTI cannot branch on what it reads, and WATCH costs a read round trip plus
# retries under contention, while the script does read, check and write in one round trip.
# Every write bumps the meta's `revision` and answers it (an integer; a refusal answers the status, a string).
# A write either replaces the sample (kept = 0) or keeps its first `kept` chunks (gateway/trajectory.py), which
# it expects to end where `ends` says (`Sample.to_redis_extending`), and sets chunk `kept` and the fields it sends
# (the conversation and tools stay as stored when it sends none); if the stored chunks are not those, it writes
# nothing and answers 'rewrite' (the caller then sends the whole sample).
# A write that names its `writer` (the turn writing) replaces only what that writer or its `base` (the writer of
# what it extends; "" for a new sample) wrote last: a sample another turn wrote meanwhile (another process serving
# the same session) is left as it is, and the answer is 'taken N' with N the session's first free index.
# KEYS: meta, sample. ARGV: index + 1, now, replica ("" keeps the recorded one), TTL, kept, ends, writer, base,
# field, value, ...
_SAVE_SAMPLE = _Lua(
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status ~= 'active' then return status end
if ARGV[7] ~= '' then
    local last = redis.call('HGET', KEYS[2], 'writer') or ''
    if last ~= ARGV[7] and last ~= ARGV[8] then
        return 'taken ' .. (redis.call('HGET', KEYS[1], 'sample_count') or '0')
    end
end
local kept = tonumber(ARGV[5])
if kept == 0 then
    redis.call('DEL', KEYS[2])
else
    local stored = redis.call('HGET', KEYS[2], 'chunk_ends')
    local ends = ARGV[6]
    if not stored or (stored ~= ends and string.sub(stored, 1, #ends + 1) ~= ends .. ',') then return 'rewrite' end
    local _, commas = string.gsub(stored, ',', '')
    for chunk = kept + 1, commas do
        for _, name in ipairs({CHUNKED_NAMES}) do redis.call('HDEL', KEYS[2], name .. '.' .. chunk) end
    end
end
redis.call('HSET', KEYS[2], unpack(ARGV, 9))
redis.call('EXPIRE', KEYS[2], ARGV[4])
if tonumber(ARGV[1]) > tonumber(redis.call('HGET', KEYS[1], 'sample_count') or '0') then
    redis.call('HSET', KEYS[1], 'sample_count', ARGV[1])
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'replica', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return redis.call('HINCRBY', KEYS[1], 'revision', 1)
""".replace("CHUNKED_NAMES", ", ".join(f"'{name}'" for name in CHUNKED))
)

# Activity on an active session without a sample write (a new turn begins). Never creates a meta.
# KEYS: meta. ARGV: now, TTL.
_TOUCH = _Lua(
    """
if redis.call('HGET', KEYS[1], 'status') ~= 'active' then return 0 end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

# Step (4) of finish: HSETNX `stream_id`, but only on an existing meta (a plain HSETNX on an expired or deleted
# meta would create a stub hash without TTL), and answer the id now stored, i.e. the winner. Re-running it
# after a lost reply answers the same winner, so the client's own retries are harmless.
# KEYS: meta. ARGV: the entry id just added.
_CLAIM_STREAM_ID = _Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], 'stream_id', ARGV[1])
return redis.call('HGET', KEYS[1], 'stream_id')
"""
)

# A named session's creation, unless its meta exists: one script instead of a WATCHed read and transaction (three
# round trips). The answer is the existing meta (HGETALL, a flat list), which the caller reuses or refuses, or 0
# where this call created it.
# KEYS: meta. ARGV: TTL, field, value, ...
_CREATE_ABSENT = _Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 0
"""
)

# Step (2) of a finish that brings no metadata to merge, in one script on the session's slot (the general
# path's WATCHed read and transaction take three round trips): an active session becomes finished with its reward,
# and its meta and samples get TTL `ttl_s`; the answer is the meta as it now is (HGETALL, a flat list). Any other
# session is left as it is and answers its status ('missing', 'abandoned', 'finished'), for the general path. The
# sample keys are named from ARGV: they share the meta's hash tag, so they live on its slot.
# KEYS: meta. ARGV: now, TTL, reward ('' for none), the sample keys' prefix (the index follows).
_FINISH_ACTIVE = _Lua(
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status ~= 'active' then return status end
redis.call('HSET', KEYS[1], 'status', 'finished', 'reward', ARGV[3], 'finished_at', ARGV[1], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
for index = 0, tonumber(redis.call('HGET', KEYS[1], 'sample_count') or '0') - 1 do
    redis.call('EXPIRE', ARGV[4] .. index, ARGV[2])
end
return redis.call('HGETALL', KEYS[1])
"""
)

_MAX_WATCH_ATTEMPTS = 16  # optimistic transactions rerun on conflict; a session's meta is rarely contended
_MAX_SAMPLE_MOVES = 16  # a sample write finding its index taken moves to the first free one, and again if raced
_MOVES_KEPT = 10_000  # the moved samples remembered, so the later writes of their turns follow them
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0
_ABANDONED_MAXLEN = 100_000
_SESSION_ID_MAX_LEN = 256

_Writes = Callable[[Pipeline], None]
_Fields = dict[bytes | str, bytes | str]  # a hash as redis-py returns it (bytes) or as we encode it


def _check_rewards(meta: SessionMeta, rewards: list[float] | None) -> None:
    if rewards is not None and len(rewards) != meta.sample_count:
        raise InvalidRequest(
            f"rewards has {len(rewards)} entries; session {meta.id} has {meta.sample_count} samples (one reward per "
            "sample, in index order)",
            param="rewards",
        )


def _backoff_s(attempt: int) -> float:
    """Exponential backoff with equal jitter: half the step fixed (progress), half random (no lockstep)."""
    step = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2.0**attempt)
    return step / 2 + random.uniform(0, step / 2)


def _as_stored(fields: dict[str, bytes | int | str]) -> _Fields:
    return {name: v if isinstance(v, bytes) else str(v).encode() for name, v in fields.items()}


def _check_session_id(session_id: str) -> str:
    # Braces would change the Redis Cluster hash tag `{id}` and split a session's keys across slots.
    if not 0 < len(session_id) <= _SESSION_ID_MAX_LEN or "{" in session_id or "}" in session_id:
        raise InvalidRequest(
            f"session id must be 1-{_SESSION_ID_MAX_LEN} characters without braces", param="session_id"
        )
    return session_id


def _optional_text(value: bytes | str | None) -> str | None:
    return None if value is None else _text(value)


@dataclass(slots=True)
class StoreStats:
    """Counters of this process's store (for metrics and for tests to wait on)."""

    writes_buffered: int = 0  # sample writes that went to the in-memory buffer (Redis unreachable)
    writes_flushed: int = 0  # buffered writes later written to Redis
    writes_refused: int = 0  # buffered writes Redis refused because the session had ended or expired (logged)
    finish_retries: int = 0  # finish attempts that failed on Redis and were retried
    duplicate_entries: int = 0  # stream entries that lost the `stream_id` arbitration and were deleted
    repaired: int = 0  # sessions delivered by `repair_undelivered`
    abandoned: int = 0  # sessions closed by `abandon_idle`
    samples_moved: int = 0  # sample writes that found their index taken by another turn, and moved (logged)


@dataclass(slots=True)
class _SampleWrite:
    """One sample write, kept until it reached Redis: the sample, and what its hash holds of it already (None: the
    write replaces the whole sample; so does every buffered write); the turn writing it and the writer of what it
    extends ("": not arbitrated, and a new sample, see `TrajectoryStore.save_sample`)."""

    session_id: str
    index: int
    sample: Sample
    replica: str
    at: float
    stored: StoredChunks | None = None
    writer: str = ""
    base: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.session_id, self.index

    @property
    def moves_key(self) -> tuple[str, int, str]:
        """What names this turn's sample in `TrajectoryStore._moved`."""
        return self.session_id, self.index, self.writer

    def encode(self) -> tuple[int, str, _Fields, StoredChunks]:
        """(chunks kept, where they end, the fields to set, what the hash holds after)."""
        if self.stored is not None:
            extending = self.sample.to_redis_extending(self.stored)
            if extending is not None:
                fields, after = extending
                kept, ends = len(self.stored.ends), self.stored.ends_field
                return kept, ends, self._with_writer(_as_stored(fields)), after
        whole, after = self.whole()
        return 0, "", whole, after

    def whole(self) -> tuple[_Fields, StoredChunks]:
        """The fields of the whole sample exactly as Redis stores and returns them (so a buffered copy decodes
        alike), and what the hash holds after."""
        fields, after = self.sample.to_redis_whole()
        return self._with_writer(_as_stored(fields)), after

    def _with_writer(self, fields: _Fields) -> _Fields:
        if self.writer:
            fields["writer"] = self.writer.encode()
        return fields


class TrajectoryStore:
    """Sessions, samples and finished trajectories in Redis, with the invariants of DESIGN §8 and §10.

    Invariants:

    - A session's keys share the hash tag `{id}`; multi-key writes of a session are one atomic script or one
      WATCHed MULTI on that slot. Every cross-slot step is idempotent and ordered so that a crash between any
      two steps leaves a state the sweepers (`repair_undelivered`, `abandon_idle`) complete.
    - A finished or abandoned session never changes again: sample writes to it are refused.
    - `finish` returns an entry id only once that entry is in `rg:trajectories` and recorded as the session's
      `stream_id`; however often and however concurrently it runs, exactly one entry is real and `rg:pending`
      counts it at most once (a crash or a lost connection at that INCR undercounts; see the module docstring).
    - No sample write is dropped in silence: while Redis is down it is buffered (latest version per sample),
      and when the buffer is full `save_sample` raises `StoreError`.

    The store does not own `client` (the caller closes it); the client must return bytes (the default
    `decode_responses=False`), since sample fields are binary. `start()` runs the flusher and the sweeper;
    `aclose()` stops them.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        ttl_s: int = 86_400,
        max_pending: int = 10_000,
        session_idle_ttl_s: int = 1_800,
        retry_budget_s: float = 30.0,
        max_buffered_writes: int = 10_000,
        sweep_interval_s: float | None = 30.0,
        repair_grace_s: float = 10.0,
        retry_after_s: float = 5.0,
    ) -> None:
        """`repair_grace_s`: the periodic sweeper leaves sessions finished more recently than this to their own
        finish; `retry_after_s`: the Retry-After of a backpressure 429; `sweep_interval_s=None`: no sweeper."""
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.session_idle_ttl_s = session_idle_ttl_s
        self.retry_budget_s = retry_budget_s
        self.max_buffered_writes = max_buffered_writes
        self.sweep_interval_s = sweep_interval_s
        self.repair_grace_s = repair_grace_s
        self.retry_after_s = retry_after_s
        self.stats = StoreStats()
        # The per-turn round trips (read a session, write a sample, create one) of concurrent turns share pipelines.
        self.batcher = PipelineBatcher(client)
        # Sample writes waiting for Redis, oldest first; a newer version of a sample replaces the older in place.
        self._buffer: dict[tuple[str, int], _SampleWrite] = {}
        # Samples whose index another process's turn took first: (session, index, writer) -> where they went.
        self._moved: OrderedDict[tuple[str, int, str], int] = OrderedDict()
        self._outage = False  # the last write failed: buffer new writes at once instead of waiting on retries
        self._wake = asyncio.Event()
        # One lock per session serialises its sample writes (direct and flushed), so an older version can never
        # land after a newer one. Weak values: a lock lives only while someone holds or awaits it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Hard references to background tasks: the event loop keeps only weak ones.
        self._finishing: dict[str, asyncio.Task[str]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(
        cls, client: aioredis.Redis, store: StoreConfig, redis: RedisConfig, **options: Any
    ) -> TrajectoryStore:
        return cls(
            client,
            Keys(store.prefix),
            ttl_s=store.ttl_s,
            max_pending=store.max_pending,
            session_idle_ttl_s=store.session_idle_ttl_s,
            retry_budget_s=redis.retry_budget_s,
            **options,
        )

    @property
    def buffered(self) -> int:
        """Sample writes waiting in memory for Redis."""
        return len(self._buffer)

    @property
    def _active_ttl_s(self) -> int:
        return self.session_idle_ttl_s + self.ttl_s

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the buffered-write flusher and, unless `sweep_interval_s` is None, the periodic sweeper."""
        if self._flusher is None:
            self._flusher = self._background(self._flush_forever(), "trajectory-store-flusher")
        if self._sweeper is None and self.sweep_interval_s is not None:
            self._sweeper = self._background(self._sweep_forever(self.sweep_interval_s), "trajectory-store-sweeper")

    async def aclose(self, drain_timeout_s: float = 5.0) -> None:
        """Staged stop: the sweeper; in-flight finishes get `drain_timeout_s`; buffered writes get one last flush
        bounded by `drain_timeout_s`. Writes that still could not be written are logged as lost, by count."""
        await self._cancel(self._sweeper)
        self._sweeper = None
        if self._finishing:
            _, late = await asyncio.wait(list(self._finishing.values()), timeout=drain_timeout_s)
            for task in late:
                task.cancel()
        await self._cancel(self._flusher)
        self._flusher = None
        if self._buffer:
            try:
                await asyncio.wait_for(self._flush_buffered(), drain_timeout_s)
            except (StoreError, TimeoutError) as exc:
                logger.error("closing with %d sample writes Redis never took; they are lost: %s", self.buffered, exc)
        await self.batcher.aclose()

    def _background(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(_log_crash)
        return task

    @staticmethod
    async def _cancel(task: asyncio.Task[None] | None) -> None:
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # unlike `await task`, a cancellation of aclose itself still propagates

    # -- sessions -------------------------------------------------------------------------------------------

    async def create_session(
        self,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
        *,
        fresh: bool = False,
        absent: bool = False,
    ) -> SessionMeta:
        """A new active session (a fresh uuid unless `session_id` is given).

        An existing active session of that id is returned as is (and counts as activity); a finished or
        abandoned one is a `Conflict`. Only a new session is subject to backpressure: `Overloaded` while
        `rg:pending` ≥ `max_pending`. Concurrent creations of one id yield one session (WATCH).

        `fresh`: the caller has just made `session_id` up from random bits, so no one else can know it; the session is
        written without looking for an existing one (two round trips instead of six). A generated id is fresh.
        `absent`: the caller has just found no session `session_id` (`touch_session`), so that read is not
        repeated; a creation of the same id meanwhile is still caught, as for any other.
        """
        if session_id is None or fresh:
            return await self._create_fresh(metadata, uuid.uuid4().hex if session_id is None else session_id)
        session_id = _check_session_id(session_id)
        if not absent:
            existing = await self.touch_session(session_id)
            if existing is not None:
                return existing
        await self._check_backpressure()
        now = time.time()
        meta = SessionMeta(id=session_id, metadata=dict(metadata or {}), created_at=now, updated_at=now)
        before = await self._create_absent(meta)
        return meta if before is None else await self._reuse(before)

    async def _create_fresh(self, metadata: dict[str, Any] | None, session_id: str) -> SessionMeta:
        """Write a session whose id nobody else knows: backpressure, then index and meta in one round trip."""
        await self._check_backpressure()
        now = time.time()
        meta = SessionMeta(id=session_id, metadata=dict(metadata or {}), created_at=now, updated_at=now)
        key = self.keys.meta(session_id)
        meta_fields = meta.to_redis()

        def build(pipe: Pipeline) -> None:
            # In order on one connection, not a transaction (the index and the meta live in different slots of a
            # cluster): index first, data second, as `create_session` does.
            pipe.zadd(self.keys.active_sessions, {session_id: now}, nx=True)
            pipe.hset(key, mapping=meta_fields)  # type: ignore[arg-type]
            pipe.expire(key, self._active_ttl_s)

        await self._batched(build, "create session")
        return meta

    async def ensure_session(self, session_id: str, metadata: dict[str, Any] | None = None) -> SessionMeta:
        """The session named by a client (header or body), created on first use; see `create_session`."""
        return await self.create_session(metadata, session_id)

    async def touch_session(self, session_id: str) -> SessionMeta | None:
        """An active session's meta, with activity recorded (one round trip: every turn of a session starts here);
        None if there is no such session. A finished or abandoned one is a `Conflict`."""
        meta = await self._read_and_touch(_check_session_id(session_id))
        if meta is not None and meta.status != "active":
            raise Conflict(f"session {meta.id} is {meta.status}", param="session_id")
        return meta

    async def add_metadata(self, session_id: str, metadata: Mapping[str, str]) -> SessionMeta:
        """Add to an active session's metadata the keys of `metadata` it does not hold (`metadata_additions`: a key
        it holds with another value is `InvalidRequest`, and nothing is written). Returns the meta as it is then.
        Unknown session: `SessionNotFound`; finished or abandoned: `Conflict`."""
        result: list[SessionMeta] = []

        def plan(before: SessionMeta | None) -> _Writes | None:
            if before is None:
                raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
            if before.status != "active":
                raise Conflict(f"session {session_id} is {before.status}", param="session_id")
            added = metadata_additions(before.metadata, metadata, session_id)
            after = dataclasses.replace(before, metadata=before.metadata | added)
            result.append(after)
            if not added:
                return None
            key, value = self.keys.meta(session_id), orjson.dumps(after.metadata)

            def writes(pipe: Pipeline) -> None:
                pipe.hset(key, "metadata", value)

            return writes

        await self._transact(_check_session_id(session_id), plan, "add session metadata")
        return result[-1]

    async def get_session(self, session_id: str) -> SessionMeta | None:
        raw = await _call(self.client.hgetall(self.keys.meta(session_id)), "read session")
        return SessionMeta.from_redis(session_id, raw) if raw else None

    async def pending(self) -> int:
        """Finished sessions delivered to the stream and not yet acknowledged by a trainer."""
        key = self.keys.pending

        def build(pipe: Pipeline) -> None:
            pipe.get(key)

        (value,) = await self._batched(build, "read pending")  # every new session asks
        return int(value) if value is not None else 0

    async def _batched(self, build: Build, what: str) -> list[Any]:
        """The replies to `build`'s commands, sent with the other turns' (`PipelineBatcher`); a transport failure
        or a command's error is a `StoreError`."""
        replies = await _call(self.batcher.execute(build), what)
        for reply in replies:
            if isinstance(reply, Exception):
                raise StoreError(f"redis: {what} failed: {reply}") from reply
        return replies

    async def _read_and_touch(self, session_id: str) -> SessionMeta | None:
        """The session's meta as it was, and activity recorded if it is active, in one round trip (every turn of a
        session starts here). The activity score is raised only for ids still indexed as active (XX) and never
        lowered (GT), as `save_sample` does."""
        key, now = self.keys.meta(session_id), time.time()
        touch_args = (_TOUCH.sha, 1, key, now, self._active_ttl_s)
        try:

            def build(pipe: Pipeline) -> None:
                pipe.hgetall(key)
                pipe.evalsha(*touch_args)
                pipe.zadd(self.keys.active_sessions, {session_id: now}, xx=True, gt=True)

            raw, touched, indexed = await self.batcher.execute(build)
            if isinstance(touched, NoScriptError):  # a restarted server forgot the script
                touched = await self.client.eval(_TOUCH.source, 1, key, now, self._active_ttl_s)
            for result in (raw, touched, indexed):
                if isinstance(result, Exception):
                    raise result
        except RedisError as exc:
            raise StoreError(f"redis: read session failed: {exc}") from exc
        return SessionMeta.from_redis(session_id, raw) if raw else None

    async def _reuse(self, meta: SessionMeta) -> SessionMeta:
        if meta.status != "active":
            raise Conflict(f"session {meta.id} is {meta.status}", param="session_id")
        now = time.time()
        touched = await self._eval(_TOUCH, [self.keys.meta(meta.id)], [now, self._active_ttl_s], "touch session")
        if touched:
            await _call(self.client.zadd(self.keys.active_sessions, {meta.id: now}, xx=True, gt=True), "touch")
        return meta

    async def _check_backpressure(self) -> None:
        pending = await self.pending()
        if pending >= self.max_pending:
            raise Overloaded(
                f"{pending} finished trajectories wait for the trainer (store.max_pending={self.max_pending}); "
                "no new sessions until it catches up",
                retry_after_s=self.retry_after_s,
            )

    async def _create_absent(self, meta: SessionMeta) -> SessionMeta | None:
        """Index the session, then write its meta unless one exists, in one batched pipeline (in that order: a crash
        in between leaves an id without meta, which the idle sweeper drops). The meta that existed, or None where
        this call created it; concurrent creations of one id create it once."""
        fields = [part for name_value in meta.to_redis().items() for part in name_value]

        def build(pipe: Pipeline) -> None:
            pipe.zadd(self.keys.active_sessions, {meta.id: meta.created_at}, nx=True)
            pipe.eval(_CREATE_ABSENT.source, 1, self.keys.meta(meta.id), self._active_ttl_s, *fields)

        _, existing = await self._batched(build, "create session")
        if isinstance(existing, list):
            return _meta_of(meta.id, existing)
        return None

    # -- samples --------------------------------------------------------------------------------------------

    async def save_sample(
        self,
        session_id: str,
        index: int,
        sample: Sample,
        *,
        replica: str | None = None,
        stored: StoredChunks | None = None,
        writer: str | None = None,
        base: str | None = None,
    ) -> SampleSaved | None:
        """Write (replace) sample `index` of an active session; `sample_count` becomes at least `index + 1`.
        Returns what the write made (`SampleSaved`), or None when the write waits in the buffer.

        `stored`: what the sample's hash holds of this sample already (what the last write of it answered), so
        only what came after it is sent; should the hash hold anything else, the whole sample is written instead.

        `writer` (the id of the turn writing; every write of one turn names the same) and `base` (the writer of
        the sample this turn extends, as last read or written; None for a new sample) arbitrate between processes
        serving one session at once (DESIGN §13): the write replaces what `writer` or `base` wrote last, and
        nothing else. If another turn wrote the sample meanwhile, both are kept: this turn's sample moves, whole,
        to the session's first free index, where the turn's later writes follow it (`SampleSaved.index`). A
        write without `writer` replaces whatever is stored.

        If Redis is unreachable (after the client's own retries) the write is buffered and this returns: the
        flusher, and `finish` of the session, write it later; a newer version of the same sample replaces the
        buffered one. With `max_buffered_writes` writes already waiting, a write of another sample raises
        `StoreError` (the request fails loudly; nothing is dropped). A finished or abandoned session is a
        `Conflict`, an unknown one `SessionNotFound`.
        """
        if index < 0:
            raise InvalidRequest(f"sample index must be >= 0, got {index}", param="index")
        write = _SampleWrite(session_id, index, sample, replica or "", time.time(), stored, writer or "", base or "")
        if self._replace_buffered(write):
            return None
        async with self._session_lock(session_id):
            if self._replace_buffered(write):
                return None
            if self._outage and self._flusher is not None:  # Redis is known down: no need to wait on retries
                self._buffer_write(write)
                return None
            try:
                verdict = await self._write_sample(write)
            except StoreError as exc:
                logger.warning(
                    "session=%s sample=%d: buffering the write, redis unavailable: %s", session_id, index, exc
                )
                self._outage = True
                self._buffer_write(write)
                return None
            self._outage = False
        if isinstance(verdict, SampleSaved):
            return verdict
        if verdict == "missing":
            raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
        raise Conflict(f"session {session_id} is {verdict}; its samples can no longer change", param="session_id")

    async def load_samples(self, session_id: str) -> list[Sample]:
        """The session's samples in index order (gaps skipped), including writes still buffered here."""
        meta = await self.get_session(session_id)
        count = meta.sample_count if meta is not None else 0
        found: dict[int, _Fields] = {}
        if count:
            async with self.client.pipeline(transaction=False) as pipe:
                for index in range(count):
                    pipe.hgetall(self.keys.sample(session_id, index))
                rows = await _call(pipe.execute(), "read samples")
            found = {index: row for index, row in enumerate(rows) if row}
        found |= {
            self._moved.get(w.moves_key, w.index): w.whole()[0]
            for w in self._buffer.values()
            if w.session_id == session_id
        }
        return [Sample.from_redis(found[index]) for index in sorted(found)]

    def _session_lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    def _replace_buffered(self, write: _SampleWrite) -> bool:
        """While a version of this sample waits in the buffer, a newer one takes its place (keeps order)."""
        waiting = self._buffer.get(write.key)
        if waiting is None:
            return False
        write.stored = None  # a buffered write replaces the whole sample
        if write.base == waiting.writer and write.writer != waiting.writer:
            write.base = waiting.base  # it extends the waiting write, which never reached Redis: extend its base
        self._buffer[write.key] = write
        self.stats.writes_buffered += 1
        return True

    def _buffer_write(self, write: _SampleWrite) -> None:
        if len(self._buffer) >= self.max_buffered_writes:
            raise StoreError(
                f"redis unavailable and {len(self._buffer)} sample writes already buffered "
                f"(max_buffered_writes); refusing sample {write.index} of session {write.session_id} "
                "rather than dropping a write"
            )
        write.stored = None
        self._buffer[write.key] = write
        self.stats.writes_buffered += 1
        self._wake.set()

    async def _write_sample(self, write: _SampleWrite) -> SampleSaved | str:
        """Write the sample where its turn's writes go; the script's verdict: what the write made, or the status
        that refused it. A sample another turn took meanwhile moves to the first free index, whole."""
        for _ in range(_MAX_SAMPLE_MOVES):
            index = self._moved.get(write.moves_key, write.index)
            if index != write.index:  # what the turn extends is not stored there: the sample goes whole
                write.stored = None
            # At the index it moved to, the turn's own write is the only one it may replace.
            verdict = await self._write_sample_at(write, index, write.base if index == write.index else "")
            if isinstance(verdict, SampleSaved) or not verdict.startswith("taken "):
                return verdict
            free = int(verdict.split()[1])
            logger.warning(
                "session=%s sample=%d: written meanwhile by another turn (another process); this turn's sample "
                "goes to index %d, whole, and both are kept",
                write.session_id,
                index,
                free,
            )
            self.stats.samples_moved += 1
            self._moved[write.moves_key] = free
            self._moved.move_to_end(write.moves_key)
            while len(self._moved) > _MOVES_KEPT:
                self._moved.popitem(last=False)
        raise StoreError(
            f"session {write.session_id}: sample {write.index} found its index taken {_MAX_SAMPLE_MOVES} times"
        )

    async def _write_sample_at(self, write: _SampleWrite, index: int, base: str) -> SampleSaved | str:
        """The sample script and the activity score, pipelined in one round trip. A write that extends what the
        hash no longer holds is sent again, whole."""
        keys = [self.keys.meta(write.session_id), self.keys.sample(write.session_id, index)]
        kept, ends, fields, after = write.encode()
        args: list[bytes | str | int | float] = [
            index + 1,
            write.at,
            write.replica,
            self._active_ttl_s,
            kept,
            ends,
            write.writer,
            base,
        ]
        for name, value in fields.items():
            args += [name, value]
        try:

            def build(pipe: Pipeline) -> None:
                pipe.evalsha(_SAVE_SAMPLE.sha, len(keys), *keys, *args)
                # XX: only sessions still indexed as active; GT: a late write never moves the score back.
                pipe.zadd(self.keys.active_sessions, {write.session_id: write.at}, xx=True, gt=True)

            verdict, _ = await self.batcher.execute(build)
            if isinstance(verdict, NoScriptError):  # a restarted server forgot the script
                verdict = await self.client.eval(_SAVE_SAMPLE.source, len(keys), *keys, *args)
            if isinstance(verdict, Exception):
                raise verdict
        except RedisError as exc:
            raise StoreError(f"redis: save sample failed: {exc}") from exc
        if isinstance(verdict, int):
            return SampleSaved(verdict, after, index)
        if _text(verdict) == "rewrite" and kept:
            logger.info(
                "session=%s sample=%d: not stored as the writer believed; writing it whole", write.session_id, index
            )
            write.stored = None
            return await self._write_sample_at(write, index, base)
        return _text(verdict)

    # -- the buffered-write flusher -------------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        attempt = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                try:
                    await self._flush_buffered()
                    attempt = 0
                except StoreError as exc:
                    attempt += 1
                    delay = _backoff_s(attempt)
                    logger.warning(
                        "%d buffered sample writes; redis still down (%s); retry in %.2fs", self.buffered, exc, delay
                    )
                    await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    async def _flush_buffered(self, session_id: str | None = None) -> None:
        """Write buffered samples (of one session, or all), oldest first. Raises `StoreError` at the first failure."""
        for key in [k for k in self._buffer if session_id is None or k[0] == session_id]:
            async with self._session_lock(key[0]):
                write = self._buffer.get(key)
                if write is None:
                    continue
                verdict = await self._write_sample(write)
                self._outage = False
                if self._buffer.get(key) is write:  # else a newer version arrived meanwhile: it goes next round
                    del self._buffer[key]
            self.stats.writes_flushed += 1
            if not isinstance(verdict, SampleSaved):
                self.stats.writes_refused += 1
                logger.error(
                    "session=%s sample=%d: buffered write refused, session %s", write.session_id, write.index, verdict
                )

    # -- finish ---------------------------------------------------------------------------------------------

    async def finish(
        self,
        session_id: str,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        rewards: list[float] | None = None,
    ) -> str:
        """Finish the session and return its entry id in `rg:trajectories` (see the module docstring's steps).
        `reward` is the session's; `rewards`, if given, one per sample (`SessionMeta.rewards`): a count other than
        the session's samples is `InvalidRequest`, and the session stays active.

        Idempotent: a finished session returns its existing entry id; concurrent calls in this process share
        one run (the first call's reward and metadata win), and across processes the WATCHed transaction and
        the `stream_id` claim keep exactly one real entry. The run is shielded: a cancelled caller does not stop
        it. Redis failures are retried with backoff for `retry_budget_s`, then `StoreError`; a returned id is
        durable. Unknown session: `SessionNotFound`; abandoned: `Conflict`.
        """
        task = self._finishing.get(session_id)
        if task is None:
            task = asyncio.ensure_future(self._finish_with_retries(session_id, reward, metadata, rewards))
            task.set_name(f"finish-{session_id}")
            self._finishing[session_id] = task
            task.add_done_callback(functools.partial(self._finish_done, session_id))
        return await asyncio.shield(task)

    def _finish_done(self, session_id: str, task: asyncio.Task[str]) -> None:
        if self._finishing.get(session_id) is task:
            del self._finishing[session_id]
        # Retrieved here because every caller may have left; errors of ours reached whoever still waited.
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not isinstance(exc, GatewayError):
            logger.error("session=%s: finish crashed", session_id, exc_info=exc)

    async def _finish_with_retries(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None
    ) -> str:
        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            try:
                return await self._finish_once(session_id, reward, metadata, rewards)
            except StoreError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreError(
                        f"session {session_id}: not finished, redis unavailable for the whole retry budget "
                        f"({self.retry_budget_s:g}s): {exc}"
                    ) from exc
                attempt += 1
                self.stats.finish_retries += 1
                delay = min(remaining, _backoff_s(attempt))
                logger.warning("session=%s: finish failed (%s); retry %d in %.2fs", session_id, exc, attempt, delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    async def _finish_once(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None
    ) -> str:
        await self._flush_buffered(session_id)  # (1) what the trainer gets includes every buffered write
        if not metadata and rewards is None:  # nothing to merge: (1) and (2) in one round trip, shared with others
            finished = await self._finish_active(session_id, reward)
            if finished is not None:
                return await self._deliver(finished)
        meta = await self.get_session(session_id)
        if meta is None:
            raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
        if meta.status == "abandoned":
            raise Conflict(f"session {session_id} was abandoned (idle); it cannot be finished", param="session_id")
        if meta.stream_id is not None:  # delivered before: make sure the repair set forgets it, answer the same id
            await _call(self.client.srem(self.keys.undelivered, session_id), "confirm delivery")
            return meta.stream_id
        if meta.status == "active":
            _check_rewards(meta, rewards)  # before the session is registered for repair: a refusal leaves no trace
        # Registered for repair BEFORE the status changes, so no crash can leave a finished, undelivered session
        # that nothing will deliver.
        await _call(self.client.sadd(self.keys.undelivered, session_id), "register finish")
        try:
            meta = await self._mark_finished(session_id, reward, metadata, rewards)  # (2)
        except InvalidRequest:  # rewards that a sample written meanwhile made too few: still active, not finished
            await _call(self.client.srem(self.keys.undelivered, session_id), "forget undelivered")
            raise
        await _call(self.client.zrem(self.keys.active_sessions, session_id), "unindex session")
        return await self._deliver(meta)  # (3)-(5)

    async def _finish_active(self, session_id: str, reward: float | None) -> SessionMeta | None:
        """Steps (1) and (2) and the unindexing of an active session, in one batched pipeline, in the order of the
        general path (SADD before the status changes, ZREM after): the meta as finished, or None where the session
        was not active, which the general path then answers (not found, abandoned, finished before). Such an id
        is taken out of the repair set again unless it is finished and undelivered, as the general path leaves it."""
        now = time.time()
        args = (now, self.ttl_s, "" if reward is None else repr(reward), self.keys.sample(session_id, 0)[:-1])

        def build(pipe: Pipeline) -> None:
            pipe.sadd(self.keys.undelivered, session_id)
            pipe.eval(_FINISH_ACTIVE.source, 1, self.keys.meta(session_id), *args)
            pipe.zrem(self.keys.active_sessions, session_id)

        _, answer, _ = await self._batched(build, "finish session")
        if isinstance(answer, list):
            return _meta_of(session_id, answer)
        if _text(answer) != "finished":
            await _call(self.client.srem(self.keys.undelivered, session_id), "forget undelivered")
        return None

    async def _mark_finished(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None = None
    ) -> SessionMeta:
        """Step (2): the session-slot transaction. Returns the meta as finished (the first finish's, if any)."""
        now = time.time()
        result: list[SessionMeta] = []

        def plan(before: SessionMeta | None) -> _Writes | None:
            if before is None:
                raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
            if before.status == "abandoned":
                raise Conflict(f"session {session_id} was abandoned (idle); it cannot be finished", param="session_id")
            if before.status == "finished":
                result.append(before)
                return None
            merged = before.metadata | (metadata or {})
            if rewards is not None:
                _check_rewards(before, rewards)  # a sample written since the check above (another turn)
            after = dataclasses.replace(
                before,
                status="finished",
                reward=reward,
                rewards=rewards,
                metadata=merged,
                finished_at=now,
                updated_at=now,
            )
            result.append(after)
            return self._writes_closing(after, after.to_redis())

        await self._transact(session_id, plan, "finish session")
        return result[-1]

    def _writes_closing(self, meta: SessionMeta, fields: dict[str, bytes | int | float | str]) -> _Writes:
        """Closing a session: its meta fields, and TTL `ttl_s` on the meta and every sample."""
        meta_key = self.keys.meta(meta.id)
        sample_keys = [self.keys.sample(meta.id, index) for index in range(meta.sample_count)]

        def writes(pipe: Pipeline) -> None:
            pipe.hset(meta_key, mapping=fields)  # type: ignore[arg-type]
            for key in (meta_key, *sample_keys):
                pipe.expire(key, self.ttl_s)

        return writes

    async def _deliver(self, meta: SessionMeta) -> str:
        """Steps (3)-(5) for a finished session. Safe to run any number of times, concurrently."""
        entry_id = await self._append_entry(meta)
        return await self._claim_entry(meta.id, entry_id)

    async def _append_entry(self, meta: SessionMeta) -> str:
        """Step (3): XADD the session's summary. May leave a duplicate; `_claim_entry` arbitrates."""
        entry = {
            "session_id": meta.id,
            "group_id": meta.group_id or "",
            "reward": "" if meta.reward is None else repr(meta.reward),
            "samples": meta.sample_count,
        }

        def build(pipe: Pipeline) -> None:
            pipe.xadd(self.keys.trajectories, entry)  # type: ignore[arg-type]

        (entry_id,) = await self._batched(build, "append trajectory")  # with the other callers' commands
        return _text(entry_id)

    async def _claim_entry(self, session_id: str, entry_id: str) -> str:
        """Steps (4) and (5): the first entry id recorded as `stream_id` is the real one; it alone is counted."""

        def claim(pipe: Pipeline) -> None:  # the source, not the SHA: a batch cannot recover from NOSCRIPT alone
            pipe.eval(_CLAIM_STREAM_ID.source, 1, self.keys.meta(session_id), entry_id)

        (stored,) = await self._batched(claim, "claim stream entry")
        winner = _optional_text(stored)
        if winner is None:
            raise SessionNotFound(f"session {session_id} expired while being finished", param="session_id")
        if winner == entry_id:
            await self._count_pending()
        else:
            self.stats.duplicate_entries += 1
            with contextlib.suppress(StoreError):  # best effort: consumers skip entries other than `stream_id`
                await _call(self.client.xdel(self.keys.trajectories, entry_id), "delete duplicate entry")

        def build(pipe: Pipeline) -> None:
            pipe.srem(self.keys.undelivered, session_id)

        await self._batched(build, "confirm delivery")
        return winner

    async def _count_pending(self) -> None:
        """INCR `rg:pending` at most once, never raising: the delivery it counts is already done.

        Not through the client's retry policy: a resent INCR whose first reply was lost (Redis killed after
        applying it) counts one delivery twice, and an overcount never decays (the trainer DECRs once per real
        entry), so it would hold back new sessions for good. A lost INCR instead undercounts by one, which only
        loosens backpressure; it is logged.
        """
        pool = self.client.connection_pool
        try:
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # untyped in redis-py
        except RedisError as exc:
            logger.warning(
                "%s not incremented (redis unavailable: %s); backpressure undercounts by one", self.keys.pending, exc
            )
            return
        try:
            await conn.send_command("INCR", self.keys.pending)
            await conn.read_response()
        except RedisError as exc:
            await conn.disconnect()
            logger.warning("%s may not be incremented (%s); backpressure may undercount by one", self.keys.pending, exc)
        except BaseException:
            await conn.disconnect()  # interrupted mid-command: the connection's state is unknown
            raise
        finally:
            await pool.release(conn)

    # -- sweepers -------------------------------------------------------------------------------------------

    async def repair_undelivered(self, older_than_s: float = 0.0) -> int:
        """Deliver sessions finished but not confirmed in the stream (a finish that crashed or gave up midway).

        Sessions finished less than `older_than_s` ago, and those finishing in this process, are left to their
        own finish. Ids whose session is gone or abandoned leave the set; active ones (a finish that has not
        marked them yet) stay. Returns how many sessions this call confirmed in the stream.
        """
        members = await _call(self.client.smembers(self.keys.undelivered), "read undelivered")
        cutoff = time.time() - older_than_s
        delivered = 0
        for session_id in sorted(_text(m) for m in members):
            if session_id not in self._finishing and await self._repair_one(session_id, cutoff):
                delivered += 1
        self.stats.repaired += delivered
        return delivered

    async def _repair_one(self, session_id: str, cutoff: float) -> bool:
        meta = await self.get_session(session_id)
        if meta is None or meta.status == "abandoned":
            await _call(self.client.srem(self.keys.undelivered, session_id), "forget undelivered")
            return False
        if meta.status != "finished" or (meta.finished_at or 0.0) > cutoff:
            return False
        await _call(self.client.zrem(self.keys.active_sessions, session_id), "unindex session")
        if meta.stream_id is not None:
            await _call(self.client.srem(self.keys.undelivered, session_id), "confirm delivery")
        else:
            await self._deliver(meta)
        logger.info("session=%s: repaired an interrupted finish", session_id)
        return True

    async def abandon_idle(self, now: float | None = None, limit: int = 1_000) -> list[str]:
        """Close active sessions idle for more than `session_idle_ttl_s` as `abandoned`, recorded in
        `rg:abandoned` and never delivered to `rg:trajectories`. Idempotent; at most `limit` per call.

        The activity index may be stale; the meta's `updated_at` (checked inside the transaction) decides.
        Returns the sessions this call abandoned.
        """
        now = time.time() if now is None else now
        cutoff = now - self.session_idle_ttl_s
        found = await _call(
            self.client.zrangebyscore(self.keys.active_sessions, "-inf", cutoff, start=0, num=limit), "read idle"
        )
        ids = [_text(member) for member in found if isinstance(member, bytes | str)]
        closed = [session_id for session_id in ids if await self._abandon_one(session_id, cutoff, now)]
        self.stats.abandoned += len(closed)
        return closed

    async def _abandon_one(self, session_id: str, cutoff: float, now: float) -> bool:
        if session_id in self._finishing:
            return False
        outcome: list[SessionMeta | None] = []

        def plan(before: SessionMeta | None) -> _Writes | None:
            outcome.append(before)
            if before is None or before.status != "active" or before.updated_at > cutoff:
                return None
            return self._writes_closing(before, {"status": "abandoned", "abandoned_at": now})

        await self._transact(session_id, plan, "abandon session")
        before = outcome[-1]
        if before is not None and before.status == "active" and before.updated_at > cutoff:  # active after all
            await _call(self.client.zadd(self.keys.active_sessions, {session_id: before.updated_at}), "rescore")
            return False
        abandoned_now = before is not None and before.status == "active"
        # A session abandoned earlier but still indexed: an interrupted sweep; record it if that was not done.
        if before is not None and before.status != "finished" and (abandoned_now or not await self._recorded(before)):
            await self._record_abandoned(before)
        await _call(self.client.zrem(self.keys.active_sessions, session_id), "unindex session")
        return abandoned_now

    async def _recorded(self, meta: SessionMeta) -> bool:
        return bool(await _call(self.client.hexists(self.keys.meta(meta.id), "abandoned_id"), "read record"))

    async def _record_abandoned(self, meta: SessionMeta) -> None:
        # At least once: a crash between XADD and HSET records the session twice (a log, not a trajectory).
        entry = {"session_id": meta.id, "group_id": meta.group_id or "", "samples": meta.sample_count}
        entry_id = await _call(
            self.client.xadd(self.keys.abandoned, entry, maxlen=_ABANDONED_MAXLEN, approximate=True),  # type: ignore[arg-type]
            "record abandoned",
        )
        await _call(self.client.hset(self.keys.meta(meta.id), "abandoned_id", entry_id), "record abandoned")

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # a period, not synchronisation
            try:
                await self.repair_undelivered(older_than_s=self.repair_grace_s)
                await self.abandon_idle()
            except StoreError as exc:
                logger.warning("store sweep failed (%s); next in %gs", exc, interval_s)

    # -- Redis plumbing -------------------------------------------------------------------------------------

    async def _transact(
        self, session_id: str, plan: Callable[[SessionMeta | None], _Writes | None], what: str
    ) -> SessionMeta | None:
        """Optimistic transaction on the session's slot: WATCH the meta, read it, let `plan` decide the writes
        (None: none), MULTI/EXEC; rerun if the meta changed meanwhile. Returns the meta as `plan` last saw it."""
        key = self.keys.meta(session_id)
        for _ in range(_MAX_WATCH_ATTEMPTS):
            try:
                async with self.client.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    raw = await pipe.hgetall(key)
                    before = SessionMeta.from_redis(session_id, raw) if raw else None
                    writes = plan(before)
                    if writes is not None:
                        pipe.multi()  # type: ignore[no-untyped-call]
                        writes(pipe)
                        await pipe.execute()
                    return before
            except WatchError:
                continue  # the meta changed (or the connection dropped) while watched: decide again
            except RedisError as exc:
                raise StoreError(f"redis: {what} failed: {exc}") from exc
        raise StoreError(f"redis: {what}: the session changed under {_MAX_WATCH_ATTEMPTS} attempts in a row")

    async def _eval(self, lua: _Lua, keys: list[str], args: list[Any], what: str) -> Any:
        try:
            try:
                return await self.client.evalsha(lua.sha, len(keys), *keys, *args)
            except NoScriptError:  # a restarted server forgot the script; EVAL caches it again
                return await self.client.eval(lua.source, len(keys), *keys, *args)
        except RedisError as exc:
            raise StoreError(f"redis: {what} failed: {exc}") from exc


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("background task %s crashed", task.get_name(), exc_info=exc)


__all__ = [
    "Keys",
    "StoreStats",
    "TrajectoryStore",
    "WeightsBus",
    "WeightsRecord",
    "connect",
]


async def inspect_store(client: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """Counts for `rollout-gateway trajectories stats`: stream, pending, sessions, weights, consumer groups."""

    async def read() -> dict[str, Any]:
        async with client.pipeline(transaction=False) as pipe:
            pipe.xlen(keys.trajectories)
            pipe.get(keys.pending)
            pipe.zcard(keys.active_sessions)
            pipe.scard(keys.undelivered)
            pipe.xlen(keys.abandoned)
            pipe.hgetall(keys.weights)
            stream, pending, active, undelivered, abandoned, weights = await pipe.execute()
        groups: list[dict[str, Any]] = []
        if stream:
            for group in await client.xinfo_groups(keys.trajectories):
                groups.append({_text(k): _text(v) if isinstance(v, bytes) else v for k, v in group.items()})
        return {
            "stream_entries": stream,
            "pending": int(pending or 0),
            "active_sessions": active,
            "undelivered": undelivered,
            "abandoned": abandoned,
            "weights": {_text(k): _text(v) for k, v in weights.items()},
            "consumer_groups": groups,
        }

    return await _call(read(), "inspect the store")


async def tail_trajectories(client: aioredis.Redis, keys: Keys, count: int) -> list[dict[str, Any]]:
    """The newest `count` entries of the trajectories stream, newest first, with their sessions' sample sizes."""

    async def read() -> list[dict[str, Any]]:
        entries = await client.xrevrange(keys.trajectories, count=count) or []
        out: list[dict[str, Any]] = []
        for entry_id, fields in entries:
            row: dict[str, Any] = {"entry_id": _text(entry_id or b"")}
            row |= {_text(k): _text(v) for k, v in (fields or {}).items()}
            found = await client.hgetall(keys.meta(str(row.get("session_id", ""))))
            meta = {_text(k): _text(v) for k, v in found.items()}
            row["status"] = meta.get("status", "expired")
            row["real"] = meta.get("stream_id", "") == row["entry_id"]
            out.append(row)
        return out

    return await _call(read(), "read the trajectories stream")
