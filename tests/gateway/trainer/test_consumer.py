"""The trainer's consumer against a real Redis: delivery, acknowledgement, reclaim, GRPO groups, staleness, tensors.

Sessions are written straight into Redis with the store's schema (`Keys`, `SessionMeta.to_redis`,
`Sample.to_redis`, XADD) by `finish()`, which does what the store's finish does: meta and samples, the stream
entry, the meta's `stream_id`, and the session in `rg:pending:sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.errors import StoreError
from gateway.store import Keys
from gateway.trainer import Batch, TrajectoryConsumer
from gateway.trajectory import Sample, SessionMeta, Trajectory, TrajectoryFormatError
from tests.sim_helpers import wait_for

KEYS = Keys()
GROUP = "trainers"

ConsumerFactory = Callable[..., Awaitable[TrajectoryConsumer]]


def make_sample(
    prompt: list[int],
    response: list[int],
    *,
    versions: list[int] | None = None,
    loss: list[int] | None = None,
    experts: tuple[int, int] | None = None,
    seed: int = 0,
) -> Sample:
    """Response tokens are model tokens (version 0) unless `loss`/`versions` say otherwise; env tokens get -1."""
    rng = np.random.default_rng(seed)
    n = len(response)
    mask = np.array(loss if loss is not None else [1] * n, np.uint8)
    vers = np.array(versions if versions is not None else [0] * n, np.int32)
    vers = np.where(mask == 1, vers, -1).astype(np.int32)
    logprobs = np.where(mask == 1, -rng.random(n), 0.0).astype(np.float32)
    routed = None
    if experts is not None:
        layers, top_k = experts
        routed = rng.integers(0, 64, size=(len(prompt) + n - 1, layers, top_k)).astype(np.uint8)
    return Sample(
        prompt_ids=np.array(prompt, np.int32),
        response_ids=np.array(response, np.int32),
        loss_mask=mask,
        logprobs=logprobs,
        versions=vers,
        routed_experts=routed,
        num_turns=1,
    )


async def xadd_entry(redis: Redis, session_id: str, meta: SessionMeta) -> str:
    fields = {
        "session_id": session_id,
        "group_id": meta.group_id or "",
        "reward": "" if meta.reward is None else repr(meta.reward),
        "samples": meta.sample_count,
    }
    return (await redis.xadd(KEYS.trajectories, fields)).decode()  # type: ignore[arg-type]


async def write_session(
    redis: Redis, session_id: str, samples: list[Sample], metadata: dict[str, Any] | None, reward: float | None
) -> SessionMeta:
    meta = SessionMeta(
        id=session_id,
        status="finished",
        metadata=metadata or {},
        reward=reward,
        sample_count=len(samples),
        created_at=1.0,
        updated_at=2.0,
        finished_at=2.0,
    )
    pipe = redis.pipeline(transaction=True)
    pipe.hset(KEYS.meta(session_id), mapping=meta.to_redis())  # type: ignore[arg-type]
    for index, sample in enumerate(samples):
        pipe.hset(KEYS.sample(session_id, index), mapping=sample.to_redis())  # type: ignore[arg-type]
    await pipe.execute()
    return meta


async def finish(
    redis: Redis,
    session_id: str,
    samples: list[Sample] | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    reward: float | None = 1.0,
) -> str:
    """What the store's finish leaves in Redis; returns the stream entry id."""
    if samples is None:
        samples = [make_sample([1, 2, 3], [4, 5], seed=hash(session_id) % 1000)]
    meta = await write_session(redis, session_id, samples, metadata, reward)
    entry_id = await xadd_entry(redis, session_id, meta)
    assert await redis.hsetnx(KEYS.meta(session_id), "stream_id", entry_id)
    await redis.sadd(KEYS.pending, session_id)
    return entry_id


async def pending_counter(redis: Redis) -> int:
    return int(await redis.scard(KEYS.pending))


async def pel(redis: Redis) -> dict[str, str]:
    """The group's pending entries: entry id → consumer."""
    rows = await redis.xpending_range(KEYS.trajectories, GROUP, "-", "+", 1000)
    return {row["message_id"].decode(): row["consumer"].decode() for row in rows}


