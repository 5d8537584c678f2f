"""The idle sweeper keeps up with agents that leave their sessions (issue 52 §7): each sweep closes every session
idle by then, however many, at a period that follows a short `store.session_idle_ttl_s`; several processes sweeping
at once close and record each session exactly once. On the single server and on a Redis Cluster."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.store import Keys, TrajectoryStore, connect
from gateway.trajectory import SessionMeta
from tests.sim_helpers import wait_for

KEYS = Keys()
MANY = 3_000  # more than a sweep once closed (1,000 before), and more than one batch (500)
# On a cluster the same code paths with fewer sessions: the single server already shows a sweep keeping up with
# 3,000, and what the cluster adds (sessions' keys on three masters, the index on one) is met as well by 1,200, still
# more than the old cap and than two batches (the two-process test's half: more than one).
MANY_ON_A_CLUSTER = 1_200


@pytest.fixture
def many(redis_url: str) -> int:
    """How many sessions a bulk test makes on `redis_url`'s deployment."""
    return MANY_ON_A_CLUSTER if redis_url.startswith("redis+cluster://") else MANY


@pytest.fixture
async def client(redis_url: str, redis: Redis) -> AsyncIterator[Redis]:
    """A client made as the gateway makes it (`connect`), on the flushed server."""
    client = connect(redis_url)
    yield client
    await client.aclose()


async def create_many(store: TrajectoryStore, count: int) -> list[SessionMeta]:
    """`count` new sessions, each with a little metadata, made a hundred at a time."""
    made: list[SessionMeta] = []
    for start in range(0, count, 100):
        batch = range(start, min(count, start + 100))
        made += await asyncio.gather(*(store.create_session({"task": f"t{i}"}) for i in batch))
    return made


async def recorded(redis: Redis) -> Counter[str]:
    """How many times `rg:abandoned` records each session."""
    return Counter(fields[b"session_id"].decode() for _, fields in await redis.xrange(KEYS.abandoned))


async def test_the_sweeper_abandons_every_idle_session_within_a_few_periods(
    client: Redis, redis: Redis, many: int
) -> None:
    # The default period of the repair sweep; a one-second idle TTL makes the idle sweep's period shorter.
    store = TrajectoryStore(client, KEYS, session_idle_ttl_s=1, sweep_interval_s=30.0)
    store.start()
    try:
        made = await create_many(store, many)

        async def all_abandoned() -> bool:
            return store.stats.abandoned == many and await redis.zcard(KEYS.active_sessions) == 0

        await wait_for(all_abandoned, timeout=20, what=f"all {many} idle sessions abandoned")
    finally:
        await store.aclose()
    assert await recorded(redis) == Counter({meta.id: 1 for meta in made})
    for meta in (made[0], made[-1]):
        stored = await store.get_session(meta.id)
        assert stored is not None and stored.status == "abandoned"
        assert stored.metadata == meta.metadata


async def test_two_processes_sweeping_at_once_close_and_record_each_session_once(
    client: Redis, redis: Redis, redis_url: str, many: int
) -> None:
    here = TrajectoryStore(client, KEYS, session_idle_ttl_s=600, sweep_interval_s=None)
    there = TrajectoryStore(connect(redis_url), KEYS, session_idle_ttl_s=600, sweep_interval_s=None)
    try:
        made = {meta.id for meta in await create_many(here, many // 2)}
        later = time.time() + 601
        by_here, by_there = await asyncio.gather(here.abandon_idle(now=later), there.abandon_idle(now=later))
        assert set(by_here) | set(by_there) == made
        assert not set(by_here) & set(by_there)  # no session closed by both
        assert await recorded(redis) == Counter(dict.fromkeys(made, 1))
        assert await redis.zcard(KEYS.active_sessions) == 0
        assert await here.abandon_idle(now=later) == [] and await there.abandon_idle(now=later) == []
    finally:
        await here.aclose()
        await there.aclose()
        await there.client.aclose()
