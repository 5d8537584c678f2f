"""The trajectory store against a real redis-server: schema, idempotent finish, repair, backpressure, outages.

Most tests use the session's server (flushed per test by the `redis` fixture); the restart and outage tests
start their own `EmbeddedRedis` (AOF fsynced on every write) so they can kill and restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.config import Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import Conflict, InvalidRequest, Overloaded, SessionNotFound, StoreError
from gateway.store import Keys, TrajectoryStore, _SampleWrite, connect
from gateway.trajectory import F32, I32, U8, Sample, SessionMeta, StoredChunks

KEYS = Keys()
TTL_S = 3_600
IDLE_S = 600
GLOBAL_KEYS = {
    KEYS.trajectories,
    KEYS.stream_partitions,
    KEYS.pending,
    KEYS.active_sessions,
    KEYS.undelivered,
    KEYS.abandoned,
}


def make_sample(prompt: int = 5, response: int = 8, *, experts_max: int | None = None, seed: int = 0) -> Sample:
    rng = np.random.default_rng(seed)
    mask = rng.integers(0, 2, response).astype(U8)
    experts = None
    if experts_max is not None:
        experts = rng.integers(0, experts_max + 1, (prompt + response - 1, 4, 2)).astype(np.int64)
        experts[0, 0, 0] = experts_max  # the largest id decides the dtype
    return Sample(
        prompt_ids=rng.integers(0, 50_000, prompt).astype(I32),
        response_ids=rng.integers(0, 50_000, response).astype(I32),
        loss_mask=mask,
        logprobs=-rng.random(response).astype(F32),
        versions=np.where(mask == 1, 3, -1).astype(I32),
        routed_experts=experts,
        num_turns=2,
    )


def assert_same(a: Sample, b: Sample) -> None:
    for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"):
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert (a.num_turns, a.cancelled) == (b.num_turns, b.cancelled)
    if b.routed_experts is None:
        assert a.routed_experts is None
    else:
        assert a.routed_experts is not None and np.array_equal(a.routed_experts, b.routed_experts)


async def entries(client: Redis, stream: str = KEYS.trajectories) -> list[tuple[str, dict[str, str]]]:
    found = await client.xrange(stream)
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in found]


async def real_entries(client: Redis, store: TrajectoryStore) -> dict[str, str]:
    """session id -> entry id, for the entries the trainer treats as real (id == the meta's stream_id)."""
    real: dict[str, str] = {}
    for entry_id, fields in await entries(client):
        meta = await store.get_session(fields["session_id"])
        if meta is not None and meta.stream_id == entry_id:
            assert fields["session_id"] not in real, "two real entries for one session"
            real[fields["session_id"]] = entry_id
    return real


async def wait_for(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll a condition with a bounded deadline (a foreign process gives no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def with_a_sample(store: TrajectoryStore) -> SessionMeta:
    """A new session with one sample: one the finish delivers (an empty one it does not)."""
    meta = await store.create_session()
    await store.save_sample(meta.id, 0, make_sample())
    return meta


def make_store(client: Redis, **options: Any) -> TrajectoryStore:
    settings: dict[str, Any] = {
        "ttl_s": TTL_S,
        "session_idle_ttl_s": IDLE_S,
        "max_pending": 100,
        "retry_budget_s": 20.0,
        "sweep_interval_s": None,
        "durable_replicas": None,  # the gateway's default: WAIT for a replica on the cluster, none on one server
    }
    return TrajectoryStore(client, KEYS, **(settings | options))


@pytest.fixture
async def client(redis_url: str, redis: Redis) -> AsyncIterator[Redis]:
    """A client made as the gateway makes it (`connect`), on the flushed session server."""
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(client: Redis) -> AsyncIterator[TrajectoryStore]:
    store = make_store(client)
    yield store
    await store.aclose()


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[EmbeddedRedis]:
    async with EmbeddedRedis(data_dir=tmp_path / "redis", appendfsync="always") as server:
        yield server


@pytest.fixture
async def own_client(own_redis: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = connect(own_redis.url, socket_timeout_s=1.0)
    yield client
    await client.aclose()


# -- samples --------------------------------------------------------------------------------------------------


async def test_sample_round_trip_without_experts(store: TrajectoryStore, redis: Redis) -> None:
    meta = await store.create_session({"group_id": "g1", "task": 7})
    sample = make_sample()
    await store.save_sample(meta.id, 0, sample, replica="r1")

    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, sample)
    stored = await store.get_session(meta.id)
    assert stored is not None
    assert (stored.status, stored.sample_count, stored.replica, stored.group_id) == ("active", 1, "r1", "g1")
    assert stored.metadata == {"group_id": "g1", "task": 7}
    assert not await redis.hexists(KEYS.sample(meta.id, 0), "experts")


@pytest.mark.parametrize(("experts_max", "dtype"), [(200, np.uint8), (3_000, np.uint16)])
async def test_routed_experts_keep_the_smallest_dtype_and_samples_are_compact(
    store: TrajectoryStore, redis: Redis, experts_max: int, dtype: type[np.unsignedinteger[Any]]
) -> None:
    meta = await store.create_session()
    sample = make_sample(100, 2_000, experts_max=experts_max)
    await store.save_sample(meta.id, 0, sample)

    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, sample)
    assert loaded.routed_experts is not None and loaded.routed_experts.dtype == dtype
    assert loaded.routed_experts.shape == (2_099, 4, 2)

    key = KEYS.sample(meta.id, 0)
    itemsize = np.dtype(dtype).itemsize
    assert await redis.hstrlen(key, "experts") == 2_099 * 4 * 2 * itemsize
    assert await redis.hstrlen(key, "response_ids") == 2_000 * 4
    assert await redis.hstrlen(key, "loss_mask") == 2_000
    raw = 100 * 4 + 2_000 * (4 + 1 + 4 + 4) + 2_099 * 4 * 2 * itemsize
    usage = await redis.memory_usage(key, samples=0)  # every field, not an estimate from 5
    assert usage is not None and raw <= usage < raw * 1.3 + 2_048  # allocator rounding, not JSON's ~4x


async def test_saving_an_index_again_replaces_it_and_sample_count_tracks_the_max(
    store: TrajectoryStore, redis: Redis
) -> None:
    meta = await store.create_session()
    await store.save_sample(meta.id, 2, make_sample(experts_max=9, seed=1))
    await store.save_sample(meta.id, 0, make_sample(seed=2))
    newer = make_sample(response=12, seed=3)  # no experts: the old experts field must not linger
    await store.save_sample(meta.id, 2, newer)

    stored = await store.get_session(meta.id)
    assert stored is not None and stored.sample_count == 3
    samples = await store.load_samples(meta.id)
    assert len(samples) == 2  # index 1 was never written
    assert_same(samples[0], make_sample(seed=2))
    assert_same(samples[1], newer)
    assert not await redis.hexists(KEYS.sample(meta.id, 2), "experts")


async def test_unknown_and_malformed_sessions(store: TrajectoryStore) -> None:
    with pytest.raises(SessionNotFound):
        await store.save_sample("nope", 0, make_sample())
    with pytest.raises(SessionNotFound):
        await store.finish("nope")
    assert await store.get_session("nope") is None
    assert await store.load_samples("nope") == []
    with pytest.raises(InvalidRequest):
        await store.ensure_session("a{b}c")
    with pytest.raises(InvalidRequest):
        await store.save_sample((await store.create_session()).id, -1, make_sample())


async def test_ensure_session_creates_once_and_returns_the_existing_one(store: TrajectoryStore) -> None:
    first, second = await asyncio.gather(
        store.ensure_session("agent-1", {"group_id": "g"}), store.ensure_session("agent-1", {"group_id": "g"})
    )
    assert first.id == second.id == "agent-1"
    assert first.created_at == second.created_at
    assert (await store.ensure_session("agent-1", {"other": 1})).metadata == {"group_id": "g"}


async def test_a_buffered_write_for_a_session_that_ended_is_refused_loudly(
    store: TrajectoryStore, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    meta = await store.create_session()
    await store.finish(meta.id)
    # As if written during an outage, while another gateway process finished the session.
    store._buffer_write(_SampleWrite(meta.id, 0, make_sample(), "", time.time()))

    store.start()
    await wait_for(lambda: _true(store.buffered == 0))

    assert store.stats.writes_refused == 1 and "buffered write refused" in caplog.text
    assert not await redis.exists(KEYS.sample(meta.id, 0))


def test_settings_build_the_store(client: Redis) -> None:
    settings = Settings(store={"prefix": "x:", "max_pending": 7, "ttl_s": 60}, redis={"retry_budget_s": 3})
    store = TrajectoryStore.from_settings(client, settings.store, settings.redis, sweep_interval_s=None)
    assert (store.keys.prefix, store.max_pending, store.ttl_s, store.retry_budget_s) == ("x:", 7, 60, 3.0)
    assert store.session_idle_ttl_s == settings.store.session_idle_ttl_s


# -- finish -----------------------------------------------------------------------------------------------------


async def test_finish_twice_gives_one_stream_entry(store: TrajectoryStore, redis: Redis) -> None:
    meta = await store.create_session({"group_id": "g7"})
    await store.save_sample(meta.id, 0, make_sample())
    await store.save_sample(meta.id, 1, make_sample(seed=1))

    first = await store.finish(meta.id, 1.5, {"judge": "ok"})
    second = await store.finish(meta.id, 1.5)
    with pytest.raises(Conflict, match="finished with reward 1.5"):  # another reward: refused, not dropped
        await store.finish(meta.id, 0.0)

    assert first == second
    assert await entries(redis) == [(first, {"session_id": meta.id, "group_id": "g7", "reward": "1.5", "samples": "2"})]
    finished = await store.get_session(meta.id)
    assert finished is not None
    assert (finished.status, finished.reward, finished.stream_id) == ("finished", 1.5, first)
    assert finished.metadata == {"group_id": "g7", "judge": "ok"}
    assert finished.finished_at is not None
    assert await store.pending() == 1
    assert await redis.smembers(KEYS.undelivered) == set()
    assert await redis.zscore(KEYS.active_sessions, meta.id) is None
    with pytest.raises(Conflict):  # a delivered trajectory never changes
        await store.save_sample(meta.id, 0, make_sample(seed=9))
    with pytest.raises(Conflict):
        await store.ensure_session(meta.id)


async def _watches(client: Redis) -> int:
    """WATCH commands the server ran; on a cluster, every master's."""
    if isinstance(client, RedisCluster):
        per_node = await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(stats.get("cmdstat_watch", {}).get("calls", 0)) for stats in per_node.values())
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_watch", {}).get("calls", 0))


async def test_a_finish_without_metadata_skips_the_transaction_and_leaves_the_same_state(
    store: TrajectoryStore, redis: Redis
) -> None:
    plain, merged = [await store.create_session({"group_id": "g"}) for _ in range(2)]
    for meta in (plain, merged):
        for index in range(3):
            await store.save_sample(meta.id, index, make_sample(seed=index))

    watches = await _watches(redis)
    plain_entry = await store.finish(plain.id, 0.25)
    assert await _watches(redis) == watches, "the one-script finish ran no WATCHed transaction"
    merged_entry = await store.finish(merged.id, 0.25, {"judge": "ok"})
    assert await _watches(redis) > watches  # metadata to merge: the transaction, as before

    stored = {meta.id: await redis.hgetall(KEYS.meta(meta.id)) for meta in (plain, merged)}
    for fields in stored.values():
        for name in (b"created_at", b"updated_at", b"finished_at", b"revision", b"stream_id", b"metadata"):
            fields.pop(name)
    assert stored[plain.id] == stored[merged.id]
    assert stored[plain.id][b"status"] == b"finished" and stored[plain.id][b"reward"] == b"0.25"
    plain_meta = await store.get_session(plain.id)
    assert plain_meta is not None and plain_meta.metadata == {"group_id": "g"} and plain_meta.stream_id == plain_entry
    assert plain_meta.finished_at is not None and plain_meta.finished_at == plain_meta.updated_at
    for meta in (plain, merged):
        for key in (KEYS.meta(meta.id), *(KEYS.sample(meta.id, i) for i in range(3))):
            assert 0 < await redis.ttl(key) <= TTL_S, key
        assert await redis.zscore(KEYS.active_sessions, meta.id) is None
    assert [fields for _, fields in await entries(redis)] == [
        {"session_id": plain.id, "group_id": "g", "reward": "0.25", "samples": "3"},
        {"session_id": merged.id, "group_id": "g", "reward": "0.25", "samples": "3"},
    ]
    assert [entry for entry, _ in await entries(redis)] == [plain_entry, merged_entry]
    assert await store.pending() == 2
    assert await redis.smembers(KEYS.undelivered) == set()


async def test_a_named_session_is_created_once_without_a_transaction(store: TrajectoryStore, redis: Redis) -> None:
    watches = await _watches(redis)
    created = await store.ensure_session("agent-7", {"group_id": "g"})
    again, concurrent = await asyncio.gather(
        store.ensure_session("agent-7", {"other": 1}), store.ensure_session("agent-7", {"other": 2})
    )
    assert await _watches(redis) == watches, "created and found again by one script each, no WATCH"
    assert again.metadata == concurrent.metadata == {"group_id": "g"} and again.created_at == created.created_at
    assert await redis.zscore(KEYS.active_sessions, "agent-7") >= created.created_at  # indexed (and touched since)
    assert 0 < await redis.ttl(KEYS.meta("agent-7"))
    await store.finish("agent-7")
    with pytest.raises(Conflict):
        await store.ensure_session("agent-7")


async def test_a_finish_of_a_session_that_is_not_active_leaves_the_repair_set_as_it_was(
    store: TrajectoryStore, redis: Redis
) -> None:
    idle, done = await with_a_sample(store), await with_a_sample(store)
    await redis.zadd(KEYS.active_sessions, {idle.id: 0})
    await redis.hset(KEYS.meta(idle.id), "updated_at", 0)
    assert await store.abandon_idle() == [idle.id]
    entry = await store.finish(done.id)

    with pytest.raises(SessionNotFound):
        await store.finish("never-created")
    with pytest.raises(Conflict):
        await store.finish(idle.id)
    assert await store.finish(done.id) == entry  # finished before: the same entry, nothing added
    assert await redis.smembers(KEYS.undelivered) == set()
    assert len(await entries(redis)) == 1 and await store.pending() == 1
    assert not await redis.exists(KEYS.meta("never-created"))


async def test_concurrent_finishes_in_one_and_in_two_processes_give_one_entry(
    store: TrajectoryStore, client: Redis, redis: Redis
) -> None:
    other = make_store(client)  # a second gateway process on the same Redis
    one, two, three = [await with_a_sample(store) for _ in range(3)]

    same = await asyncio.gather(store.finish(one.id, 1.0), store.finish(one.id, 1.0))
    across = await asyncio.gather(store.finish(two.id, 1.0), other.finish(two.id, 1.0))
    # Other rewards for a session being finished, or finished: a 409, never dropped silently (issue 38 §6).
    differ = await asyncio.gather(store.finish(three.id, 1.0), other.finish(three.id, 2.0), return_exceptions=True)

    assert same[0] == same[1] and across[0] == across[1]
    [won] = [r for r in differ if isinstance(r, str)]
    [refused] = [r for r in differ if not isinstance(r, str)]
    assert isinstance(refused, Conflict) and refused.param == "reward"
    with pytest.raises(Conflict):
        await store.finish(one.id, 2.0)
    assert await real_entries(redis, store) == {one.id: same[0], two.id: across[0], three.id: won}
    assert await redis.xlen(KEYS.trajectories) == 3  # the loser of a stream_id claim deleted its entry
    assert await store.pending() == 3
    await other.aclose()


async def test_a_cancelled_caller_cannot_half_finish(store: TrajectoryStore, redis: Redis) -> None:
    meta = await with_a_sample(store)
    caller = asyncio.create_task(store.finish(meta.id, 1.0))
    await asyncio.sleep(0)  # one turn of the loop: the caller started the run and awaits it; the run has not begun
    running = store._finishing[meta.id]
    caller.cancel()

    entry_id = await running  # the shielded run went on without its caller
    assert caller.cancelled()
    assert await real_entries(redis, store) == {meta.id: entry_id}
    assert await store.finish(meta.id) == entry_id


async def _true(value: bool) -> bool:
    return value


async def test_a_crash_between_xadd_and_the_stream_id_claim_is_repaired(store: TrajectoryStore, redis: Redis) -> None:
    meta = await store.create_session()
    await store.save_sample(meta.id, 0, make_sample())
    # Steps (1)-(3) of finish, then the process "dies" before claiming `stream_id`.
    await redis.sadd(KEYS.undelivered, meta.id)
    finished = await store._mark_finished(meta.id, 0.5, None)
    orphan = await store._append_entry(finished)

    assert await store.repair_undelivered() == 1

    real = await real_entries(redis, store)
    assert list(real) == [meta.id] and real[meta.id] != orphan  # the orphan is skipped by consumers
    assert await store.pending() == 1
    assert await redis.smembers(KEYS.undelivered) == set()
    assert await store.finish(meta.id) == real[meta.id]
    assert await store.repair_undelivered() == 0


async def test_a_duplicate_entry_loses_the_claim_and_is_deleted(store: TrajectoryStore, redis: Redis) -> None:
    meta = await with_a_sample(store)
    entry_id = await store.finish(meta.id, 1.0)
    finished = await store.get_session(meta.id)
    assert finished is not None

    duplicate = await store._append_entry(finished)  # e.g. a second process that XADDed concurrently
    assert await store._claim_entry(meta, duplicate) == entry_id

    assert [e for e, _ in await entries(redis)] == [entry_id]
    assert await store.pending() == 1
    assert store.stats.duplicate_entries == 1


async def test_a_claim_on_a_session_a_failover_took_back_to_active_is_refused_and_the_finish_redone(
    store: TrajectoryStore, redis: Redis
) -> None:
    """A failover can lose a finish's step (2) (the session active again on the promoted replica) while its entry
    and claim go to the new master: the claim must not make an active session's entry real (its reward and status
    lost); it is refused, and the finish, retried, finishes the session again before it claims."""
    meta = await with_a_sample(store)
    entry_id = await store._append_entry(meta)  # as if step (2) had been written, then lost
    with pytest.raises(StoreError, match="NOTFINISHED"):
        await store._claim_entry(meta, entry_id)
    assert (await store.get_session(meta.id)).stream_id is None  # type: ignore[union-attr]
    real = await store.finish(meta.id, 0.25)
    finished = await store.get_session(meta.id)
    assert finished is not None and finished.status == "finished" and finished.reward == 0.25
    assert finished.stream_id == real != entry_id


async def test_repair_confirms_or_forgets_what_the_undelivered_set_holds(store: TrajectoryStore, redis: Redis) -> None:
    delivered, in_progress, gone = await with_a_sample(store), await with_a_sample(store), "expired-session"
    entry_id = await store.finish(delivered.id)
    # A crash after the claim but before SREM; a finish that has not marked its session yet; an expired meta.
    await redis.sadd(KEYS.undelivered, delivered.id, in_progress.id, gone)

    assert await store.repair_undelivered() == 1

    assert await redis.smembers(KEYS.undelivered) == {in_progress.id.encode()}
    assert [e for e, _ in await entries(redis)] == [entry_id]  # nothing delivered twice
    assert await store.pending() == 1


async def test_the_periodic_sweeper_repairs_and_abandons(client: Redis, redis: Redis) -> None:
    store = make_store(client, sweep_interval_s=0.05, repair_grace_s=0.0)
    interrupted, idle = await with_a_sample(store), await with_a_sample(store)
    await redis.sadd(KEYS.undelivered, interrupted.id)
    await store._mark_finished(interrupted.id, None, None)  # a finish that died before XADD
    await redis.zadd(KEYS.active_sessions, {idle.id: 0})
    await redis.hset(KEYS.meta(idle.id), "updated_at", 0)

    store.start()
    await wait_for(lambda: _true(store.stats.repaired == 1 and store.stats.abandoned == 1))

    assert list(await real_entries(redis, store)) == [interrupted.id]
    assert [fields["session_id"] for _, fields in await entries(redis, KEYS.abandoned)] == [idle.id]
    await store.aclose()


async def test_repair_leaves_recent_finishes_to_their_own_finish(store: TrajectoryStore, redis: Redis) -> None:
    meta = await with_a_sample(store)
    await redis.sadd(KEYS.undelivered, meta.id)
    await store._mark_finished(meta.id, None, None)

    assert await store.repair_undelivered(older_than_s=60) == 0
    assert await store.repair_undelivered() == 1
    assert list(await real_entries(redis, store)) == [meta.id]


# -- backpressure and idle sessions -----------------------------------------------------------------------------


async def test_backpressure_refuses_new_sessions_only(client: Redis, redis: Redis) -> None:
    store = make_store(client, max_pending=2, retry_after_s=3.0)
    first, second, ongoing = [await with_a_sample(store) for _ in range(3)]
    await store.finish(first.id)
    await store.finish(second.id)

    with pytest.raises(Overloaded) as refused:
        await with_a_sample(store)
    assert refused.value.retry_after_s > 0
    with pytest.raises(Overloaded):
        await store.ensure_session("brand-new")

    assert (await store.ensure_session(ongoing.id)).id == ongoing.id  # existing sessions go on
    await store.save_sample(ongoing.id, 0, make_sample())
    await store.finish(ongoing.id, 1.0)
    assert await store.pending() == 3

    await redis.srem(KEYS.pending, first.id, second.id)  # the trainer acknowledged two trajectories
    assert (await with_a_sample(store)).status == "active"
    await store.aclose()


async def test_idle_sessions_are_abandoned_and_never_delivered(store: TrajectoryStore, redis: Redis) -> None:
    idle, fresh, done = await store.create_session({"group_id": "g"}), await with_a_sample(store), None
    done = await with_a_sample(store)
    await store.save_sample(idle.id, 0, make_sample())
    await store.finish(done.id)
    await redis.zadd(KEYS.active_sessions, {fresh.id: 0})  # a stale index entry; the meta says it is fresh
    later = time.time() + IDLE_S + 1
    await redis.hset(KEYS.meta(fresh.id), "updated_at", later)

    assert await store.abandon_idle(now=later) == [idle.id]
    assert await store.abandon_idle(now=later) == []  # idempotent

    meta = await store.get_session(idle.id)
    assert meta is not None and meta.status == "abandoned"
    recorded = await entries(redis, KEYS.abandoned)
    assert [fields["session_id"] for _, fields in recorded] == [idle.id]
    assert [fields["session_id"] for _, fields in await entries(redis)] == [done.id]
    assert await redis.zscore(KEYS.active_sessions, idle.id) is None
    assert await redis.zscore(KEYS.active_sessions, fresh.id) == pytest.approx(later)
    assert 0 < await redis.ttl(KEYS.meta(idle.id)) <= TTL_S
    assert 0 < await redis.ttl(KEYS.sample(idle.id, 0)) <= TTL_S
    with pytest.raises(Conflict):
        await store.finish(idle.id)
    with pytest.raises(Conflict):
        await store.save_sample(idle.id, 1, make_sample())
    assert await store.pending() == 1


async def test_every_session_key_has_a_ttl(store: TrajectoryStore, redis: Redis) -> None:
    active, finished, abandoned = [await store.create_session() for _ in range(3)]
    for meta in (active, finished, abandoned):
        await store.save_sample(meta.id, 0, make_sample(experts_max=5))
    await store.finish(finished.id)
    await redis.zadd(KEYS.active_sessions, {abandoned.id: 0})
    await redis.hset(KEYS.meta(abandoned.id), "updated_at", 0)
    assert await store.abandon_idle() == [abandoned.id]

    names = {key.decode() async for key in redis.scan_iter()}
    session_keys = names - GLOBAL_KEYS
    assert len(session_keys) == 6
    for key in session_keys:
        limit = IDLE_S + TTL_S if f"{{{active.id}}}" in key else TTL_S
        assert 0 < await redis.ttl(key) <= limit, key
    for key in names & GLOBAL_KEYS:
        assert await redis.ttl(key) == -1, key  # indexes, streams and the counter persist by design


# -- Redis restarts and outages (own server) ---------------------------------------------------------------------


async def test_redis_killed_during_a_run_loses_no_acknowledged_trajectory(
    own_redis: EmbeddedRedis, own_client: Redis
) -> None:
    store = make_store(own_client)
    sessions = [await store.create_session({"group_id": "g"}) for _ in range(8)]
    for seed, meta in enumerate(sessions):
        await store.save_sample(meta.id, 0, make_sample(experts_max=40, seed=seed))
    finishing = [asyncio.create_task(store.finish(meta.id, 1.0)) for meta in sessions]
    await asyncio.wait(finishing, return_when=asyncio.FIRST_COMPLETED)

    own_redis.kill()  # a crash in the middle of the finishes
    await own_redis.arestart()
    acknowledged = dict(zip((m.id for m in sessions), await asyncio.gather(*finishing), strict=True))

    assert await real_entries(own_client, store) == acknowledged
    for seed, meta in enumerate(sessions):
        [sample] = await store.load_samples(meta.id)
        assert_same(sample, make_sample(experts_max=40, seed=seed))
    # At most once per real entry: an INCR cut by the kill may be lost (undercount), never resent (overcount).
    assert await store.pending() <= len(sessions)
    later = await store.create_session()  # new writes work on the reconnected client
    await store.save_sample(later.id, 0, make_sample())
    assert await store.finish(later.id) in {e for e, _ in await entries(own_client)}
    await store.aclose()


async def test_writes_during_an_outage_are_buffered_then_flushed(own_redis: EmbeddedRedis, own_client: Redis) -> None:
    store = make_store(own_client)
    store.start()
    meta = await store.create_session()
    await store.save_sample(meta.id, 0, make_sample())

    own_redis.kill()
    await store.save_sample(meta.id, 1, make_sample(seed=1))  # does not raise: buffered
    newest = make_sample(response=20, seed=2)
    await store.save_sample(meta.id, 1, newest)  # replaces the buffered version
    await store.save_sample(meta.id, 2, make_sample(seed=3))  # Redis is known down: buffered at once
    assert store.buffered == 2

    await own_redis.arestart()

    async def flushed() -> bool:
        return await own_client.exists(KEYS.sample(meta.id, 1), KEYS.sample(meta.id, 2)) == 2

    await wait_for(flushed)
    await wait_for(lambda: _true(store.buffered == 0))
    assert_same((await store.load_samples(meta.id))[1], newest)
    stored = await store.get_session(meta.id)
    assert stored is not None and stored.sample_count == 3
    await store.aclose()


async def test_an_extending_write_buffered_in_an_outage_is_flushed_whole(
    own_redis: EmbeddedRedis, own_client: Redis
) -> None:
    """A buffered write may land on a server that lost what it extended (a restart without the last second of
    AOF), or after other writes of the sample: it is kept and sent as the whole sample."""
    store = make_store(own_client)
    store.start()
    meta = await store.create_session()
    first = make_sample(prompt=6, response=10, experts_max=100)
    saved = await store.save_sample(meta.id, 0, first)
    assert saved is not None

    own_redis.kill()
    later = extended(first, 7, experts_max=100, seed=1)
    assert await store.save_sample(meta.id, 0, later, stored=saved.stored) is None  # buffered
    await own_redis.arestart()
    await wait_for(lambda: _true(store.buffered == 0))
    assert await own_client.hget(KEYS.sample(meta.id, 0), "chunk_ends") == b"17:22"
    assert_same((await store.load_samples(meta.id))[0], later)
    await store.aclose()


async def test_finish_during_an_outage_waits_for_redis_and_flushes_first(
    own_redis: EmbeddedRedis, own_client: Redis
) -> None:
    store = make_store(own_client, max_buffered_writes=1)  # no flusher: finish itself writes the buffer
    meta = await store.create_session()
    await store.save_sample(meta.id, 0, make_sample())

    own_redis.kill()
    await store.save_sample(meta.id, 1, make_sample(seed=1))
    with pytest.raises(StoreError, match="buffered"):  # the buffer is full: fail loudly, drop nothing
        await store.save_sample(meta.id, 2, make_sample(seed=2))
    finishing = asyncio.create_task(store.finish(meta.id, 2.0))
    await wait_for(lambda: _true(store.stats.finish_retries >= 1))
    assert not finishing.done()

    await own_redis.arestart()
    entry_id = await finishing

    assert await entries(own_client) == [
        (entry_id, {"session_id": meta.id, "group_id": "", "reward": "2.0", "samples": "2"})
    ]
    assert len(await store.load_samples(meta.id)) == 2
    assert store.buffered == 0
    await store.aclose()


async def test_finish_gives_up_after_the_retry_budget(
    own_redis: EmbeddedRedis, own_client: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(own_client, retry_budget_s=0.5)
    meta = await with_a_sample(store)

    own_redis.kill()
    with pytest.raises(StoreError, match="retry budget"):
        await store.finish(meta.id)
    await store.save_sample(meta.id, 0, make_sample())  # buffered
    await store._count_pending(meta.id)  # counting never raises: the delivery it counts is already done
    assert "undercounts by one" in caplog.text
    with caplog.at_level(logging.ERROR, logger="gateway.store"):
        await store.aclose(drain_timeout_s=0.2)  # shutting down while Redis is away: the loss is loud
    assert "1 sample writes Redis never took" in caplog.text

    await own_redis.arestart()
    later = make_store(own_client)
    entry_id = await later.finish(meta.id)  # nothing was half-done that a later finish cannot complete
    assert await real_entries(own_client, later) == {meta.id: entry_id}
    await later.aclose()


def extended(sample: Sample, more: int, *, experts_max: int, seed: int) -> Sample:
    """`sample` with `more` response tokens and their routed experts appended (a later turn of it)."""
    rng = np.random.default_rng(seed)
    assert sample.routed_experts is not None
    rows = rng.integers(0, experts_max + 1, (more, *sample.routed_experts.shape[1:]))
    return Sample(
        prompt_ids=sample.prompt_ids,
        response_ids=np.concatenate([sample.response_ids, rng.integers(0, 50_000, more).astype(I32)]),
        loss_mask=np.concatenate([sample.loss_mask, np.ones(more, U8)]),
        logprobs=np.concatenate([sample.logprobs, -rng.random(more).astype(F32)]),
        versions=np.concatenate([sample.versions, np.full(more, 4, I32)]),
        routed_experts=np.concatenate([sample.routed_experts, rows]),
        num_turns=sample.num_turns + 1,
    )


async def test_a_sample_extended_turn_after_turn_sends_only_what_it_added(store: TrajectoryStore, redis: Redis) -> None:
    meta = await store.create_session()
    key = KEYS.sample(meta.id, 0)
    first = make_sample(prompt=6, response=10, experts_max=100)
    saved = await store.save_sample(meta.id, 0, first)
    assert saved is not None and saved.stored.ends == ((10, 15),)
    second = extended(first, 7, experts_max=100, seed=1)
    partial = extended(first, 3, experts_max=100, seed=2)  # a segment boundary of the second turn, first
    assert (await store.save_sample(meta.id, 0, partial, stored=saved.stored)) is not None
    again = await store.save_sample(meta.id, 0, second, stored=saved.stored)
    assert again is not None and again.stored.ends == ((10, 15), (17, 22))
    assert again.revision == saved.revision + 2
    row = 4 * 2  # bytes of one position's experts (uint8)
    assert await redis.hstrlen(key, "experts") == 15 * row and await redis.hstrlen(key, "experts.1") == 7 * row
    assert await redis.hstrlen(key, "response_ids") == 10 * 4 and await redis.hstrlen(key, "response_ids.1") == 7 * 4
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, second)

    third = extended(second, 5, experts_max=100, seed=3)
    done = await store.save_sample(meta.id, 0, third, stored=again.stored)
    assert done is not None and done.stored.ends == ((10, 15), (17, 22), (22, 27))
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, third)

    # What the hash holds is not what the writer believes (another writer, a lost write): the sample goes whole.
    fourth = extended(third, 2, experts_max=100, seed=4)
    believed = dataclasses.replace(done.stored, ends=((10, 15), (17, 23)))
    whole = await store.save_sample(meta.id, 0, fourth, stored=believed)
    assert whole is not None and whole.stored.ends == ((24, 29),)
    assert not await redis.hexists(key, "experts.1") and not await redis.hexists(key, "logprobs.2")
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, fourth)

    # New ids the stored dtype cannot hold: the sample goes whole, in the wider dtype.
    wider = extended(fourth, 2, experts_max=300, seed=5)
    assert wider.routed_experts is not None
    wider.routed_experts[-1, 0, 0] = 300
    widened = await store.save_sample(meta.id, 0, wider, stored=whole.stored)
    assert widened is not None
    assert widened.stored.ends == ((26, 31),) and widened.stored.experts_dtype == np.dtype(np.uint16).str
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, wider)