async def blocked_readers(redis: Redis) -> bool:
    """A client of the server (of any master of a cluster) is blocked in XREADGROUP (a real condition to wait on, not
    a sleep)."""
    if isinstance(redis, RedisCluster):
        per_node = await redis.client_list(target_nodes=RedisCluster.PRIMARIES)
        clients = [c for listed in per_node.values() for c in listed]
    else:
        clients = await redis.client_list()
    return any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in clients)


def sessions(batch: Batch) -> list[str]:
    return [t.session_id for t in batch.trajectories]


@pytest.fixture
async def make_consumer(redis_url: str, redis: Redis) -> AsyncIterator[ConsumerFactory]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(name: str = "c1", **options: Any) -> TrajectoryConsumer:
            consumer = TrajectoryConsumer(redis_url, GROUP, name, **options)
            return await stack.enter_async_context(consumer)

        yield make


async def crash(consumer: TrajectoryConsumer) -> None:
    """The process dies: its connection goes, nothing is acknowledged or handed back."""
    await consumer.client.aclose()


# ------------------------------------------------------------------------------------------------------------
# delivery and acknowledgement


async def test_batch_then_ack(redis: Redis, make_consumer: ConsumerFactory) -> None:
    written = {f"s{i}": [make_sample([1, 2, i], [7, 8, 9, i], experts=(2, 2), seed=i)] for i in range(3)}
    ids = [
        await finish(redis, sid, samples, metadata={"task": sid}, reward=float(i))
        for i, (sid, samples) in enumerate(written.items())
    ]
    assert await pending_counter(redis) == 3
    consumer = await make_consumer()

    batch = await consumer.next_batch(3, timeout=2.0)

    assert sessions(batch) == ["s0", "s1", "s2"]
    assert batch.entry_ids == ids
    assert batch.dropped_duplicate == batch.dropped_stale == batch.dropped_unreadable == 0
    for i, trajectory in enumerate(batch.trajectories):
        (got,) = trajectory.samples
        (want,) = written[trajectory.session_id]
        for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "routed_experts"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        assert trajectory.reward == float(i)
        assert trajectory.meta.metadata == {"task": trajectory.session_id}
    assert set(await pel(redis)) == set(ids)  # delivered, not yet acknowledged

    assert await consumer.ack(batch) == 3

    assert await pending_counter(redis) == 0
    assert await pel(redis) == {}
    assert await redis.xlen(KEYS.trajectories) == 0  # acknowledged entries leave the stream
    for sid in written:  # data kept briefly (ack_ttl_s), not forever
        assert 0 < await redis.pttl(KEYS.meta(sid)) <= 60_000
        assert 0 < await redis.pttl(KEYS.sample(sid, 0)) <= 60_000
    assert await consumer.ack(batch) == 0  # already acknowledged: pending is not decremented twice
    assert await pending_counter(redis) == 0
    assert len(await consumer.next_batch(3, timeout=0)) == 0


async def test_ack_ttl_zero_deletes_session_keys(redis: Redis, make_consumer: ConsumerFactory) -> None:
    await finish(redis, "s0", [make_sample([1], [2]), make_sample([3], [4])])
    consumer = await make_consumer(ack_ttl_s=0)
    batch = await consumer.next_batch(1, timeout=1.0)
    assert await consumer.ack(batch.entry_ids) == 1  # by id, as handed out
    assert await redis.exists(KEYS.meta("s0"), KEYS.sample("s0", 0), KEYS.sample("s0", 1)) == 0
    assert await pending_counter(redis) == 0


