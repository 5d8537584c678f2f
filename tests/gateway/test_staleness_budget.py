"""The staleness budget (`weights.max_staleness`, docs/architecture.md §5): admission by AReaL's rule against the
batch size the trainer's consumer publishes, held or refused beyond it, and samples that fell behind cut and marked.
Real Redis, real HTTP, the simulator, the real `TrajectoryConsumer`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from backends.sim.engine import EngineSettings
from gateway.config import ReplicaConfig
from gateway.embedded_redis import EmbeddedRedis
from gateway.routing import ReplicaPool
from gateway.server import RunningGateway
from gateway.store import Keys, TrajectoryStore, connect
from gateway.trainer import TrajectoryConsumer
from gateway.weights import WeightCoordinator
from gateway.weights.budget import OFF_RECHECK_S, StalenessBudget
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, generate_body, publish, scrape, stream_generate, value
from tests.sim_helpers import wait_for

ConsumerFactory = Callable[..., Awaitable[TrajectoryConsumer]]
KEYS = Keys()


@pytest.fixture
async def make_consumer(redis_server: EmbeddedRedis) -> AsyncIterator[ConsumerFactory]:
    """The trainer's consumers, closed at the end."""
    made: list[TrajectoryConsumer] = []

    async def make(**options: Any) -> TrajectoryConsumer:
        consumer = TrajectoryConsumer(redis_server.url, "trainer", f"rank{len(made)}", claim_idle_s=600, **options)
        await consumer.start()
        made.append(consumer)
        return consumer

    yield make
    for consumer in made:
        await consumer.aclose()


async def gateway(make_sim: SimFactory, make_gateway: GatewayFactory, delay: float = 0.0, **weights: Any) -> Any:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=delay))
    return await make_gateway([sim], weights={"max_staleness": 0} | weights)


async def one_turn(http: httpx.AsyncClient, gw: RunningGateway) -> httpx.Response:
    """The first turn of a new session."""
    return await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2, session_id=uuid.uuid4().hex))


async def started(redis: Redis) -> int:
    return int(await redis.get(KEYS.budget_started) or 0)


@pytest.mark.parametrize("over_budget", ["refuse", "hold"])
async def test_a_session_beyond_the_budget_gets_429_with_retry_after(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    over_budget: str,
) -> None:
    gw = await gateway(make_sim, make_gateway, over_budget=over_budget, hold_timeout_s=0.3)
    await make_consumer(batch_size=2)  # version 0, max_staleness 0: (0 + 0 + 1) x 2 sessions
    for _ in range(2):
        assert (await one_turn(http, gw)).status_code == 200
    refused = await one_turn(http, gw)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "staleness_budget"
    created = await http.post(f"{gw.url}/v1/sessions", json={})  # every way of starting a session counts
    assert created.status_code == 429
    assert await started(redis) == 2  # a refused session is not counted
    counts = gw.services.store.admission.counts
    assert (counts.admitted, counts.refused, counts.held) == (2, 2, 2 if over_budget == "hold" else 0)
    metrics = await scrape(http, gw.url)
    assert value(metrics, "rollout_gateway_budget_sessions_total", outcome="refused") == 2


async def test_a_held_session_is_admitted_once_the_trainer_acks_and_publishes_its_next_version(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
) -> None:
    gw = await gateway(make_sim, make_gateway, over_budget="hold", hold_timeout_s=30)
    trainer = await make_consumer(batch_size=2)
    for i in range(2):
        assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2, session_id=f"s{i}"))).is_success
        assert (await http.post(f"{gw.url}/v1/sessions/s{i}/finish", json={"reward": 1.0})).is_success
    held = asyncio.create_task(one_turn(http, gw))
    budget = gw.services.store.admission
    await wait_for(lambda: budget.counts.held == 1, what="the third session held")
    assert not held.done()
    batch = await trainer.next_batch(2, timeout=5)  # the trainer trains on the two, acks them, publishes version 1
    assert len(batch) == 2
    await trainer.ack(batch)
    assert not held.done()  # an ack alone moves no version
    assert (await publish(http, gw.url, 1)).is_success
    answer = await asyncio.wait_for(held, 10)
    assert answer.status_code == 200, answer.text
    assert await started(redis) == 3
    assert (budget.counts.admitted, budget.counts.refused) == (3, 0)


