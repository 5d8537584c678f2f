"""The store's and the trainer's Lua scripts after the server forgot them (SCRIPT FLUSH, as a restart does): every
path that runs a script by SHA, in a batched pipeline or directly, loads it again and answers as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from gateway.errors import Conflict
from gateway.store import Keys, Pausing, TrajectoryStore, WeightsBus, connect
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import F32, I32, U8, Sample

KEYS = Keys("scripts:")


def make_sample(response: int = 4) -> Sample:
    return Sample(
        prompt_ids=np.arange(3, dtype=I32),
        response_ids=np.arange(response, dtype=I32),
        logprobs=np.zeros(response, F32),
        loss_mask=np.ones(response, U8),
        versions=np.zeros(response, I32),
    )


@pytest.fixture
async def client(redis_url: str, redis: Redis) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(client: Redis) -> AsyncIterator[TrajectoryStore]:
    store = TrajectoryStore(client, KEYS, sweep_interval_s=None)
    yield store
    await store.aclose()


async def test_a_session_lives_through_forgotten_scripts(store: TrajectoryStore, redis: Redis) -> None:
    await redis.script_flush()
    created = await store.ensure_session("forgetful", {"group_id": "g"})  # the creation script
    await redis.script_flush()
    assert (await store.ensure_session("forgetful")).created_at == created.created_at  # the touch script
    await redis.script_flush()
    saved = await store.save_sample("forgetful", 0, make_sample(), writer="t1")  # the sample script
    assert saved is not None and saved.index == 0 and saved.revision == 1
    await redis.script_flush()
    taken = await store.save_sample("forgetful", 0, make_sample(6), writer="t2")  # another turn: it moves
    assert taken is not None and taken.index == 1
    await redis.script_flush()
    entry_id = await store.finish("forgetful", 1.0)  # the stream_id claim
    assert (await store.get_session("forgetful")).stream_id == entry_id  # type: ignore[union-attr]
    assert [s.response_ids.size for s in await store.load_samples("forgetful")] == [4, 6]


async def test_a_refused_write_answers_the_session_status(store: TrajectoryStore, redis: Redis) -> None:
    meta = await store.create_session()
    await store.finish(meta.id)
    await redis.script_flush()
    with pytest.raises(Conflict, match="is finished"):
        await store.save_sample(meta.id, 0, make_sample())


async def test_the_weights_lock_taken_again_by_its_holder_is_kept_and_refused_to_others(client: Redis) -> None:
    """A client that resends the lock's command after a lost reply (a failover) finds the lock its own, not taken."""
    bus, other = WeightsBus(client, KEYS, origin="here"), WeightsBus(client, KEYS, origin="there")
    assert await bus.acquire("token", ttl_s=10)
    assert await bus.acquire("token", ttl_s=10)  # the resent command
    assert not await other.acquire("other-token", ttl_s=10)
    await other.release("other-token")  # not its lock: kept
    assert not await other.acquire("other-token", ttl_s=10)
    await bus.release("token")
    assert await other.acquire("other-token", ttl_s=10)
    await other.release("other-token")


async def test_the_weights_lock_of_a_process_whose_heartbeat_expired_is_taken_over_once(client: Redis) -> None:
    """A gateway SIGKILLed while it coordinates an update leaves its lock for `update_timeout_s` + 30 s: once its
    membership expired `grace_s` ago, the next process to ask takes it over (one of two asking at once), not before."""
    dead, first, second = (WeightsBus(client, KEYS, origin=name) for name in ("dead", "first", "second"))
    for bus in (dead, first, second):
        await bus.join(ttl_s=10)
    held = dead.new_token()
    assert dead.holder_of(held) == "dead" and dead.holder_of("token") is None
    assert await dead.acquire(held, ttl_s=600)
    assert not await first.acquire(first.new_token(), ttl_s=600)  # alive: refused
    await dead.join(ttl_s=-1)  # its membership expired a second ago: not yet taken for dead
    assert not await dead.alive("dead") and await dead.alive("dead", grace_s=10)
    assert not await first.acquire(first.new_token(), ttl_s=600, grace_s=10)
    await dead.join(ttl_s=-11)  # ... and 11 s ago
    assert await first.alive("first")
    tokens = [first.new_token(), second.new_token()]
    taken = await asyncio.gather(
        *(bus.acquire(t, ttl_s=600, grace_s=10) for bus, t in zip((first, second), tokens, strict=True))
    )
    assert sorted(taken) == [False, True]
    winner = tokens[taken.index(True)]
    assert await first.holder() == winner
    assert not await first.take_over(held, first.new_token(), ttl_s=600)  # `held` no longer holds it
    await first.release(winner)
    await second.release(winner)
    assert await first.holder() is None


async def test_the_weights_lock_says_which_update_holds_it(client: Redis, redis: Redis) -> None:
    """A process that missed an update's `pausing` (it started, or resubscribed, mid-update) reads it beside the lock:
    written, taken over and released with it by one script, in the lock's slot on a cluster. A lock taken bare (by
    an older gateway, whose release left this release's record behind) reads as an out-of-band pause."""
    for prefix in ("rg:", "elsewhere", "{app}rg:"):
        keys = Keys(prefix)
        assert key_slot(keys.weights_lock.encode()) == key_slot(keys.weights_update.encode()), prefix
    bus, other = WeightsBus(client, KEYS, origin="here"), WeightsBus(client, KEYS, origin="there")
    assert await bus.update_under_way() is None
    token = bus.new_token()
    assert await bus.acquire(token, ttl_s=10, update=Pausing(3, "wait", token))
    assert await other.update_under_way() == Pausing(3, "wait", token)
    assert await redis.pttl(KEYS.weights_update) > 0  # it expires with the lock
    taken = other.new_token()
    assert await other.take_over(token, taken, ttl_s=10, update=Pausing(2, "abort", taken))
    assert await bus.update_under_way() == Pausing(2, "abort", taken)
    await other.release(taken)
    assert await bus.update_under_way() is None and not await redis.exists(KEYS.weights_update)
    assert await bus.acquire(token, ttl_s=10)  # taken with nothing to say: no record
    assert await bus.update_under_way() == Pausing(None, "abort", token)
    await bus.release(token)
    assert await bus.acquire(token, ttl_s=10, update=Pausing(3, "wait", token))
    await redis.delete(KEYS.weights_lock)  # an older gateway's release, and its lock
    await redis.set(KEYS.weights_lock, "old.gateway", px=10_000)
    assert await bus.update_under_way() == Pausing(None, "abort", "old.gateway")


async def test_the_weights_lock_and_the_trainer_touch_after_a_flush(
    client: Redis, redis: Redis, redis_url: str, store: TrajectoryStore
) -> None:
    bus = WeightsBus(client, KEYS, origin="here")
    assert await bus.acquire("token", ttl_s=10)
    await redis.script_flush()
    await bus.release("token")
    assert not await redis.exists(KEYS.weights_lock)

    meta = await store.create_session()
    await store.save_sample(meta.id, 0, make_sample())
    await store.finish(meta.id)
    async with TrajectoryConsumer(redis_url, "g", "c", prefix=KEYS.prefix) as consumer:
        first = await consumer.next_batch(1, timeout=1.0)
        await redis.script_flush()
        again = await consumer.next_batch(1, timeout=0.0)  # refreshes the entry handed out: the touch script
        assert len(first) == 1 and len(again) == 0
        assert await consumer.ack(first) == 1