async def test_next_batch_polls_and_waits(redis: Redis, make_consumer: ConsumerFactory) -> None:
    consumer = await make_consumer()
    first = await finish(redis, "early")
    batch = await consumer.next_batch(2, timeout=0)
    assert batch.entry_ids == [first]  # a poll returns what there is
    await consumer.ack(batch)
    assert len(await consumer.next_batch(2, timeout=0.05)) == 0  # the deadline, with nothing

    waiting = asyncio.create_task(consumer.next_batch(2, timeout=30.0))
    await wait_for(lambda: blocked_readers(redis), what="the consumer blocked in XREADGROUP")
    later = [await finish(redis, "late0"), await finish(redis, "late1")]
    started = time.monotonic()
    batch = await asyncio.wait_for(waiting, timeout=10.0)
    assert batch.entry_ids == later  # returns once n arrived, long before its deadline
    assert time.monotonic() - started < 10.0


async def test_dead_consumer_entries_are_reclaimed_by_another(redis: Redis, make_consumer: ConsumerFactory) -> None:
    ids = [await finish(redis, f"s{i}") for i in range(3)]
    dying = await make_consumer("dying")
    taken = await dying.next_batch(2, timeout=1.0)
    assert taken.entry_ids == ids[:2]
    await crash(dying)

    patient = await make_consumer("patient", claim_idle_s=60.0)
    fresh = await patient.next_batch(10, timeout=0)
    assert fresh.entry_ids == ids[2:]  # not idle long enough to reclaim: only the unread entry
    await patient.ack(fresh)

    rescuer = await make_consumer("rescuer", claim_idle_s=0.0)
    reclaimed = await rescuer.next_batch(10, timeout=0)

    assert reclaimed.entry_ids == ids[:2]  # exactly the dead consumer's entries
    assert await pel(redis) == {ids[0]: "rescuer", ids[1]: "rescuer"}
    await rescuer.ack(reclaimed)
    assert await pel(redis) == {}
    assert await pending_counter(redis) == 0


async def test_entries_acked_twice_by_two_consumers_count_once(redis: Redis, make_consumer: ConsumerFactory) -> None:
    ids = [await finish(redis, f"s{i}") for i in range(2)]
    slow = await make_consumer("slow")
    batch = await slow.next_batch(2, timeout=1.0)
    thief = await make_consumer("thief", claim_idle_s=0.0)
    stolen = await thief.next_batch(2, timeout=0)
    assert stolen.entry_ids == ids
    assert len(await slow.next_batch(2, timeout=0)) == 0  # notices the loss, delivers nothing twice

    assert await slow.ack(batch) + await thief.ack(stolen) == 2
    assert await pending_counter(redis) == 0
    assert await pel(redis) == {}


async def test_ack_by_ids_from_another_process(redis: Redis, make_consumer: ConsumerFactory) -> None:
    real = await finish(redis, "s0")
    reader = await make_consumer("reader")
    batch = await reader.next_batch(1, timeout=1.0)
    assert batch.entry_ids == [real]
    other = await make_consumer("other")  # knows nothing of the delivery: looks the ids up
    assert await other.ack([real, "1-1"]) == 1
    assert await pending_counter(redis) == 0
    assert 0 < await redis.pttl(KEYS.meta("s0")) <= 60_000


async def test_duplicate_entries_skipped_and_acked(redis: Redis, make_consumer: ConsumerFactory) -> None:
    meta = await write_session(redis, "s1", [make_sample([1, 2], [3])], {"group_id": "g"}, 0.5)
    before = await xadd_entry(redis, "s1", meta)  # a crashed finish's entry
    real = await xadd_entry(redis, "s1", meta)
    after = await xadd_entry(redis, "s1", meta)  # the repair sweeper's, once more
    await redis.hset(KEYS.meta("s1"), "stream_id", real)
    await redis.sadd(KEYS.pending, "s1")
    consumer = await make_consumer()

    batch = await consumer.next_batch(5, timeout=0.05)

    assert batch.entry_ids == [real]
    assert batch.dropped_duplicate == 2
    assert await pel(redis) == {real: "c1"}  # duplicates acknowledged at once
    assert await pending_counter(redis) == 1  # ... without touching the counter
    assert await redis.pttl(KEYS.meta("s1")) == -1  # ... nor the session's keys
    await consumer.ack(batch)
    assert await pending_counter(redis) == 0
    assert await pel(redis) == {}
    assert before not in await pel(redis) and after not in await pel(redis)