async def test_the_budget_is_off_until_a_consumer_publishes_its_batch_size(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw = await gateway(make_sim, make_gateway, over_budget="refuse")
    with caplog.at_level(logging.INFO, logger="gateway.weights.budget"):
        for _ in range(4):
            assert (await one_turn(http, gw)).status_code == 200
    off = [r for r in caplog.records if "staleness budget off" in r.getMessage()]
    assert len(off) == 1  # said once

    async def counted() -> bool:
        return await started(redis) == 4

    await wait_for(counted, what="4 sessions counted")  # counted all the same (in the background while off)
    await make_consumer(batch_size=2)
    await asyncio.sleep(OFF_RECHECK_S)  # known off meanwhile: counted without a look at Redis
    assert (await one_turn(http, gw)).status_code == 429  # 4 started, the trainer takes 2 by version 0
    assert await redis.hgetall(KEYS.budget_batch) == {b"trainer/rank0": b"2"}


async def cut_turn(http: httpx.AsyncClient, gw: RunningGateway, session: str) -> dict[str, Any]:
    """A long streamed turn of `session` broken off by an update to version 1: with max_staleness 0, its sample
    (begun under version 0) is beyond the budget once version 1 serves."""
    progress = [0]
    body = generate_body(PROMPT, 4000, session_id=session)
    turn = asyncio.create_task(stream_generate(http, gw.url, body, progress))
    await wait_for(lambda: progress[0] >= 5, what="tokens streamed")
    assert (await publish(http, gw.url, 1)).is_success
    streamed = await asyncio.wait_for(turn, 20)
    assert streamed.final["finish_reason"] == "stale", streamed.final
    assert 5 <= len(streamed.output_ids) < 4000  # its tokens kept, not continued
    return {"ids": streamed.output_ids}


async def test_a_turn_beyond_the_budget_is_cut_and_its_sample_delivered_marked_stale(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
) -> None:
    gw = await gateway(make_sim, make_gateway, delay=0.002)
    trainer = await make_consumer(batch_size=100)
    cut = await cut_turn(http, gw, "long")
    # The agent's next turn on that sample: a 410 it will not retry, not a continuation.
    again = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT + cut["ids"] + [7], 2, session_id="long"))
    assert again.status_code == 410, again.text
    assert again.json()["error"]["code"] == "sample_stale"
    assert (await http.post(f"{gw.url}/v1/sessions/long/finish", json={"reward": 0.0})).is_success
    batch = await trainer.next_batch(1, timeout=5)
    (trajectory,) = batch.trajectories
    (sample,) = trajectory.samples
    assert sample.stale and len(sample.response_ids) == len(cut["ids"])
    assert batch.stale_samples == 1
    assert gw.services.store.admission.counts.cut == 1
    metrics = await scrape(http, gw.url)
    assert value(metrics, "rollout_gateway_budget_stale_cuts_total") == 1


async def test_a_session_with_a_stale_sample_is_dropped_under_drop(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
) -> None:
    gw = await gateway(make_sim, make_gateway, delay=0.002, stale_samples="drop")
    trainer = await make_consumer(batch_size=100)
    await cut_turn(http, gw, "long")
    finished = await http.post(f"{gw.url}/v1/sessions/long/finish", json={"reward": 0.0})
    assert finished.is_success, finished.text
    assert len(await trainer.next_batch(1, timeout=0.5)) == 0  # never reaches the trainer
    ((_, entry),) = await redis.xrange(KEYS.abandoned)
    assert entry[b"session_id"] == b"long" and entry[b"reason"] == b"stale"
    assert await started(redis) == 0  # its budget given back


async def test_a_later_turn_on_a_sample_that_fell_behind_is_refused_and_the_sample_marked(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
) -> None:
    gw = await gateway(make_sim, make_gateway)
    await make_consumer(batch_size=100)
    first = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id="idle"))
    ids = first.json()["output_ids"]
    assert (await publish(http, gw.url, 1)).is_success  # the agent was away while the trainer moved on
    again = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT + ids + [7], 2, session_id="idle"))
    assert again.status_code == 410 and again.json()["error"]["code"] == "sample_stale"
    assert await redis.hget(KEYS.sample("idle", 0), "stale") == b"1"
    # A new session under version 1 is fresh: it runs.
    assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2, session_id="fresh"))).is_success


