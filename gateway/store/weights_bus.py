"""The weights bus: the weight version the pool serves (`rg:weights`), the update lock (`rg:weights:lock`) and the
control channel (`rg:control`) that let gateway processes sharing one Redis follow an update together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisClusterException, RedisError

from gateway.errors import StoreError
from gateway.store.cluster_client import FailoverAwareCluster
from gateway.store.core import backoff_s
from gateway.store.keys import Keys, call, text
from gateway.store.slot_clients import Durability, NotReplicated
from gateway.store.weights_events import Drained, Pausing, Serving, Subscribed, WeightsEvent, parse_event

__all__ = ["WeightsBus", "WeightsRecord"]

logger = logging.getLogger(__name__)

# The lock's companion record (`Keys.weights_update`, the lock's slot) goes with it: the `pausing` event of the update
# that holds it (ARGV[n], JSON), or nothing (an empty string: deleted). Both scripts below write it as they take the
# lock, so that no reader finds the lock of one update beside the record of another.
_WRITE_UPDATE = """
local function take(lock, update, token, ttl, pausing)
  redis.call('SET', lock, token, 'PX', ttl)
  if pausing == '' then redis.call('DEL', update) else redis.call('SET', update, pausing, 'PX', ttl) end
  return 1
end
"""

# Take the lock for `token`, or keep it where `token` holds it already: a client that resends the command after a
# lost reply (a failover, a dropped connection) must not find its own lock taken. Answers 1 where `token` holds it.
# KEYS: the lock, its record. ARGV: our token, the TTL in milliseconds, our `pausing` (or '').
_ACQUIRE_LOCK = (
    _WRITE_UPDATE
    + """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