async def test_expired_session_data_is_acked_and_counted(redis: Redis, make_consumer: ConsumerFactory) -> None:
    await finish(redis, "gone")
    await finish(redis, "half", [make_sample([1], [2]), make_sample([3], [4])])
    kept = await finish(redis, "kept")
    await redis.delete(KEYS.meta("gone"), KEYS.sample("half", 1))
    consumer = await make_consumer()

    batch = await consumer.next_batch(3, timeout=0)

    assert batch.entry_ids == [kept]
    assert batch.dropped_unreadable == 2
    assert await pel(redis) == {kept: "c1"}
    assert await pending_counter(redis) == 1


async def test_unconfirmed_entry_is_judged_again(redis: Redis, make_consumer: ConsumerFactory) -> None:
    meta = await write_session(redis, "s0", [make_sample([1], [2])], None, 1.0)
    entry_id = await xadd_entry(redis, "s0", meta)  # the store's finish is between XADD and the stream_id claim
    consumer = await make_consumer()
    assert len(await consumer.next_batch(1, timeout=0)) == 0
    assert await pel(redis) == {entry_id: "c1"}  # neither delivered nor acknowledged

    waiting = asyncio.create_task(consumer.next_batch(1, timeout=30.0))
    await wait_for(lambda: blocked_readers(redis), what="the consumer blocked in XREADGROUP")
    await redis.hset(KEYS.meta("s0"), "stream_id", entry_id)  # the claim lands
    batch = await asyncio.wait_for(waiting, timeout=10.0)
    assert batch.entry_ids == [entry_id]


async def test_unconfirmed_entry_that_loses_the_claim_is_a_duplicate(
    redis: Redis, make_consumer: ConsumerFactory
) -> None:
    meta = await write_session(redis, "s0", [make_sample([1], [2])], None, 1.0)
    orphan = await xadd_entry(redis, "s0", meta)  # its writer crashed before claiming
    consumer = await make_consumer()
    assert len(await consumer.next_batch(1, timeout=0)) == 0
    real = await xadd_entry(redis, "s0", meta)  # the repair sweeper delivers again and claims its own entry
    await redis.hset(KEYS.meta("s0"), "stream_id", real)
    await redis.sadd(KEYS.pending, "s0")

    batch = await consumer.next_batch(1, timeout=1.0)

    assert batch.entry_ids == [real]
    assert batch.dropped_duplicate == 1
    assert await pel(redis) == {real: "c1"}
    assert orphan not in await pel(redis)


async def test_entry_fields_missing(redis: Redis, make_consumer: ConsumerFactory) -> None:
    meta = await write_session(redis, "s0", [make_sample([1], [2]), make_sample([3], [4])], None, 1.0)
    no_count = (await redis.xadd(KEYS.trajectories, {"session_id": "s0"})).decode()  # sample count from the meta
    await redis.hset(KEYS.meta("s0"), "stream_id", no_count)
    await redis.sadd(KEYS.pending, "s0")
    junk = (await redis.xadd(KEYS.trajectories, {"hello": "world"})).decode()
    consumer = await make_consumer()

    batch = await consumer.next_batch(2, timeout=0)

    assert batch.entry_ids == [no_count]
    assert len(batch.trajectories[0].samples) == meta.sample_count == 2
    assert batch.dropped_unreadable == 1
    assert junk not in await pel(redis)
    assert await pending_counter(redis) == 1


def test_invalid_options() -> None:
    for options in ({"claim_idle_s": -1}, {"group_size": 0}, {"max_staleness": -1}, {"stale_policy": "keep"}):
        with pytest.raises(ValueError):
            TrajectoryConsumer("redis://127.0.0.1:1/0", GROUP, "c1", **options)


async def test_bad_n(make_consumer: ConsumerFactory) -> None:
    consumer = await make_consumer()
    with pytest.raises(ValueError):
        await consumer.next_batch(0, timeout=0)


