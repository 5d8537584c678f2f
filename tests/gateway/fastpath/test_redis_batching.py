"""Auto-pipelining (`gateway.fastpath.redis_batching`) against a real redis-server: callers that arrive while a pipeline
is in flight share the next one, each gets exactly its own replies, and failures and cancellations stay with their
callers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.embedded_redis import EmbeddedRedis
from gateway.fastpath.redis_batching import Build, PipelineBatcher
from gateway.store import Keys, TrajectoryStore, connect
from gateway.trajectory import Sample


def set_and_get(key: str, value: str) -> Build:
    def build(pipe: Pipeline) -> None:
        pipe.set(key, value)
        pipe.get(key)
        pipe.incr("counter")

    return build


async def test_callers_that_arrive_together_share_one_pipeline_and_get_their_own_replies(redis: Redis) -> None:
    batcher = PipelineBatcher(redis)
    replies = await asyncio.gather(*(batcher.execute(set_and_get(f"k{i}", f"v{i}")) for i in range(50)))
    # The first caller finds Redis idle and goes alone; the 49 others queued behind it and went in one pipeline.
    assert (batcher.pipelines, batcher.calls) == (2, 50)
    for i, (was_set, value, _) in enumerate(replies):
        assert was_set is True and value == f"v{i}".encode()
    assert sorted(counter for _, _, counter in replies) == list(range(1, 51))  # each INCR seen by its own caller


async def test_queued_callers_are_sent_in_arrival_order_in_batches_of_at_most_max_batch(redis: Redis) -> None:
    batcher = PipelineBatcher(redis, max_batch=4)

    def push(item: int) -> Build:
        def build(pipe: Pipeline) -> None:
            pipe.rpush("order", item)

        return build

    await asyncio.gather(*(batcher.execute(push(i)) for i in range(10)))
    assert [int(x) for x in await redis.lrange("order", 0, -1)] == list(range(10))
    assert (batcher.pipelines, batcher.calls) == (1 + 3, 10)  # alone, then 4 + 4 + 1


async def test_a_command_error_reaches_only_its_caller(redis: Redis) -> None:
    await redis.set("a-string", "x")
    batcher = PipelineBatcher(redis)

    def wrong_type(pipe: Pipeline) -> None:
        pipe.hset("a-string", "field", "value")  # WRONGTYPE
        pipe.get("a-string")

    first, bad, last = await asyncio.gather(
        batcher.execute(set_and_get("k1", "v1")), batcher.execute(wrong_type), batcher.execute(set_and_get("k2", "v2"))
    )
    assert first[:2] == [True, b"v1"] and last[:2] == [True, b"v2"]
    assert isinstance(bad[0], ResponseError) and "WRONGTYPE" in str(bad[0])
    assert bad[1] == b"x"  # the caller's later command still ran, as in a pipeline of its own


async def test_a_cancelled_caller_waiting_for_its_batch_sends_nothing(redis: Redis) -> None:
    batcher = PipelineBatcher(redis)
    first = asyncio.create_task(batcher.execute(set_and_get("first", "1")))
    await asyncio.sleep(0)  # the first caller's pipeline is in flight
    withdrawn = asyncio.create_task(batcher.execute(set_and_get("withdrawn", "2")))
    kept = asyncio.create_task(batcher.execute(set_and_get("kept", "3")))
    await asyncio.sleep(0)  # both queued behind it
    withdrawn.cancel()
    assert (await first)[1] == b"1" and (await kept)[1] == b"3"
    with pytest.raises(asyncio.CancelledError):
        await withdrawn
    assert await redis.get("withdrawn") is None
    assert batcher.calls == 2


async def test_the_callers_queued_behind_a_cancelled_caller_still_get_their_replies(redis: Redis) -> None:
    batcher = PipelineBatcher(redis)

    def blocking(pipe: Pipeline) -> None:
        pipe.blpop(["never-pushed"], timeout=30)  # holds its pipeline in flight until cancelled

    first = asyncio.create_task(batcher.execute(blocking))
    # Cancelled while it waits on Redis (redis-py lets a command cancelled during its connection setup run on).
    async with asyncio.timeout(10):
        while not any(client.get("cmd") == "blpop" for client in await redis.client_list()):
            await asyncio.sleep(0.01)
    queued = [asyncio.create_task(batcher.execute(set_and_get(f"q{i}", str(i)))) for i in range(3)]
    await asyncio.sleep(0)  # all three queued behind it
    assert not any(task.done() for task in queued)  # they wait behind it
    first.cancel()
    replies = await asyncio.wait_for(asyncio.gather(*queued), 10)
    assert [r[1] for r in replies] == [b"0", b"1", b"2"]
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_transport_failure_fails_every_caller_of_the_batch_and_the_next_call_is_not_stuck() -> None:
    with EmbeddedRedis() as server:
        client = Redis.from_url(server.url, socket_timeout=2, retry_on_error=[])
        try:
            batcher = PipelineBatcher(client)
            await batcher.execute(set_and_get("warm", "up"))  # a pooled connection, then the server goes away
            server.stop()
            results = await asyncio.gather(
                *(batcher.execute(set_and_get(f"k{i}", "v")) for i in range(5)), return_exceptions=True
            )
            assert all(isinstance(r, RedisConnectionError | OSError) for r in results), results
            with pytest.raises((RedisConnectionError, OSError)):
                await asyncio.wait_for(batcher.execute(set_and_get("later", "v")), 10)
        finally:
            await client.aclose()


async def test_the_store_batches_the_round_trips_of_concurrent_turns(redis: Redis) -> None:
    store = TrajectoryStore(
        redis, Keys(), sweep_interval_s=None, pipelines=PipelineBatcher(redis)
    )  # as services wire it
    sessions = [f"s{i}" for i in range(40)]
    await asyncio.gather(*(store.ensure_session(s) for s in sessions))
    before = (store.batcher.pipelines, store.batcher.calls)
    sample = Sample(prompt_ids=np.array([1, 2, 3], dtype=np.int32))
    await asyncio.gather(*(store.save_sample(s, 0, sample) for s in sessions))
    pipelines, calls = store.batcher.pipelines - before[0], store.batcher.calls - before[1]
    assert calls == 40 and pipelines == 2  # one alone, 39 together
    for session in sessions:
        (loaded,) = await store.load_samples(session)
        assert loaded.prompt_ids.tolist() == [1, 2, 3]
        meta = await store.get_session(session)
        assert meta is not None and meta.sample_count == 1
    await store.aclose()


async def test_a_round_trip_past_the_socket_timeout_fails_and_leaves_no_reply_for_the_next() -> None:
    with EmbeddedRedis() as server:
        client = Redis.from_url(server.url, socket_timeout=0.3, retry_on_error=[])
        batcher = PipelineBatcher(client)
        try:

            def blocking(pipe: Pipeline) -> None:
                pipe.set("before", "1")
                pipe.blpop(["never-pushed"], timeout=5)  # Redis answers it only after 5 s

            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RedisTimeoutError):
                await batcher.execute(blocking)
            assert loop.time() - started < 3  # the whole round trip was bounded by the socket timeout
            # The next batch gets its own replies, not the late answer of the blocked one (its connection was closed).
            assert await batcher.execute(set_and_get("after", "2")) == [True, b"2", 1]
        finally:
            await batcher.aclose()
            await client.aclose()


async def test_a_batch_is_retried_across_a_redis_restart_by_the_clients_retry_policy() -> None:
    with EmbeddedRedis() as server:
        client = connect(server.url, socket_timeout_s=2.0)  # the gateway's client: retries with backoff
        batcher = PipelineBatcher(client)
        try:
            assert await batcher.execute(set_and_get("one", "1")) == [True, b"1", 1]
            server.restart()  # the batcher's connection is gone; the same port answers again
            assert await batcher.execute(set_and_get("two", "2")) == [True, b"2", 2]
            assert batcher.pipelines == 2
        finally:
            await batcher.aclose()
            await client.aclose()