async def test_a_sample_without_routed_experts_is_extended_too_until_it_gains_them(
    store: TrajectoryStore, redis: Redis
) -> None:
    meta = await store.create_session()
    key = KEYS.sample(meta.id, 0)
    first = make_sample(prompt=6, response=10, experts_max=100)
    plain = dataclasses.replace(first, routed_experts=None)
    saved = await store.save_sample(meta.id, 0, plain)
    assert saved is not None and saved.stored == StoredChunks(((10, 0),), None)
    longer = dataclasses.replace(extended(first, 4, experts_max=100, seed=1), routed_experts=None)
    again = await store.save_sample(meta.id, 0, longer, stored=saved.stored)
    assert again is not None and again.stored.ends == ((10, 0), (14, 0))
    assert await redis.hstrlen(key, "loss_mask.1") == 4 and not await redis.hexists(key, "experts")
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, longer)

    gained = extended(first, 4, experts_max=100, seed=1)  # the same tokens, now with their experts: whole
    whole = await store.save_sample(meta.id, 0, gained, stored=again.stored)
    assert whole is not None and whole.stored.ends == ((14, 19),) and not await redis.hexists(key, "loss_mask.1")
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, gained)


async def test_a_partial_write_leaves_the_stored_conversation_out_and_the_hash_keeps_it(
    store: TrajectoryStore, redis: Redis
) -> None:
    """A write at a segment boundary extends a sample whose conversation is stored already: it sends only the new
    tokens and scalars; a turn's end sends its new conversation, and a sample without tools clears stored ones."""
    meta = await store.create_session()
    key = KEYS.sample(meta.id, 0)
    chat = [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    first = dataclasses.replace(make_sample(prompt=6, response=10, experts_max=100), conversation=chat, tools=tools)
    saved = await store.save_sample(meta.id, 0, first)
    assert saved is not None

    partial = dataclasses.replace(extended(first, 3, experts_max=100, seed=1), conversation=chat, tools=tools)
    partial.conversation_stored = True
    fields, _ = partial.to_redis_extending(saved.stored) or ({}, None)
    assert "response_ids.1" in fields and "conversation" not in fields and "tools" not in fields
    assert await store.save_sample(meta.id, 0, partial, stored=saved.stored) is not None
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, partial)
    assert loaded.conversation == chat and loaded.tools == tools

    longer = [*chat, {"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]
    final = dataclasses.replace(extended(first, 7, experts_max=100, seed=2), conversation=longer, tools=None)
    done = await store.save_sample(meta.id, 0, final, stored=saved.stored)
    assert done is not None and done.stored.ends == ((10, 15), (17, 22))
    assert await redis.hexists(key, "conversation")
    [loaded] = await store.load_samples(meta.id)
    assert_same(loaded, final)
    assert loaded.conversation == longer and loaded.tools is None


def turn_of(sample: Sample, conversation: list[dict[str, Any]], seed: int) -> Sample:
    """The next turn of `sample` (4 more tokens) with its conversation as the turn's end records it."""
    return dataclasses.replace(extended(sample, 4, experts_max=100, seed=seed), conversation=conversation)


async def test_a_conversation_extended_turn_after_turn_sends_only_its_new_messages(
    store: TrajectoryStore, redis: Redis
) -> None:
    """Each turn's end appends its messages as one more chunk; a turn that changes an earlier message (an agent
    that resends the history otherwise) writes the conversation whole and empties the later chunks."""
    meta = await store.create_session()
    key = KEYS.sample(meta.id, 0)
    history = [{"role": "system", "content": "s" * 3000}, {"role": "user", "content": "q1"}]
    first = dataclasses.replace(make_sample(prompt=6, response=10, experts_max=100), conversation=history)
    saved = await store.save_sample(meta.id, 0, first)
    assert saved is not None
    whole = await redis.hstrlen(key, "conversation")
    stored = saved.stored
    for turn in range(1, 4):
        history = [*history, {"role": "assistant", "content": f"a{turn}"}, {"role": "user", "content": f"q{turn}"}]
        first = turn_of(first, history, seed=turn)
        done = await store.save_sample(meta.id, 0, first, stored=stored)
        assert done is not None
        stored = done.stored
        assert await redis.hstrlen(key, "conversation") == whole  # chunk 0 as first written
        assert 0 < await redis.hstrlen(key, f"conversation.{turn}") < 100  # two short messages
        [loaded] = await store.load_samples(meta.id)
        assert loaded.conversation == history
        assert_same(loaded, first)

    edited = [{**history[0], "content": "t" * 3000}, *history[1:], {"role": "assistant", "content": "a4"}]
    last = turn_of(first, edited, seed=9)
    done = await store.save_sample(meta.id, 0, last, stored=stored)
    assert done is not None and done.stored.messages == tuple(edited)
    assert [await redis.hget(key, f"conversation.{k}") for k in range(1, 5)] == [b"[]"] * 4
    [loaded] = await store.load_samples(meta.id)
    assert loaded.conversation == edited


async def test_a_turn_written_again_from_the_same_start_replaces_its_messages(
    store: TrajectoryStore, redis: Redis
) -> None:
    """Writes of one turn all extend what was stored when it began: the last one's messages stand, and a write at a
    segment boundary (conversation already stored) empties the turn's chunk instead of leaving another's there."""
    meta = await store.create_session()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first = dataclasses.replace(make_sample(prompt=6, response=10, experts_max=100), conversation=chat)
    saved = await store.save_sample(meta.id, 0, first)
    assert saved is not None
    one = turn_of(first, [*chat, {"role": "user", "content": "one"}], seed=1)
    assert await store.save_sample(meta.id, 0, one, stored=saved.stored) is not None
    other = turn_of(first, [*chat, {"role": "user", "content": "other"}], seed=2)
    assert await store.save_sample(meta.id, 0, other, stored=saved.stored) is not None
    [loaded] = await store.load_samples(meta.id)
    assert loaded.conversation == other.conversation

    partial = turn_of(first, chat, seed=3)
    partial.conversation_stored = True
    assert await store.save_sample(meta.id, 0, partial, stored=saved.stored) is not None
    [loaded] = await store.load_samples(meta.id)
    assert loaded.conversation == chat

    # Two turns further on, a write from the first turn's start again (its answer lost, say): the chunks past it go.
    two = await store.save_sample(meta.id, 0, one, stored=saved.stored)
    assert two is not None
    three = turn_of(one, [*one.conversation, {"role": "user", "content": "three"}], seed=4)
    done = await store.save_sample(meta.id, 0, three, stored=two.stored)
    assert done is not None
    four = turn_of(three, [*three.conversation, {"role": "user", "content": "four"}], seed=5)
    assert await store.save_sample(meta.id, 0, four, stored=done.stored) is not None
    again = turn_of(one, [*one.conversation, {"role": "user", "content": "again"}], seed=6)
    assert await store.save_sample(meta.id, 0, again, stored=two.stored) is not None
    [loaded] = await store.load_samples(meta.id)
    assert loaded.conversation == again.conversation
    assert not await redis.hexists(KEYS.sample(meta.id, 0), "conversation.3")


async def test_a_sample_another_process_wrote_meanwhile_is_kept_and_the_later_turn_moves(
    client: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Turns of one session on two processes at once: each write replaces only what its own turn or the turn it
    extends wrote; the later one moves to the first free index, and the rest of its turn's writes follow it."""
    caplog.set_level(logging.INFO, logger="gateway.store")
    here, there = make_store(client), make_store(client)  # one store per process
    meta = await here.create_session()
    first = make_sample(prompt=6, response=10, experts_max=100)
    saved = await here.save_sample(meta.id, 0, first, writer="t1")
    assert saved is not None and saved.index == 0
    theirs = extended(first, 3, experts_max=100, seed=1)
    partial = extended(first, 2, experts_max=100, seed=2)  # a segment boundary of this process's turn
    mine = extended(partial, 2, experts_max=100, seed=3)

    won = await there.save_sample(meta.id, 0, theirs, stored=saved.stored, writer="t2", base="t1")
    assert won is not None and won.index == 0
    moved = await here.save_sample(meta.id, 0, partial, stored=saved.stored, writer="t3", base="t1")
    assert moved is not None and moved.index == 1 and moved.stored.ends == ((12, 17),)  # whole, at the free index
    last = await here.save_sample(meta.id, 0, mine, stored=saved.stored, writer="t3", base="t1")
    assert last is not None and last.index == 1 and last.revision == won.revision + 2
    assert "not stored as the writer believed" not in caplog.text  # written whole at once, not tried extending
    kept, branch = await there.load_samples(meta.id)
    assert_same(kept, theirs)
    assert_same(branch, mine)
    assert (kept.writer, branch.writer) == ("t2", "t3")
    assert (here.stats.samples_moved, there.stats.samples_moved) == (1, 0)

    # Two new samples at once: the second goes to the next free index.
    a = await here.save_sample(meta.id, 2, make_sample(seed=7), writer="t4")
    b = await there.save_sample(meta.id, 2, make_sample(seed=8), writer="t5")
    assert a is not None and b is not None and (a.index, b.index) == (2, 3)
    # A turn extends what it read: a base that is not the last writer moves it too (t4 wrote sample 2 last).
    c = await there.save_sample(meta.id, 2, make_sample(seed=9), writer="t6", base="t5")
    assert c is not None and c.index == 4
    samples = await here.load_samples(meta.id)
    assert [s.writer for s in samples] == ["t2", "t3", "t4", "t5", "t6"]
    await here.aclose()
    await there.aclose()


async def test_consecutive_turns_buffered_in_an_outage_land_in_place(
    own_redis: EmbeddedRedis, own_client: Redis
) -> None:
    """A buffered write that replaces its buffered predecessor extends what that one extended: no false move."""
    store = make_store(own_client)
    store.start()
    meta = await store.create_session()
    first = make_sample(prompt=6, response=10, experts_max=100)
    saved = await store.save_sample(meta.id, 0, first, writer="t1")
    assert saved is not None

    own_redis.kill()
    second = extended(first, 3, experts_max=100, seed=1)
    third = extended(second, 2, experts_max=100, seed=2)
    assert await store.save_sample(meta.id, 0, second, stored=saved.stored, writer="t2", base="t1") is None
    assert await store.save_sample(meta.id, 0, third, writer="t3", base="t2") is None  # replaces it, unsent
    await own_redis.arestart()
    await wait_for(lambda: _true(store.buffered == 0))
    [stored] = await store.load_samples(meta.id)
    assert_same(stored, third)
    assert stored.writer == "t3" and store.stats.samples_moved == 0
    await store.aclose()


async def test_an_empty_session_is_finished_but_not_delivered_unless_a_group_needs_it(
    store: TrajectoryStore, redis: Redis
) -> None:
    """Issue 38 §7: sessions created and finished with no sample were delivered and counted toward `max_pending`
    (200 of them in 0.3 s refused every new session with 429). One in a group is delivered: the group needs it."""
    empty = await store.create_session()
    member = await store.create_session({"group_id": "g", "group_size": 2, "group_index": 0})
    assert await store.finish(empty.id, 1.0) == "" == await store.finish(empty.id, 1.0)
    finished = await store.get_session(empty.id)
    assert finished is not None and finished.status == "finished" and finished.stream_id is None
    delivered = await store.finish(member.id, 0.0)
    summary = {"session_id": member.id, "group_id": "g", "reward": "0.0", "samples": "0"}
    assert await entries(redis) == [(delivered, summary)]
    assert await store.pending() == 1 and await redis.smembers(KEYS.undelivered) == set()