async def test_trimmed_pending_entry_is_acknowledged(redis: Redis, make_consumer: ConsumerFactory) -> None:
    entry_id = await finish(redis, "s0")
    dying = await make_consumer("dying")
    assert (await dying.next_batch(1, timeout=1.0)).entry_ids == [entry_id]
    await crash(dying)
    await redis.xdel(KEYS.trajectories, entry_id)
    rescuer = await make_consumer("rescuer", claim_idle_s=0.0)
    assert len(await rescuer.next_batch(1, timeout=0)) == 0
    assert await pel(redis) == {}


async def test_unreachable_redis_is_a_store_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    consumer = TrajectoryConsumer(f"redis://127.0.0.1:{port}/0", GROUP, "c1", socket_timeout_s=0.5)
    with pytest.raises(StoreError):
        await consumer.start()
    with pytest.raises(RuntimeError):
        await consumer.next_batch(1, timeout=0)


async def test_existing_group_is_reused(redis: Redis, make_consumer: ConsumerFactory) -> None:
    first = await make_consumer("a")
    second = await make_consumer("b")  # BUSYGROUP tolerated
    entry_id = await finish(redis, "s0")
    assert (await second.next_batch(1, timeout=1.0)).entry_ids == [entry_id]
    assert len(await first.next_batch(1, timeout=0)) == 0


# ------------------------------------------------------------------------------------------------------------
# GRPO groups


def grpo(group: str, size: int) -> dict[str, Any]:
    return {"group_id": group, "group_size": size}


async def test_group_by_yields_only_complete_groups(redis: Redis, make_consumer: ConsumerFactory) -> None:
    a = [await finish(redis, f"a{i}", metadata=grpo("A", 4)) for i in range(3)]
    b = [await finish(redis, f"b{i}", metadata=grpo("B", 4)) for i in range(2)]
    consumer = await make_consumer(group_by="group_id")

    assert len(await consumer.next_batch(8, timeout=0.05)) == 0  # A has 3 of 4, B 2 of 4
    assert set(await pel(redis)) == {*a, *b}  # held, un-acked

    a.append(await finish(redis, "a3", metadata=grpo("A", 4)))
    batch = await consumer.next_batch(8, timeout=0.05)

    assert sessions(batch) == ["a0", "a1", "a2", "a3"]
    assert batch.group_index == [0, 0, 0, 0]
    await consumer.ack(batch)
    assert set(await pel(redis)) == set(b)
    assert await pending_counter(redis) == 2


async def test_groups_are_never_split_and_n_counts_trajectories(redis: Redis, make_consumer: ConsumerFactory) -> None:
    for g in "XYZ":
        for i in range(2):
            await finish(redis, f"{g}{i}", metadata={"group_id": g, "group_size": 99})
    consumer = await make_consumer(group_by="group_id", group_size=2)  # the constructor's size wins

    first = await consumer.next_batch(3, timeout=1.0)  # the second group would make 4 > 3
    assert sessions(first) == ["X0", "X1"]
    second = await consumer.next_batch(4, timeout=1.0)
    assert sessions(second) == ["Y0", "Y1", "Z0", "Z1"]
    assert second.group_index == [0, 0, 1, 1]
    await finish(redis, "W0", metadata={"group_id": "W"})
    await finish(redis, "W1", metadata={"group_id": "W"})
    alone = await consumer.next_batch(1, timeout=1.0)  # larger than n: comes whole, alone
    assert sessions(alone) == ["W0", "W1"]
    assert await consumer.ack(first) + await consumer.ack(second) + await consumer.ack(alone) == 8
    assert await pel(redis) == {}


async def test_incomplete_group_dropped_after_max_wait(redis: Redis, make_consumer: ConsumerFactory) -> None:
    for i in range(2):
        await finish(redis, f"late{i}", metadata=grpo("late", 4))
    done = [await finish(redis, f"ok{i}", metadata=grpo("ok", 2)) for i in range(2)]
    consumer = await make_consumer(group_by="group_id", max_group_wait_s=0.0)

    batch = await consumer.next_batch(4, timeout=0)

    assert batch.entry_ids == done
    assert batch.dropped_incomplete == 2
    assert await pel(redis) == {done[0]: "c1", done[1]: "c1"}
    assert await pending_counter(redis) == 2
    assert 0 < await redis.pttl(KEYS.meta("late0")) <= 60_000


