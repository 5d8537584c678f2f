"""The weights bus: the weight version the pool serves (`rg:weights`), the update lock (`rg:weights:lock`) and the
control channel (`rg:control`) that let gateway processes sharing one Redis follow an update together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.store.keys import Keys, call, text

__all__ = ["WeightsBus", "WeightsRecord"]

logger = logging.getLogger(__name__)

# Compare-and-delete: release the lock only if we still own it (it may have expired and been taken). Answers 1
# where it released the lock, 0 where another process holds it (or nobody).
# KEYS: the lock. ARGV: our token.
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class WeightsRecord:
    version: int
    state: str
    source: str | None


class WeightsBus:
    """Coordinates weight updates between gateway processes sharing one Redis (docs/architecture.md §5, §13).

    The process that receives `POST /admin/weights` takes `rg:weights:lock`, announces `pausing`, drives the
    update, records the result in `rg:weights` and announces `serving`; the others stop dispatching while it
    works and adopt the new version when it is done.
    """

    def __init__(self, client: aioredis.Redis, keys: Keys, origin: str) -> None:
        self.client = client
        self.keys = keys
        self.origin = origin
        self._release_lock = client.register_script(_RELEASE_LOCK)

    async def acquire(self, token: str, ttl_s: float) -> bool:
        result = await call(self.client.set(self.keys.weights_lock, token, nx=True, px=int(ttl_s * 1000)), "lock")
        return bool(result)

    async def release(self, token: str) -> None:
        await call(self._release_lock(keys=[self.keys.weights_lock], args=[token]), "unlock")

    async def read(self) -> WeightsRecord | None:
        found = await call(self.client.hgetall(self.keys.weights), "read weights")
        raw = {text(k): text(v) for k, v in found.items()}
        if "version" not in raw:
            return None
        return WeightsRecord(int(raw["version"]), raw.get("state", "serving"), raw.get("source") or None)

    async def record(self, version: int, state: str, source: str | None) -> None:
        mapping = {"version": version, "state": state, "source": source or "", "updated_at": time.time()}
        await call(self.client.hset(self.keys.weights, mapping=mapping), "record weights")  # type: ignore[arg-type]

    async def join(self, ttl_s: float) -> None:
        """Say this process is on the bus for `ttl_s` more seconds (a heartbeat); forget members long expired."""
        now = time.time()
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.zadd(self.keys.weights_members, {self.origin: now + ttl_s})
            pipe.zremrangebyscore(self.keys.weights_members, "-inf", now - 3600)
            await call(pipe.execute(), "join the weights bus")

    async def leave(self) -> None:
        await call(self.client.zrem(self.keys.weights_members, self.origin), "leave the weights bus")

    async def members(self) -> set[str]:
        """The other processes on the bus whose heartbeat has not expired."""
        found = await call(self.client.zrangebyscore(self.keys.weights_members, time.time(), "+inf"), "bus members")
        return {text(m) for m in found if isinstance(m, bytes | str)} - {self.origin}

    async def report_drained(self, token: str, ttl_s: float) -> None:
        """Say this process's own requests are drained for the update `token`, and tell the coordinating one."""
        key = self.keys.weights_drained(token)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(key, self.origin)
            pipe.expire(key, max(1, int(ttl_s)))
            await call(pipe.execute(), "report drained")
        await self.announce({"event": "drained", "token": token})

    async def drained(self, token: str) -> set[str]:
        """The processes that drained their requests for the update `token`."""
        found = await call(self.client.smembers(self.keys.weights_drained(token)), "read drained")
        return {text(m) for m in found}

    async def announce(self, event: dict[str, Any]) -> None:
        payload = orjson.dumps(event | {"origin": self.origin})
        await call(self.client.publish(self.keys.control, payload), "publish control event")

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
