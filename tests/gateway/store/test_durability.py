"""Durability on a Redis Cluster (gateway/store/slot_clients.py): a session's finish and the weight version
record are acknowledged only once a replica of the master that took them holds them (`WAIT` on the connection that
wrote), so a failover right after never loses them. A replica made to stall (SIGSTOP: its connection stays up, its
acknowledgements stop, as a replica far behind) is what makes a write unacknowledged here; without the WAIT the master
acknowledged at once, and a failover to that replica lost the write.

On the session's cluster (`redis_cluster`, tests/conftest.py): these tests stop replicas and kill a master, but each
stalled replica goes on and the killed master is revived (a replica in sync) before the test ends, so the cluster
is left whole for the tests after (a master and its replica may have swapped roles, which they look up live)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import StoreError
from gateway.server import serve_gateway
from gateway.store import Durability, Keys, NotReplicated, TrajectoryStore, WeightsBus, connect
from gateway.trainer import TrajectoryConsumer
from rollout_cli.redis_cluster import LocalRedisCluster
from tests.conftest import ADMIN_TOKEN, SimFactory
from tests.gateway.store.test_trajectory_store import make_sample
from tests.gateway_helpers import publish

KEYS = Keys()


@pytest.fixture
def cluster(redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    return redis_cluster


@pytest.fixture
async def client(cluster: LocalRedisCluster) -> AsyncIterator[Redis]:
    client = connect(cluster.url)
    await client.flushall(target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]  # also reads the layout
    yield client
    await client.aclose()


def master_of_key(cluster: LocalRedisCluster, client: Redis, key: str) -> EmbeddedRedis:
    return cluster.master_of(client.keyslot(key))  # type: ignore[attr-defined]


@contextlib.contextmanager
def stalled(node: EmbeddedRedis) -> Iterator[None]:
    """`node` stopped (SIGSTOP) for the block: connected, silent, acknowledging nothing."""
    assert node.pid is not None
    os.kill(node.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.pid, signal.SIGCONT)


def session_beside_the_stream(cluster: LocalRedisCluster, client: Redis, prefix: str) -> str:
    """A session id whose keys live on the master of the trajectory stream: one replica holds both for it."""
    master = master_of_key(cluster, client, KEYS.stream(0))
    return next(
        s for s in (f"{prefix}-{i}" for i in range(100_000)) if master_of_key(cluster, client, KEYS.meta(s)) is master
    )


def make_store(client: Redis, retry_budget_s: float) -> TrajectoryStore:
    return TrajectoryStore(
        client,
        KEYS,
        ttl_s=600,
        session_idle_ttl_s=600,
        retry_budget_s=retry_budget_s,
        sweep_interval_s=None,
        durable_replicas=None,  # the default: 1 on a cluster with replicas
        wait_timeout_ms=100,
    )


async def test_a_finish_is_not_acknowledged_while_its_masters_replica_stalls(
    cluster: LocalRedisCluster, client: Redis
) -> None:
    store = make_store(client, retry_budget_s=0.5)
    try:
        session = session_beside_the_stream(cluster, client, "stalled")
        await store.create_session({}, session)
        await store.save_sample(session, 0, make_sample())
        (replica,) = cluster.replicas_of(master_of_key(cluster, client, KEYS.meta(session)))
        with stalled(replica), pytest.raises(StoreError, match="not finished"):
            await store.finish(session, 1.0)
        entry_id = await store.finish(session, 1.0)  # retried by the client once the replica is back
        meta = await store.get_session(session)
        assert meta is not None and meta.status == "finished" and meta.stream_id == entry_id
    finally:
        await store.aclose()


async def test_an_acknowledged_finish_survives_the_kill_of_its_master(
    cluster: LocalRedisCluster, client: Redis
) -> None:
    store = make_store(client, retry_budget_s=30.0)
    try:
        session = session_beside_the_stream(cluster, client, "killed")
        sample = make_sample(seed=3)
        await store.create_session({}, session)
        await store.save_sample(session, 0, sample)
        master = master_of_key(cluster, client, KEYS.meta(session))
        (replica,) = cluster.replicas_of(master)
        with stalled(replica):
            finishing = asyncio.create_task(store.finish(session, 0.5))
            done, _ = await asyncio.wait([finishing], timeout=0.5)
            assert not done, "a finish was acknowledged while its master's only replica had none of it"
        entry_id = await asyncio.wait_for(finishing, 10)
        cluster.kill_master([m.port for m in cluster.masters()].index(master.port))  # at once: WAIT made it safe
        await asyncio.to_thread(cluster.wait_for_failover)
        await asyncio.to_thread(cluster.revive, master)
    finally:
        await store.aclose()
    async with TrajectoryConsumer(cluster.url, "g", "c") as consumer:  # a new client: the promoted replica
        batch = await consumer.next_batch(1, timeout=5.0)
    (trajectory,) = batch.trajectories
    assert trajectory.session_id == session and trajectory.reward == 0.5
    assert [s.response_ids.tolist() for s in trajectory.samples] == [sample.response_ids.tolist()]
    fresh = connect(cluster.url)
    try:
        meta = await TrajectoryStore(fresh, KEYS, sweep_interval_s=None).get_session(session)
        assert meta is not None and meta.status == "finished" and meta.stream_id == entry_id
    finally:
        await fresh.aclose()


async def test_a_weight_record_is_not_acknowledged_while_its_replica_stalls(
    cluster: LocalRedisCluster, client: Redis
) -> None:
    bus = WeightsBus(client, KEYS, "test", durability=Durability(client, None, 100), retry_budget_s=0.3)
    try:
        (replica,) = cluster.replicas_of(master_of_key(cluster, client, KEYS.weights))
        with stalled(replica), pytest.raises(NotReplicated, match="0 of 1 replicas"):
            await bus.record(7, "serving", "ckpt-7")
        await bus.record(8, "serving", "ckpt-8")
        record = await bus.read()
        assert record is not None and record.version == 8
    finally:
        await bus.aclose()


async def test_the_update_lock_is_taken_and_let_go_only_once_its_replica_has_it(
    cluster: LocalRedisCluster, client: Redis
) -> None:
    """A lock taken on the master alone would be gone after a failover while its update runs (the other gateways
    would dispatch meanwhile), a release on the master alone would bring the lock back (every update refused until
    its TTL). Not acknowledged, the lock is let go again: the update is a 503 the trainer retries."""
    bus = WeightsBus(client, KEYS, "test", durability=Durability(client, None, 100))
    try:
        (replica,) = cluster.replicas_of(master_of_key(cluster, client, KEYS.weights_lock))
        with stalled(replica), pytest.raises(NotReplicated, match="0 of 1 replicas"):
            await bus.acquire("test.stalled", 60)
        assert await bus.holder() is None
        assert await bus.acquire("test.taken", 60)
        with stalled(replica), pytest.raises(NotReplicated, match="0 of 1 replicas"):
            await bus.release("test.taken", budget_s=0.3)
        await bus.release("test.taken")  # again once the replica is back: nothing left to let go, acknowledged
        assert await bus.holder() is None
    finally:
        await bus.aclose()


async def test_a_weight_update_whose_record_reaches_no_replica_answers_weights_not_recorded(
    cluster: LocalRedisCluster, client: Redis, make_sim: SimFactory
) -> None:
    """The engines run the new version (and the gateway serves it), but the record a failover could lose is not
    acknowledged: the update answers 503 `weights_not_recorded`, saying which version serves where. The same request
    again (a client's retry) records it, rather than a 409 for a version not newer."""
    sim = await make_sim("vllm")
    settings = Settings(
        server={"port": 0, "admin_token": ADMIN_TOKEN},
        redis={"url": cluster.url, "retry_budget_s": 0.5, "wait_timeout_ms": 100},
        replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")],
    )
    async with serve_gateway(settings) as gateway, httpx.AsyncClient(timeout=30) as http:
        (replica,) = cluster.replicas_of(master_of_key(cluster, client, KEYS.weights))
        with stalled(replica):
            response = await publish(http, gateway.url, 1)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "weights_not_recorded" and error["version"] == 1, error
        assert "weight version 1 serves on" in error["message"]
        again = await publish(http, gateway.url, 1)
        assert again.status_code == 200 and again.json()["version"] == 1, again.text
        bus = WeightsBus(client, KEYS, "test")
        record = await bus.read()
        assert record is not None and record.version == 1
        assert (await publish(http, gateway.url, 1)).status_code == 409  # recorded now: a version not newer
        assert (await publish(http, gateway.url, 2)).status_code == 200