async def test_trajectory_without_group_key_comes_alone(redis: Redis, make_consumer: ConsumerFactory) -> None:
    entry_id = await finish(redis, "solo", metadata={"task": "t"})
    consumer = await make_consumer(group_by="group_id")
    batch = await consumer.next_batch(4, timeout=0)
    assert batch.entry_ids == [entry_id]


async def test_held_group_members_reclaimed_after_a_crash(redis: Redis, make_consumer: ConsumerFactory) -> None:
    for i in range(3):
        await finish(redis, f"a{i}", metadata=grpo("A", 4))
    dying = await make_consumer("dying", group_by="group_id")
    assert len(await dying.next_batch(4, timeout=0)) == 0
    assert set((await pel(redis)).values()) == {"dying"}
    await crash(dying)
    await finish(redis, "a3", metadata=grpo("A", 4))

    rescuer = await make_consumer("rescuer", group_by="group_id", claim_idle_s=0.0)
    batch = await rescuer.next_batch(4, timeout=1.0)

    assert sorted(sessions(batch)) == ["a0", "a1", "a2", "a3"]


async def test_group_with_a_stolen_member_is_left_to_the_thief(redis: Redis, make_consumer: ConsumerFactory) -> None:
    for i in range(3):
        await finish(redis, f"a{i}", metadata=grpo("A", 4))
    slow = await make_consumer("slow", group_by="group_id")
    assert len(await slow.next_batch(4, timeout=0)) == 0  # holds 3 of 4
    thief = await make_consumer("thief", group_by="group_id", claim_idle_s=0.0)
    assert len(await thief.next_batch(4, timeout=0)) == 0  # took all 3 (the slow one looked dead)
    await finish(redis, "a3", metadata=grpo("A", 4))

    assert len(await slow.next_batch(4, timeout=0)) == 0  # forgot A; holds a3 alone now
    batch = await thief.next_batch(4, timeout=1.0)  # reclaims a3 as well

    assert sorted(sessions(batch)) == ["a0", "a1", "a2", "a3"]
    assert set((await pel(redis)).values()) == {"thief"}
    assert len(await slow.next_batch(4, timeout=0)) == 0  # ...and the slow one lets a3 go


async def test_complete_group_waiting_for_room_can_be_stolen(redis: Redis, make_consumer: ConsumerFactory) -> None:
    for g in "XY":
        for i in range(2):
            await finish(redis, f"{g}{i}", metadata=grpo(g, 2))
    slow = await make_consumer("slow", group_by="group_id")
    first = await slow.next_batch(3, timeout=5.0)
    assert sessions(first) == ["X0", "X1"]  # Y, complete, waits for room
    await slow.ack(first)
    thief = await make_consumer("thief", group_by="group_id", claim_idle_s=0.0)
    assert sessions(await thief.next_batch(2, timeout=0)) == ["Y0", "Y1"]
    assert len(await slow.next_batch(2, timeout=0)) == 0  # Y is the thief's now: not delivered twice


async def test_close_hands_held_entries_back_at_once(
    redis_url: str, redis: Redis, make_consumer: ConsumerFactory
) -> None:
    for i in range(3):
        await finish(redis, f"a{i}", metadata=grpo("A", 4))
    async with TrajectoryConsumer(redis_url, GROUP, "leaving", group_by="group_id") as leaving:
        assert len(await leaving.next_batch(4, timeout=0)) == 0
    await finish(redis, "a3", metadata=grpo("A", 4))

    successor = await make_consumer("successor", group_by="group_id", claim_idle_s=60.0)
    batch = await successor.next_batch(4, timeout=1.0)

    assert sorted(sessions(batch)) == ["a0", "a1", "a2", "a3"]  # no 60 s wait: the leaver handed them back


# ------------------------------------------------------------------------------------------------------------
# staleness


