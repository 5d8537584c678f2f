"""Everything the gateway keeps in Redis. All keys are named here, and redis errors become `StoreError` here.

Keys (prefix configurable, default `rg:`). Every key of one session shares the hash tag `{id}`, so a
session's multi-key writes stay in one Redis Cluster slot; what crosses slots is idempotent (DESIGN §8):

- `rg:{id}:meta` (hash): `SessionMeta.to_redis()` — status, metadata JSON, reward, sample_count, timestamps,
  replica; plus `stream_id`, set (HSETNX) by whoever delivered the session to the trajectories stream first.
- `rg:{id}:sample:{n}` (hash): `Sample.to_redis()` — binary arrays (see gateway/trajectory.py).
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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway.errors import StoreError

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


def connect(url: str, socket_timeout_s: float = 5.0) -> aioredis.Redis:
    """One pooled client. Commands retry on connection loss (a Redis restart) with backoff."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


async def _call(awaitable: Awaitable[T], what: str) -> T:
    try:
        return await awaitable
    except RedisError as exc:
        raise StoreError(f"redis: {what} failed: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