return take(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
"""
)

# Take over the lock of a process that died holding it: only where `dead` holds it still (of two processes taking
# over, one wins), or where `token` holds it already (a resent command). Answers 1 where `token` holds it.
# KEYS: the lock, its record. ARGV: the dead holder's token, our token, the TTL in milliseconds, our `pausing` (or '').
_TAKE_OVER_LOCK = (
    _WRITE_UPDATE
    + """
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[2] and holder ~= ARGV[1] then return 0 end
return take(KEYS[1], KEYS[2], ARGV[2], ARGV[3], ARGV[4])
"""
)

# Compare-and-delete: release the lock (and its record) only if we still own it (it may have expired and been
# taken). Answers 1 where it released the lock, 0 where another process holds it (or nobody).
# KEYS: the lock, its record. ARGV: our token.
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class WeightsRecord:
    """`rg:weights`: the version the pool serves, where it was loaded from, and the replicas the update that made it
    left on it (`updated`) and held out (`stale`)."""

    version: int
    state: str
    source: str | None
    updated: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()

    def as_event(self) -> Serving:
        """The record as the `serving` event that announced it (for a process that missed the event)."""
        return Serving(self.version, self.source, updated=self.updated, stale=self.stale)


class WeightsBus:
    """Coordinates weight updates between gateway processes sharing one Redis (docs/architecture.md §5, §13).

    The process that receives `POST /admin/weights` takes `rg:weights:lock`, announces `pausing`, drives the
    update, records the result in `rg:weights` and announces `serving`; the others stop dispatching while it
    works and adopt the new version when it is done.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        origin: str,
        *,
        durability: Durability | None = None,
        retry_budget_s: float = 10.0,
    ) -> None:
        """`durability`: the replicas `record` waits for (none by default); `retry_budget_s`: how long `record` is
        retried while Redis is away or too few replicas acknowledge it."""
        self.client = client
        self.keys = keys
        self.origin = origin
        self.durability = durability or Durability(client)
        self.retry_budget_s = retry_budget_s
        lock_scripts = (_ACQUIRE_LOCK, _TAKE_OVER_LOCK, _RELEASE_LOCK)
        self._scripts = {source: client.register_script(source) for source in lock_scripts}

    def new_token(self) -> str:
        """A token for one update, naming this process as its holder (`holder_of`)."""
        return f"{self.origin}.{uuid.uuid4().hex}"

    @staticmethod
    def holder_of(token: str) -> str | None:
        """The process (`origin`) that holds, or held, the lock `token`; None for a token that names none (one of a
        gateway older than `new_token`)."""
        origin, dot, _ = token.partition(".")
        return origin if dot else None

    @property
    def _lock_keys(self) -> list[str]:
        return [self.keys.weights_lock, self.keys.weights_update]

    @staticmethod
    def _update_arg(update: Pausing | None) -> bytes:
        return orjson.dumps(update.to_wire()) if update is not None else b""

    async def acquire(self, token: str, ttl_s: float, grace_s: float = 10.0, update: Pausing | None = None) -> bool:
        """Take `rg:weights:lock` for `token` for `ttl_s`; False where another process holds it. `update`: the
        `pausing` event of the update the lock is taken for, kept beside it for the processes that miss the event
        (`update_under_way`). The lock of a process whose membership expired `grace_s` ago or more (`join`: it
        died, or has not reached Redis for that long) is taken over: it would otherwise refuse every update until its
        TTL."""
        args: list[str | int | bytes] = [token, max(1, int(ttl_s * 1000)), self._update_arg(update)]
        if await self._lock_script(_ACQUIRE_LOCK, args, "lock", taking=token):
            return True
        holder = await self.holder()
        if holder is None:  # released meanwhile
            return bool(await self._lock_script(_ACQUIRE_LOCK, args, "lock", taking=token))
        origin = self.holder_of(holder)
        if origin is None or await self.alive(origin, grace_s):
            return False
        if not await self.take_over(holder, token, ttl_s, update):
            return False
        logger.warning("weights: took over the update lock of process %s, whose heartbeat expired", holder)
        return True

    async def take_over(self, dead: str, token: str, ttl_s: float, update: Pausing | None = None) -> bool:
        """Replace the lock `dead` holds by `token` (for `ttl_s`, with `update` beside it as in `acquire`); False
        where `dead` no longer holds it."""
        args: list[str | int | bytes] = [dead, token, max(1, int(ttl_s * 1000)), self._update_arg(update)]
        return bool(await self._lock_script(_TAKE_OVER_LOCK, args, "take over the lock", taking=token))

    async def _lock_script(
        self, source: str, args: list[str | int | bytes], what: str, taking: str | None = None
    ) -> Any:
        """The answer of the lock script `source`. Where `redis.durable_replicas` asks for replicas it is acknowledged
        only once they have it (WAIT, as `record`): a lock taken, or let go, on a master that dies before its replica
        has it would come back from the failover otherwise, the update it belongs to gone from the others' view (they
        would dispatch while it runs), or a lock nobody holds refusing every update. A lock taken for `taking` that
        too few replicas acknowledge is let go again and `NotReplicated` raised: the update is a 503 the trainer
        retries."""
        keys = self._lock_keys
        if not self.durability.replicas:
            return await call(self._scripts[source](keys=keys, args=args), what)

        def run(pipe: Pipeline) -> None:
            pipe.eval(source, len(keys), *keys, *args)  # the text, not its digest: no NOSCRIPT to recover from

        try:
            (answer,) = await self.durability.write(keys[0], run, what)
        except NotReplicated:
            if taking is not None:
                with contextlib.suppress(StoreError):
                    await call(self._scripts[_RELEASE_LOCK](keys=keys, args=[taking]), "unlock")
            raise
        return answer

    async def holder(self) -> str | None:
        """The token that holds `rg:weights:lock` now; None where nobody does."""
        found = await call(self.client.get(self.keys.weights_lock), "read the lock")
        return None if found is None else text(found)

    async def update_under_way(self) -> Pausing | None:
        """The update that holds `rg:weights:lock` now, as the `pausing` event that announced it (None: nobody holds
        the lock). A lock without its record (taken by a gateway of an older release, or to record a result again)
        reads as an out-of-band pause, version unknown: followed to its end, not recovered from its holder's death
        (docs/architecture.md §5)."""
        # One slot (`Keys.weights_update`): one MGET reads both as they stand together.
        lock, update = await call(self.client.mget(self._lock_keys), "read the lock")
        if lock is None:
            return None
        token = text(lock)
        event = _pausing(update)
        if event is not None and event.token == token:
            return event
        return Pausing(None, "abort", token)

    async def alive(self, origin: str, grace_s: float = 0.0) -> bool:
        """Whether the process `origin` is on the bus: its last heartbeat (`join`) has not expired, or expired less
        than `grace_s` ago."""
        score = await call(self.client.zscore(self.keys.weights_members, origin), "bus member")
        return score is not None and float(score) > time.time() - grace_s

    async def release(self, token: str, budget_s: float = 10.0) -> None:
        """Release the lock `token` holds, retrying for `budget_s` while Redis is away (a failover takes seconds;
        a lock left behind would refuse every update until its TTL ends)."""
        deadline = time.monotonic() + budget_s
        attempt = 0
        while True:
            try:
                await self._lock_script(_RELEASE_LOCK, [token], "unlock")
                return
            except StoreError:
                attempt += 1
                if time.monotonic() + backoff_s(attempt) > deadline:
                    raise
                await asyncio.sleep(backoff_s(attempt))  # backoff between retries, not synchronisation

    async def read(self) -> WeightsRecord | None:
        found = await call(self.client.hgetall(self.keys.weights), "read weights")
        raw = {text(k): text(v) for k, v in found.items()}
        if "version" not in raw:
            return None
        return WeightsRecord(
            int(raw["version"]),
            raw.get("state", "serving"),
            raw.get("source") or None,
            tuple(orjson.loads(raw.get("updated") or "[]")),
            tuple(orjson.loads(raw.get("stale") or "[]")),
        )

    async def record(
        self,
        version: int,
        state: str,
        source: str | None,
        updated: list[str] | None = None,
        stale: list[str] | None = None,
    ) -> None:
        """Write `rg:weights`; it returns once the record is on the master and on the replicas
        `redis.durable_replicas` asks for (a failover that lost it would have other processes adopt, a recovery
        restore and the trainer judge staleness by an older version). Retried for `retry_budget_s`; then the last
        `StoreError` (`NotReplicated`: the record is on the master alone)."""
        mapping = {
            "version": version,
            "state": state,
            "source": source or "",
            "updated": orjson.dumps(updated or []),
            "stale": orjson.dumps(stale or []),
            "updated_at": time.time(),
        }

        def write(pipe: Pipeline) -> None:
            pipe.hset(self.keys.weights, mapping=mapping)  # type: ignore[arg-type]

        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            try:
                if self.durability.replicas:
                    await self.durability.write(self.keys.weights, write, "record weights")
                else:
                    await call(self.client.hset(self.keys.weights, mapping=mapping), "record weights")  # type: ignore[arg-type]
                return
            except StoreError as exc:
                attempt += 1
                delay = backoff_s(attempt)
                if time.monotonic() + delay > deadline:
                    raise
                logger.warning("weights: recording version %d failed (%s); retrying", version, exc)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    async def show_transfer(self, layout: dict[str, Any], ttl_s: float) -> None:
        """Show the in-memory transfer's `layout` (JSON) to the other processes for `ttl_s` seconds."""
        payload = orjson.dumps(layout)
        await call(self.client.set(self.keys.weights_transfer, payload, px=max(1, int(ttl_s * 1000))), "show transfer")

    async def shown_transfer(self) -> dict[str, Any] | None:
        """The layout of the transfer under way or last ended, as its coordinating process showed it (None: none)."""
        found = await call(self.client.get(self.keys.weights_transfer), "read transfer")
        if found is None:
            return None
        layout: dict[str, Any] = orjson.loads(found)
        return layout

    async def aclose(self) -> None:
        await self.durability.aclose()

    async def join(self, ttl_s: float) -> None:
        """Say this process is on the bus for `ttl_s` more seconds (a heartbeat); forget members long expired."""
        now = time.time()

        async def heartbeat() -> None:
            async with self.client.pipeline(transaction=False) as pipe:  # a cluster's may fail on entry already
                pipe.zadd(self.keys.weights_members, {self.origin: now + ttl_s})
                pipe.zremrangebyscore(self.keys.weights_members, "-inf", now - 3600)
                await pipe.execute()

        await call(heartbeat(), "join the weights bus")

    async def leave(self) -> None:
        await call(self.client.zrem(self.keys.weights_members, self.origin), "leave the weights bus")

    async def members(self) -> set[str]:
        """The other processes on the bus whose heartbeat has not expired."""
        found = await call(self.client.zrangebyscore(self.keys.weights_members, time.time(), "+inf"), "bus members")
        return {text(m) for m in found if isinstance(m, bytes | str)} - {self.origin}

    async def report_drained(self, token: str, ttl_s: float) -> None:
        """Say this process's own requests are drained for the update `token`, and tell the coordinating one."""
        key = self.keys.weights_drained(token)

        async def report() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.sadd(key, self.origin)
                pipe.expire(key, max(1, int(ttl_s)))
                await pipe.execute()

        await call(report(), "report drained")
        await self.announce(Drained(token))

    async def drained(self, token: str) -> set[str]:
        """The processes that drained their requests for the update `token`."""
        found = await call(self.client.smembers(self.keys.weights_drained(token)), "read drained")
        return {text(m) for m in found}

    async def announce(self, event: WeightsEvent) -> None:
        """Publish `event` on the control channel, naming this process as its origin."""
        payload = orjson.dumps(event.to_wire() | {"origin": self.origin})
        await call(self.client.publish(self.keys.control, payload), "publish control event")

    async def events(self) -> AsyncIterator[WeightsEvent | Subscribed]:
        """Control events from the other processes, forever (those of a kind this release does not know skipped);
        reconnects after a Redis outage. `Subscribed` comes first, and again after each reconnection (the client's or
        this loop's): the events sent meanwhile were lost."""
        delay = 0.1
        while True:
            try:
                if isinstance(self.client, FailoverAwareCluster):
                    # Its pub/sub picks a node by the channel's slot: the slots must be read first (a fresh client
                    # has not), and again after a failover.
                    await self.client.initialize()
                # The subscription's confirmations are kept: one comes again each time the client resubscribes,
                # which it does by itself after a lost connection (a Redis restart), and means `Subscribed`.
                pubsub = self.client.pubsub()
            except (RedisError, RedisClusterException, OSError) as exc:
                logger.warning("control channel unreachable (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
                continue
            try:
                await pubsub.subscribe(self.keys.control)
                delay = 0.1
                while True:
                    message = await pubsub.get_message(timeout=30.0)
                    kind = message.get("type") if message is not None else None
                    if kind == "subscribe":
                        yield Subscribed()
                    if kind != "message":
                        continue
                    raw: dict[str, Any] = orjson.loads(message["data"])
                    event = parse_event(raw) if raw.get("origin") != self.origin else None
                    if event is not None:
                        yield event
            except (RedisError, RedisClusterException, OSError) as exc:
                logger.warning("control channel lost (%s); resubscribing in %.1fs", exc, delay)
                if isinstance(self.client, FailoverAwareCluster):
                    await self.client.read_layout()
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
            finally:
                with contextlib.suppress(RedisError, RedisClusterException, OSError):
                    await pubsub.aclose()


def _pausing(raw: bytes | str | None) -> Pausing | None:
    """The `pausing` event a lock's record holds; None for none, or for what does not read as one."""
    try:
        wire = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    event = parse_event(wire) if isinstance(wire, dict) else None
    return event if isinstance(event, Pausing) else None