async def write_stale_and_fresh(redis: Redis) -> tuple[str, str]:
    await redis.hset(KEYS.weights, mapping={"version": 10, "state": "serving"})
    fresh = await finish(redis, "fresh", [make_sample([1, 2], [3, 4], versions=[9, 10])])
    # model tokens at v7, v7, then a tool result, then v9: the bound (10 - 2 = 8) makes the first two off-policy
    stale_sample = make_sample([5, 6], [7, 8, 0, 9], versions=[7, 7, -1, 9], loss=[1, 1, 0, 1])
    stale = await finish(redis, "stale", [stale_sample])
    return fresh, stale


async def test_stale_trajectories_dropped(redis: Redis, make_consumer: ConsumerFactory) -> None:
    fresh, _ = await write_stale_and_fresh(redis)
    consumer = await make_consumer(max_staleness=2, stale_policy="drop")

    batch = await consumer.next_batch(2, timeout=0.05)

    assert batch.entry_ids == [fresh]
    assert batch.current_version == 10 and batch.stale_before == 8
    assert batch.dropped_stale == 1
    assert await pel(redis) == {fresh: "c1"}  # the stale one is acknowledged
    await consumer.ack(batch)
    assert await pending_counter(redis) == 0


async def test_stale_member_drops_its_whole_group(redis: Redis, make_consumer: ConsumerFactory) -> None:
    await redis.hset(KEYS.weights, "version", 5)
    await finish(redis, "old", [make_sample([1], [2], versions=[1])], metadata=grpo("G", 2))
    await finish(redis, "new", [make_sample([1], [2], versions=[5])], metadata=grpo("G", 2))
    kept = [await finish(redis, f"h{i}", [make_sample([1], [2], versions=[4])], metadata=grpo("H", 2)) for i in "01"]
    consumer = await make_consumer(group_by="group_id", max_staleness=1, stale_policy="drop")

    batch = await consumer.next_batch(4, timeout=0)

    assert batch.entry_ids == kept
    assert batch.dropped_stale == 2
    assert await pending_counter(redis) == 2