async def test_max_staleness_null_turns_the_budget_off(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    redis: Redis,
) -> None:
    """`weights.max_staleness: null`: no budget at all, a consumer's batch size notwithstanding: nothing counted,
    held or refused."""
    gw = await gateway(make_sim, make_gateway, max_staleness=None, over_budget="refuse")
    await make_consumer(batch_size=1)
    for _ in range(3):
        assert (await one_turn(http, gw)).status_code == 200
    assert await started(redis) == 0 and gw.services.store.admission is None


@pytest.mark.parametrize(("max_staleness", "cut"), [(0, True), (1, False)])
async def test_a_turn_a_keep_update_lets_run_on_is_cut_once_its_sample_falls_behind(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    make_consumer: ConsumerFactory,
    http: httpx.AsyncClient,
    max_staleness: int,
    cut: bool,
) -> None:
    """A `keep` update (SGLang paused `in_place`) breaks nothing off, so no resume checks the budget: once version 1
    serves, the gateway ends the turns in flight whose sample began before the budget's oldest version, their tokens
    kept and their engine requests aborted. Within the budget the turn runs on to its end under version 1."""
    sim = await make_sim("sglang", engine=EngineSettings(token_delay_s=0.002))
    config = ReplicaConfig(url=sim.url, backend="sim", dialect="sglang", keep_mode="in_place")
    gw = await make_gateway([config], weights={"max_staleness": max_staleness})
    await make_consumer(batch_size=100)
    progress = [0]
    max_tokens = 4000 if cut else 300
    body = generate_body(PROMPT, max_tokens, session_id="kept")
    turn = asyncio.create_task(stream_generate(http, gw.url, body, progress))
    await wait_for(lambda: progress[0] >= 5, what="tokens streamed")
    assert (await publish(http, gw.url, 1, mode="keep")).is_success
    streamed = await asyncio.wait_for(turn, 20)
    final = streamed.final
    assert final["num_resumes"] == 0, final  # kept in the engine, never broken off
    if cut:
        assert final["finish_reason"] == "stale", final
        assert 5 <= len(streamed.output_ids) < max_tokens
        assert gw.services.store.admission.counts.cut == 1
        await wait_for(lambda: not sim.engine.requests, what="the engine request aborted")
        assert sim.engine.counters["finished_abort"] == 1
    else:
        assert final["finish_reason"] == "length" and len(streamed.output_ids) == max_tokens
        assert final["versions"][0] == 0 and final["versions"][-1] == 1
        assert gw.services.store.admission.counts.cut == 0


async def test_redis_away_leaves_the_budget_as_last_read(caplog: pytest.LogCaptureFixture) -> None:
    """Whether the budget is on is read once per version, also in the middle of a completion (is its sample behind
    now?). Redis away then (a restart, a failover) must not fail the completion: the load-balancer soak saw a stream
    end in "the trajectory store (Redis) is unavailable" from it in a master's failover. As last read, read again
    at the next check. A new session is admitted unchecked meanwhile."""
    server = EmbeddedRedis()
    await server.astart()
    client = connect(server.url, socket_timeout_s=0.5)
    try:
        store = TrajectoryStore(client, Keys(), sweep_interval_s=None)
        await client.hset(Keys().budget_batch, "trainer/rank0", 4)  # a consumer published its batch size
        weights = WeightCoordinator(ReplicaPool())
        budget = StalenessBudget(store.started, weights, max_staleness=2)
        weights.version = 5
        assert await budget.stale_before() == 3
        await server.astop()
        weights.version = 6
        with caplog.at_level(logging.WARNING, logger="gateway.weights.budget"):
            assert await budget.stale_before() == 4  # on, as last read
            assert await budget.stale_before() == 4  # not recorded as read: tried again
        assert [r.getMessage().startswith("staleness budget: whether it is on not read") for r in caplog.records] == [
            True
        ] * 2
        never_read = StalenessBudget(store.started, weights, max_staleness=2)
        assert await never_read.stale_before() is None  # off where never read
        await budget.admit(1)  # a new session: admitted unchecked (made once Redis is back), not a 503
        assert budget.counts.admitted == 1
    finally:
        await client.aclose()
        await server.astop()
