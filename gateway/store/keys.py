"""The Redis schema: every key the gateway uses, the one pooled client, and the boundary where redis errors
become `StoreError`.

Keys (prefix configurable, default `rg:`). Every key of one session shares the hash tag `{id}`, so a session's
multi-key writes stay in one Redis Cluster slot; what crosses slots is idempotent (docs/architecture.md §8):

- `rg:{id}:meta` (hash): `SessionMeta.to_redis()` — status, metadata JSON, reward, sample_count, timestamps,
  replica; plus `stream_id`, set (HSETNX) by whoever delivered the session to the trajectories stream first, and
  `revision`, counted up by every sample write (a process's copy of the samples is current while it matches).
- `rg:{id}:sample:{n}` (hash): `Sample.to_redis()` — binary arrays (see gateway/trajectory.py), in chunks, so
  that a write extending the sample adds what is new instead of rewriting it all; and `writer`, the turn that
  wrote it last, so that turns of one session on two processes at once never replace each other's (`save_sample`).
- `rg:response:{response id}` (string, JSON): what a Responses API answer leaves for a later request that names it
  (`previous_response_id`), and the answer itself (`GET /v1/responses/{id}`):
  `gateway.session.response_records`. Its own slot, looked up by the response id alone; written once, never changed.
  A one-turn session's response names the response it continues (`previous`), whose key holds the messages before.
- `rg:group:{group id}` (string, EX `GROUP_TTL_S`): the replica a GRPO group's members go to, set (`SET NX`) by the
  process that placed its first member (`gateway.routing.groups`, `GroupRecords`). Its own slot; never changed.
- `rg:trajectories` (stream): one entry per finished session: `session_id`, `group_id`, `reward`, `samples`.
  With `store.stream_partitions` n > 1, partitions 1..n-1 are `rg:trajectories:{p}` (`Keys.stream`), a session's
  partition chosen by its group id (else its id); `rg:trajectories:partitions` (string) holds n for consumers.
  A session may be XADDed twice after a crash; the entry whose id equals the meta's `stream_id` is the real
  one, the trainer acknowledges and skips any other (exactly-once delivery after ack).
- `rg:pending:sessions` (set): the finished sessions delivered but not yet acknowledged by a trainer (backpressure;
  SADD and SREM are idempotent, so a resent command counts nothing twice).
- `rg:acked` (counter): sessions trainers acknowledged (their entries' XACK removed them from a pending list).
- `rg:reclaimed` (counter): stream entries trainers took over from a consumer that left them idle (XAUTOCLAIM).
- `rg:sessions:active` (sorted set, score = last activity): for the idle sweeper (abandoned sessions).
- `rg:sessions:undelivered` (set): finished sessions not yet confirmed in the stream (for the repair sweeper).
- `rg:abandoned` (stream): sessions closed as abandoned — recorded, never delivered as trajectories.
- `rg:scoring` (sorted set, score = the scoring deadline): the finished sessions of a policy with a teacher that wait
  for its scores before delivery (`gateway.teacher`); `rg:{id}:scoring` (string, PX TTL) the lease of the process
  scoring one. A scored sample's hash gains `teacher_logprobs` (and `teacher_top_ids`, `teacher_top_logprobs`,
  `teacher_top_k`), its meta `scoring` (scored | unscored) and `teacher` (`model@version`).
- `rg:open:{key id}` (sorted set, score = when the session expires idle): the open sessions of one API key
  (`server.max_open_sessions_per_key`, `OpenSessions`); it expires once idle `session_idle_ttl_s`.
- `rg:{budget}:started` (counter): the sessions (samples, in the staleness budget's sense: one trajectory each)
  started, INCRBY'd atomically at admission by whichever process admits them, given back (DECRBY) for a session
  abandoned or dropped as stale (`gateway.weights.budget`).
- `rg:{budget}:batch` (hash): `<group>/<consumer>` → the batch size that trainer consumer takes per step, written by
  `TrajectoryConsumer` when it starts and at every ack, deleted when it closes; their sum is the batch size of the
  staleness budget (none: the budget is off). Both budget keys share the hash tag `{budget}`, one cluster slot.
- `rg:weights` (hash): `version`, `state`, `source`, `updated`, `stale` (JSON lists of replica ids), `updated_at` —
  the weight version the pool serves, as the update that made it announced it.
- `rg:weights:lock` (string, PX TTL): held by the one gateway process that coordinates an update; its token is
  `<process>.<uuid>`, so that a process whose heartbeat stopped can be told from a live holder (`WeightsBus.acquire`).
- `{rg:weights:lock}:update` (string, JSON, PX TTL): the `pausing` event of the update that holds the lock (version,
  mode, token), written and deleted with the lock by one script, so that a process that missed the event (started
  or resubscribed mid-update) follows the update as if it had heard it. Tagged with the lock's name: the lock's own
  slot (`Keys.weights_update`). Read only where its token is the lock's (an older gateway leaves the lock bare).
- `rg:weights:transfer` (string, JSON, PX TTL): the layout and state of the in-memory transfer under way or last
  ended, as its coordinating process shows it (`GET /admin/weights/{version}`), so that any process can answer that
  GET; written at its start, once every engine's side is open, and at its end; it expires 10 minutes after its
  commit deadline.
- `rg:weights:members` (sorted set): the gateway processes on the bus, each scored with the time its heartbeat
  expires; a `wait` update waits for every live one to drain its own requests (`rg:weights:drained:{token}`).
- `rg:weights:drained:{token}` (set, TTL): the processes that drained their requests for the update `token`.
- `rg:control` (pub/sub channel): JSON events that let the other gateway processes follow an update.
- `rg:dashboard` (stream, trimmed by MINID to the dashboard's window): each gateway process's per-second point
  (JSON, `gateway.dashboard.timeseries`), read back by every process to chart the whole cluster
  (`gateway.dashboard.sampler`).

Lifetimes: a session's keys live `session_idle_ttl_s + ttl_s` after its last write while it is active, and
`ttl_s` once it is finished or abandoned; a response key `session_idle_ttl_s + ttl_s` after it was written. The
global keys (the streams, both sets, the counters) have no TTL: the trainer trims `rg:trajectories` and
`rg:abandoned` is capped (approximate MAXLEN).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import StoreError
from gateway.store.cluster_client import connect_cluster

__all__ = ["Keys", "call", "connect", "optional_text", "text"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key the gateway uses, from one prefix."""

    prefix: str = "rg:"
    partitions: int = 1  # of the trajectory stream (`store.stream_partitions`)

    def meta(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:meta"

    def sample(self, session_id: str, index: int) -> str:
        return f"{self.prefix}{{{session_id}}}:sample:{index}"

    def response(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def group(self, group_id: str) -> str:
        return f"{self.prefix}group:{group_id}"

    @property
    def trajectories(self) -> str:
        """The trajectory stream's partition 0 (the whole stream when it has one)."""
        return f"{self.prefix}trajectories"

    def stream(self, partition: int) -> str:
        """Partition `partition` of the trajectory stream: 0 is `rg:trajectories`, p ≥ 1 `rg:trajectories:{p}`, a
        hash tag of its own, so that the partitions spread over a cluster's slots."""
        return self.trajectories if partition == 0 else f"{self.prefix}trajectories:{{{partition}}}"

    @property
    def streams(self) -> list[str]:
        return [self.stream(p) for p in range(self.partitions)]

    def partition_of(self, name: str) -> int:
        """The partition of a session's entry, from its group id (a group's members share one partition, so a
        consumer sees a group in one stream, in order) or, without a group, its session id."""
        return zlib.crc32(name.encode()) % self.partitions if self.partitions > 1 else 0

    def with_partitions(self, recorded: int | bytes | str | None) -> Keys:
        """These keys with the partition count `recorded` (a count, or the value of `stream_partitions`; None: 1)."""
        raw = recorded.decode() if isinstance(recorded, bytes) else str(recorded or "")
        partitions = int(raw) if raw.isdigit() and int(raw) > 0 else 1
        return self if partitions == self.partitions else dataclasses.replace(self, partitions=partitions)

    @property
    def stream_partitions(self) -> str:
        """String: how many partitions the gateway writes (consumers read it, so they read them all)."""
        return f"{self.prefix}trajectories:partitions"

    @property
    def pending(self) -> str:
        return f"{self.prefix}pending:sessions"

    @property
    def acked(self) -> str:
        return f"{self.prefix}acked"

    @property
    def reclaimed(self) -> str:
        return f"{self.prefix}reclaimed"

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
    def scoring(self) -> str:
        return f"{self.prefix}scoring"

    def scoring_lease(self, session_id: str) -> str:
        return f"{self.prefix}{{{session_id}}}:scoring"

    def open_sessions(self, key: str) -> str:
        """Sorted set: the open sessions of one API key (its key id, never the key), scored by when they expire
        idle (`OpenSessions`); it expires itself once idle that long."""
        return f"{self.prefix}open:{key}"

    @property
    def budget_started(self) -> str:
        return f"{self.prefix}{{budget}}:started"

    @property
    def budget_batch(self) -> str:
        return f"{self.prefix}{{budget}}:batch"

    @property
    def weights(self) -> str:
        return f"{self.prefix}weights"

    @property
    def weights_lock(self) -> str:
        return f"{self.prefix}weights:lock"

    @property
    def weights_update(self) -> str:
        """The lock's companion record (its update's `pausing`), in the lock's cluster slot: scripts write both."""
        lock = self.weights_lock
        start = lock.find("{")
        end = lock.find("}", start + 1) if start >= 0 else -1
        if end > start + 1:  # the prefix carries a hash tag already: the lock's slot is the tag's
            return f"{lock}:update"
        return f"{{{lock}}}:update"  # a key without a tag hashes whole: tagged with that whole name, the same slot

    @property
    def weights_transfer(self) -> str:
        return f"{self.prefix}weights:transfer"

    @property
    def weights_members(self) -> str:
        return f"{self.prefix}weights:members"

    def weights_drained(self, token: str) -> str:
        return f"{self.prefix}weights:drained:{token}"

    @property
    def control(self) -> str:
        return f"{self.prefix}control"

    @property
    def dashboard(self) -> str:
        return f"{self.prefix}dashboard"


def connect(url: str, socket_timeout_s: float = 5.0, max_connections: int = 512) -> aioredis.Redis:
    """One pooled client. Commands retry on connection loss (a Redis restart) with backoff (~2.5 s in all).

    The pool blocks (up to `socket_timeout_s`) for a free connection when all `max_connections` are busy: the
    default pool fails at once with "Too many connections", which under a burst of concurrent sessions turned
    ordinary turns into 503s.

    The asyncio client needs `redis.asyncio.retry.Retry`: given the sync `redis.retry.Retry`, its
    `call_with_retry` only returns the coroutine and every error escapes the retry loop (no retry at all).
    """
    if is_cluster_url(url):
        # The store speaks the commands both clients share (each key's slot is its session's hash tag).
        return cast(aioredis.Redis, connect_cluster(url, socket_timeout_s, max_connections))
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
    return aioredis.Redis.from_pool(pool)


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://host:port[,host:port...]`)."""
    return urlsplit(url).scheme in ("redis+cluster", "rediss+cluster")


REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)
"""What a Redis call may raise: redis-py's cluster client raises `RedisClusterException`, which is no `RedisError`,
when no node answers for a slot during a failover (`SlotNotCoveredError`, "cannot be connected")."""


async def call(awaitable: Awaitable[T], what: str) -> T:
    """`awaitable`'s result; a redis error becomes `StoreError` naming `what` failed."""
    try:
        return await awaitable
    except REDIS_ERRORS as exc:
        raise StoreError(f"redis: {what} failed: {exc}") from exc


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def optional_text(value: bytes | str | None) -> str | None:
    return None if value is None else text(value)