async def test_stale_tokens_masked(redis: Redis, make_consumer: ConsumerFactory) -> None:
    await write_stale_and_fresh(redis)
    consumer = await make_consumer(max_staleness=2, stale_policy="mask")

    batch = await consumer.next_batch(2, timeout=1.0)

    assert sessions(batch) == ["fresh", "stale"]
    assert batch.dropped_stale == 0
    np.testing.assert_array_equal(batch.off_policy_mask[0][0], [1, 1])
    np.testing.assert_array_equal(batch.off_policy_mask[1][0], [0, 0, 1, 1])
    pytest.importorskip("torch")
    tensors = batch.to_tensors()
    assert tensors["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]]
    assert tensors["versions"].tolist() == [[-1, -1, 9, 10, -1, -1], [-1, -1, 7, 7, -1, 9]]


async def test_without_max_staleness_nothing_is_masked(redis: Redis, make_consumer: ConsumerFactory) -> None:
    await write_stale_and_fresh(redis)
    consumer = await make_consumer()
    batch = await consumer.next_batch(2, timeout=1.0)
    assert batch.stale_before is None and batch.current_version == 10
    assert all(mask.all() for masks in batch.off_policy_mask for mask in masks)


# ------------------------------------------------------------------------------------------------------------
# tensors


async def read_batch(redis: Redis, consumer: TrajectoryConsumer, written: dict[str, list[Sample]]) -> Batch:
    for i, (sid, samples) in enumerate(written.items()):
        await finish(redis, sid, samples, reward=None if i == 1 else float(i + 1))
    return await consumer.next_batch(len(written), timeout=1.0)


@pytest.mark.parametrize("experts", [True, False])
async def test_to_tensors_pads_and_aligns(redis: Redis, make_consumer: ConsumerFactory, experts: bool) -> None:
    torch = pytest.importorskip("torch")
    shape = (3, 2)  # layers, top_k
    written = {
        "t0": [
            make_sample([10, 11, 12], [13, 14, 15, 16], loss=[1, 1, 0, 1], versions=[1, 1, 0, 2], experts=shape),
            make_sample([20, 21], [22, 23], versions=[3, 3], experts=shape, seed=1),
        ],
        "t1": [make_sample([30, 31, 32, 33, 34], [35], versions=[4], experts=shape if experts else None, seed=2)],
    }
    consumer = await make_consumer()
    batch = await read_batch(redis, consumer, written)

    t = batch.to_tensors(pad_token_id=-7)

    rows = [written["t0"][0], written["t0"][1], written["t1"][0]]
    assert t["input_ids"].shape == t["attention_mask"].shape == t["loss_mask"].shape == (3, 7)
    assert t["input_ids"].dtype == t["attention_mask"].dtype == t["versions"].dtype == torch.long
    assert t["loss_mask"].dtype == t["old_logprobs"].dtype == t["rewards"].dtype == torch.float32
    assert t["input_ids"].tolist() == [
        [10, 11, 12, 13, 14, 15, 16],
        [20, 21, 22, 23, -7, -7, -7],
        [30, 31, 32, 33, 34, 35, -7],
    ]
    assert t["attention_mask"].tolist() == [[1] * 7, [1] * 4 + [0] * 3, [1] * 6 + [0]]
    # position t describes input_ids[t]: the prompt and padding are never trained on
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0]]
    assert t["versions"].tolist() == [[-1, -1, -1, 1, 1, -1, 2], [-1, -1, 3, 3, -1, -1, -1], [-1] * 5 + [4, -1]]
    for row, sample in enumerate(rows):
        start, end = sample.prompt_ids.size, sample.input_ids.size
        np.testing.assert_array_equal(t["old_logprobs"][row, start:end].numpy(), sample.logprobs)
        assert not t["old_logprobs"][row, :start].any() and not t["old_logprobs"][row, end:].any()
    assert t["old_logprobs"][0, 5] == 0  # the environment token
    assert t["trajectory_index"].tolist() == [0, 0, 1]
    assert t["sample_index"].tolist() == [0, 1, 0]
    assert t["group_index"].tolist() == [0, 0, 1]
    assert t["rewards"][0] == 1.0 and t["rewards"][1] == 1.0 and torch.isnan(t["rewards"][2])
    if not experts:
        assert "routed_experts" not in t  # only when every sample has them
        return
    routed = t["routed_experts"]
    assert routed.shape == (3, 6, *shape) and routed.dtype == torch.long
    for row, sample in enumerate(rows):
        assert sample.routed_experts is not None
        n = sample.input_ids.size - 1
        np.testing.assert_array_equal(routed[row, :n].numpy(), sample.routed_experts)
        assert not routed[row, n:].any()


async def test_to_tensors_rejects_misaligned_experts(redis: Redis, make_consumer: ConsumerFactory) -> None:
    pytest.importorskip("torch")
    bad = make_sample([1, 2], [3], experts=(1, 1))
    bad.routed_experts = np.zeros((5, 1, 1), np.uint8)  # should cover 2 positions
    consumer = await make_consumer()
    batch = await read_batch(redis, consumer, {"bad": [bad]})
    with pytest.raises(TrajectoryFormatError, match="routed experts"):
        batch.to_tensors()


def test_empty_batch_to_tensors() -> None:
    pytest.importorskip("torch")
    tensors = Batch().to_tensors()
    assert tensors["input_ids"].shape == (0, 0)
    assert "routed_experts" not in tensors


def test_batch_built_by_hand() -> None:
    pytest.importorskip("torch")
    meta = SessionMeta(id="s", status="finished", reward=0.5, sample_count=1)
    sample = make_sample([1, 2], [3, 4, 5], loss=[1, 0, 1], versions=[2, 0, 3])
    batch = Batch(trajectories=[Trajectory(meta=meta, samples=[sample], entry_id="1-0")] * 2)
    tensors = batch.to_tensors(device="cpu")
    assert tensors["loss_mask"].tolist() == [[0, 0, 1, 0, 1]] * 2
    assert tensors["group_index"].tolist() == [0, 1]
    assert tensors["rewards"].tolist() == [0.5, 0.5]
    assert repr(batch).startswith("Batch(trajectories=2, samples=2, groups=2,")
