"""What the parts of the store share: the client and its batcher, the scripts, the counters, the lifetimes, and
the two ways of writing a session's slot (a batched pipeline, an optimistic WATCHed transaction)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import AskError, MovedError, WatchError
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import InvalidRequest, StoreError
from gateway.store.keys import REDIS_ERRORS, Keys, call
from gateway.store.pipelines import Build, OwnPipelines, Pipelines
from gateway.store.scripts import Scripts
from gateway.store.slot_clients import Durability, SlotClients
from gateway.trajectory import SessionMeta

__all__ = ["Fields", "StoreCore", "StoreStats", "Writes", "backoff_s", "meta_of"]

logger = logging.getLogger(__name__)

Writes = Callable[[Pipeline], None]
Fields = dict[bytes | str, bytes | str]  # a hash as redis-py returns it (bytes) or as we encode it

_MAX_WATCH_ATTEMPTS = 16  # optimistic transactions rerun on conflict; a session's meta is rarely contended
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0


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
    dropped_stale: int = 0  # finished sessions not delivered: a sample cut for staleness (`stale_samples: drop`)
    samples_moved: int = 0  # sample writes that found their index taken by another turn, and moved (logged)
    delivered: int = 0  # sessions this process delivered to the trajectories stream (their real entry)


class StoreCore:
    """The client, its batcher and scripts, the counters and the session lifetimes, shared by the store's parts.

    `ttl_s`: a finished or abandoned session's lifetime; an active one's is `active_ttl_s` from its last write.
    `max_metadata_bytes`: the most a session's metadata may take as JSON (`check_metadata`). `durability`: how a
    finish's writes wait for replicas (none by default).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        ttl_s: int,
        session_idle_ttl_s: int,
        pipelines: Pipelines | None = None,
        max_metadata_bytes: int = 64 * 1024,
        durability: Durability | None = None,
    ) -> None:
        self.client = client
        self.max_metadata_bytes = max_metadata_bytes
        self.keys = keys
        self.ttl_s = ttl_s
        self.session_idle_ttl_s = session_idle_ttl_s
        self.scripts = Scripts(client)
        # The per-turn round trips (read a session, write a sample, create one): a pipeline each, or shared by
        # concurrent turns (the fast path's batcher).
        self.batcher: Pipelines = pipelines or OwnPipelines(client)
        self.slots = SlotClients(client)
        # A finish's writes that a failover must not lose wait for replicas (`redis.durable_replicas`).
        self.durability = durability or Durability(client)
        self.stats = StoreStats()

    @property
    def active_ttl_s(self) -> int:
        return self.session_idle_ttl_s + self.ttl_s

    async def get_session(self, session_id: str) -> SessionMeta | None:
        raw = await call(self.client.hgetall(self.keys.meta(session_id)), "read session")
        return SessionMeta.from_redis(session_id, raw) if raw else None

    def check_metadata(self, session_id: str, metadata: Mapping[str, Any]) -> None:
        """Refuse a session's metadata, all its requests' together, past `max_metadata_bytes` as JSON: each request's
        is bounded, but a session's turns may each add keys, and all of it goes into the trajectory."""
        size = len(orjson.dumps(metadata))
        if size > self.max_metadata_bytes:
            raise InvalidRequest(
                f"metadata: session {session_id}'s metadata would take {size} bytes as JSON, more than "
                f"{self.max_metadata_bytes} bytes (store.max_session_metadata_bytes); nothing was stored",
                param="metadata",
                code="session_metadata_too_large",
            )

    async def batched(self, build: Build, what: str) -> list[Any]:
        """The replies to `build`'s commands (`Pipelines`); a transport failure
        or a command's error is a `StoreError`."""
        replies = await call(self.batcher.execute(build), what)
        for reply in replies:
            if isinstance(reply, Exception):
                raise StoreError(f"redis: {what} failed: {reply}") from reply
        return replies

    async def transact(
        self, session_id: str, plan: Callable[[SessionMeta | None], Writes | None], what: str
    ) -> SessionMeta | None:
        """Optimistic transaction on the session's slot: WATCH the meta, read it, let `plan` decide the writes
        (None: none), MULTI/EXEC; rerun if the meta changed meanwhile. Returns the meta as `plan` last saw it."""
        key = self.keys.meta(session_id)
        for _ in range(_MAX_WATCH_ATTEMPTS):
            try:
                async with self.slots.for_key(key).pipeline(transaction=True) as pipe:
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
            except (AskError, MovedError, RedisConnectionError) as exc:
                if not self.slots.clustered:
                    raise StoreError(f"redis: {what} failed: {exc}") from exc
                # The slot has another master now (a failover, a migration): decide again there.
                await call(self.slots.redirected(key), what)
            except REDIS_ERRORS as exc:
                raise StoreError(f"redis: {what} failed: {exc}") from exc
        raise StoreError(f"redis: {what}: the session changed under {_MAX_WATCH_ATTEMPTS} attempts in a row")

    def writes_closing(self, meta: SessionMeta, fields: dict[str, bytes | int | float | str]) -> Writes:
        """Closing a session: its meta fields, and TTL `ttl_s` on the meta and every sample."""
        meta_key = self.keys.meta(meta.id)
        sample_keys = [self.keys.sample(meta.id, index) for index in range(meta.sample_count)]

        def writes(pipe: Pipeline) -> None:
            pipe.hset(meta_key, mapping=fields)  # type: ignore[arg-type]
            for key in (meta_key, *sample_keys):
                pipe.expire(key, self.ttl_s)

        return writes


def meta_of(session_id: str, flat: list[Any]) -> SessionMeta:
    """The meta of a script's HGETALL answer (field, value, field, value, ...)."""
    return SessionMeta.from_redis(session_id, dict(zip(flat[::2], flat[1::2], strict=True)))


def backoff_s(attempt: int) -> float:
    """Exponential backoff with equal jitter: half the step fixed (progress), half random (no lockstep)."""
    step = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2.0**attempt)
    return step / 2 + random.uniform(0, step / 2)
