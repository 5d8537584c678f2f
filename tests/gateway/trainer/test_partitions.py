"""A partitioned trajectory stream (`store.stream_partitions`), on the single server and on a real Redis Cluster: the
store spreads sessions over the partitions with a group's members together, and `TrajectoryConsumer` reads,
acknowledges and reclaims across all of them, finding their number in Redis."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.store import Keys, TrajectoryStore, connect
from gateway.trainer import TrajectoryConsumer
from tests.gateway.store.test_trajectory_store import make_sample

PARTITIONS = 4
KEYS = Keys(partitions=PARTITIONS)


@pytest.fixture
async def store(redis_url: str, redis: Redis) -> AsyncIterator[TrajectoryStore]:
    client = connect(redis_url)
    store = TrajectoryStore(
        client, KEYS, ttl_s=600, session_idle_ttl_s=600, max_pending=1000, retry_budget_s=20, sweep_interval_s=None
    )
    yield store
    await store.aclose()
    await client.aclose()


async def finished(store: TrajectoryStore, session_id: str, group: str | None = None) -> str:
    await store.create_session({"group_id": group} if group else None, session_id)
    await store.save_sample(session_id, 0, make_sample(seed=len(session_id)))
    return await store.finish(session_id, 1.0)


async def test_sessions_spread_over_the_partitions_and_a_group_stays_in_one(
    store: TrajectoryStore, redis: Redis
) -> None:
    for i in range(24):
        await finished(store, f"solo-{i}")
    for i in range(4):
        await finished(store, f"member-{i}", group="g7")
    lengths = [await redis.xlen(stream) for stream in KEYS.streams]
    assert sum(lengths) == 28 and sum(1 for n in lengths if n) >= 3  # spread (24 ids over 4 partitions)
    group_stream = KEYS.stream(KEYS.partition_of("g7"))
    members = [fields[b"session_id"] for _, fields in await redis.xrange(group_stream)]
    assert {b"member-0", b"member-1", b"member-2", b"member-3"} <= set(members)
    assert int(await redis.get(KEYS.stream_partitions)) == PARTITIONS  # consumers read this many


async def test_a_consumer_reads_every_partition_once_and_acks_each_in_its_own(
    store: TrajectoryStore, redis: Redis, redis_url: str
) -> None:
    ids = {f"s-{i}": await finished(store, f"s-{i}") for i in range(20)}
    for i in range(3):
        await finished(store, f"m-{i}", group="grp")
    async with TrajectoryConsumer(redis_url, "g", "c1", group_by="group_id") as consumer:  # partitions from Redis
        seen: Counter[str] = Counter()
        for _ in range(20):
            batch = await consumer.next_batch(8, timeout=0.2)
            seen.update(t.session_id for t in batch.trajectories)
            grouped = [t for t in batch.trajectories if t.meta.group_id == "grp"]
            assert len(grouped) in (0, 3)  # a group whole, or not yet
            assert await consumer.ack(batch) == len(batch)
            if sum(seen.values()) == 23:
                break
    assert seen == Counter({**{s: 1 for s in ids}, "m-0": 1, "m-1": 1, "m-2": 1})
    assert await store.pending() == 0
    assert [await redis.xlen(stream) for stream in KEYS.streams] == [0] * PARTITIONS  # acknowledged: deleted


async def test_qualified_entry_ids_stay_unique_and_another_consumer_reclaims_across_partitions(
    store: TrajectoryStore, redis_url: str
) -> None:
    for i in range(12):
        await finished(store, f"r-{i}")
    async with TrajectoryConsumer(redis_url, "g", "dies", claim_idle_s=0.05) as first:
        taken = await first.next_batch(12, timeout=1.0)
        assert len(taken) == 12 and len(set(taken.entry_ids)) == 12
        assert any("@" in entry_id for entry_id in taken.entry_ids)  # partitions ≥ 1 qualify their ids
        # `first` never acknowledges: once idle, another consumer takes them over, partition by partition.
        async with TrajectoryConsumer(redis_url, "g", "heir", claim_idle_s=0.05) as heir:
            again: list[str] = []
            for _ in range(40):
                batch = await heir.next_batch(12, timeout=0.1)
                again += [t.session_id for t in batch.trajectories]
                assert await heir.ack(batch) == len(batch)
                if len(again) == 12:
                    break
    assert sorted(again) == sorted(t.session_id for t in taken.trajectories)
    assert await store.pending() == 0
