"""The local Redis Cluster (rollout_cli/redis_cluster.py): six real redis-server processes formed into 3 masters with
a replica each; a killed master's replica takes over its slots with the writes it had replicated."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import SlotNotCoveredError

from gateway.errors import StoreError
from gateway.store import Keys, TrajectoryStore, connect
from gateway.store.keys import call
from gateway.trainer import TrajectoryConsumer
from rollout_cli.redis_cluster import SLOTS, LocalRedisCluster
from tests.gateway.store.test_trajectory_store import make_sample


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(data_dir=Path(tmp_path_factory.mktemp("cluster"))) as running:
        yield running


def client_of(cluster: LocalRedisCluster) -> RedisCluster:
    nodes = [ClusterNode("127.0.0.1", node.port) for node in cluster.nodes]
    return RedisCluster(startup_nodes=nodes, password=cluster.password)


async def test_three_masters_share_every_slot_and_each_has_a_replica(cluster: LocalRedisCluster) -> None:
    client = client_of(cluster)
    try:
        ranges = await client.cluster_slots()
        assert sum(last - first + 1 for first, last in ranges) == SLOTS
        assert len({tuple(r["primary"]) for r in ranges.values()}) == 3
        assert all(len(r["replicas"]) == 1 for r in ranges.values())
        keys = [f"key-{i}" for i in range(64)]  # spread over the three masters
        assert len({client.keyslot(k) * 3 // SLOTS for k in keys}) == 3
        for i, key in enumerate(keys):
            await client.set(key, i)
        assert [int(await client.get(k)) for k in keys] == list(range(64))
    finally:
        await client.aclose()


async def test_a_killed_masters_replica_takes_over_with_the_replicated_writes(cluster: LocalRedisCluster) -> None:
    client = client_of(cluster)
    try:
        keys = [f"failover-{i}" for i in range(64)]
        for i, key in enumerate(keys):
            await client.set(key, i)
        for master in cluster.masters():  # every write reached the replicas before the kill
            node = client.get_node("127.0.0.1", master.port)
            assert node is not None
            assert await client.execute_command("WAIT", 1, 5000, target_nodes=node) == 1
        victim = cluster.kill_master(0)
        cluster.wait_for_failover()
        assert victim.port not in {m.port for m in cluster.masters()} and len(cluster.masters()) == 3
    finally:
        await client.aclose()
    client = client_of(cluster)  # a new client: its startup nodes include the dead one
    try:
        assert [int(await client.get(k)) for k in keys] == list(range(64))
    finally:
        await client.aclose()


async def test_a_consumer_reads_on_after_the_master_its_client_asks_for_keys_is_killed(tmp_path: Path) -> None:
    """redis-py asks one node (the first master it saw) for the keys of XREADGROUP; once a failover took that node
    away, every read failed for good, until the client read the layout again (gateway/store/cluster_client.py)."""
    with LocalRedisCluster(data_dir=tmp_path) as cluster:
        async with TrajectoryConsumer(cluster.url, "g", "c") as consumer:
            assert len(await consumer.next_batch(1, timeout=0)) == 0
            asked = consumer.client.get_default_node()  # type: ignore[attr-defined]
            index = [m.port for m in cluster.masters()].index(asked.port)
            cluster.kill_master(index)
            await asyncio.to_thread(cluster.wait_for_failover)
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert len(await consumer.next_batch(1, timeout=0)) == 0
                    break
                except StoreError:
                    assert time.monotonic() < deadline, "the consumer never read again after the failover"
                    await asyncio.sleep(0.2)
            assert consumer.client.get_default_node().port != asked.port  # type: ignore[attr-defined]


async def test_a_session_goes_on_while_its_slot_moves_to_another_master(tmp_path: Path) -> None:
    """A slot migration mid-session: while every key has moved but the slot is not handed over, the old master
    answers ASK; after, MOVED. Writes, the WATCHed finish (metadata to merge) and the delivery ride both."""
    with LocalRedisCluster(data_dir=tmp_path) as cluster:
        client = connect(cluster.url)
        store = TrajectoryStore(
            client, Keys(), ttl_s=600, session_idle_ttl_s=600, max_pending=100, retry_budget_s=30, sweep_interval_s=None
        )
        try:
            await store.create_session({"judge": "none"}, "moving")
            first, second = make_sample(seed=1), make_sample(seed=2)
            await store.save_sample("moving", 0, first)
            slot = client.keyslot(Keys().meta("moving"))  # type: ignore[attr-defined]
            target = next(m for m in cluster.masters() if m.port != cluster.master_of(slot).port)
            await asyncio.to_thread(cluster.start_migration, slot, target)
            await store.save_sample("moving", 1, second)  # ASK
            finishing = asyncio.create_task(store.finish("moving", 0.5, {"judge": "ok"}))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(cluster.finish_migration, slot, target)
            entry_id = await asyncio.wait_for(finishing, 30)
            assert cluster.master_of(slot).port == target.port
            meta = await store.get_session("moving")
            assert meta is not None and meta.status == "finished" and meta.stream_id == entry_id
            assert meta.metadata["judge"] == "ok" and meta.sample_count == 2
            async with TrajectoryConsumer(cluster.url, "g", "c") as consumer:
                batch = await consumer.next_batch(1, timeout=2.0)
            (trajectory,) = batch.trajectories
            assert [s.response_ids.tolist() for s in trajectory.samples] == [
                first.response_ids.tolist(),
                second.response_ids.tolist(),
            ]
        finally:
            await store.aclose()
            await client.aclose()


def ids_in_slot(client: RedisCluster, slot: int, prefix: str, count: int) -> list[str]:
    """`count` session ids whose keys live in `slot`."""
    found = (f"{prefix}-{i}" for i in range(1_000_000))
    return [next(s for s in found if client.keyslot(Keys().meta(s)) == slot) for _ in range(count)]


async def test_a_turn_waits_out_the_failover_of_its_sessions_master(tmp_path: Path) -> None:
    """Every store call a turn makes before its engine request (create a session, by a fresh or a client's id, add
    metadata, read and touch it) rides `retry_budget_s` through the failover of the master of the session's slot:
    the turn waits, it is not answered 503 (in CI's load the failover outlasted redis-py's own retries)."""
    with LocalRedisCluster(data_dir=tmp_path) as cluster:
        client = connect(cluster.url)
        store = TrajectoryStore(
            client, Keys(), ttl_s=600, session_idle_ttl_s=600, max_pending=100, retry_budget_s=30, sweep_interval_s=None
        )
        try:
            await store.create_session({}, "known")
            slot = client.keyslot(Keys().meta("known"))  # type: ignore[attr-defined]
            fresh, named = ids_in_slot(client, slot, "s", 2)  # type: ignore[arg-type]
            victim = cluster.master_of(slot)
            cluster.kill_master([m.port for m in cluster.masters()].index(victim.port))
            results = await asyncio.wait_for(
                asyncio.gather(
                    store.create_session({"a": "1"}, fresh, fresh=True),
                    store.ensure_session(named, {"b": "2"}),
                    store.add_metadata("known", {"c": "3"}),
                    store.touch_session("known"),
                ),
                40,
            )
            assert [meta.id for meta in results if meta is not None] == [fresh, named, "known", "known"]
            await asyncio.to_thread(cluster.wait_for_failover)
            assert cluster.master_of(slot).port != victim.port
            meta = await store.get_session("known")
            assert meta is not None and meta.metadata == {"c": "3"}
            assert [(await store.get_session(s)) is not None for s in (fresh, named)] == [True, True]
        finally:
            await store.aclose()
            await client.aclose()


async def test_a_cluster_error_that_is_no_redis_error_is_a_store_error() -> None:
    """redis-py's cluster client raises `RedisClusterException` (no `RedisError`) when no node answers for a slot;
    left raw, it ended the loops that expect `StoreError` (the weights heartbeat, the control channel)."""

    async def fails() -> None:
        raise SlotNotCoveredError("no node answers for slot 7")

    with pytest.raises(StoreError, match="read the lock failed: no node answers for slot 7"):
        await call(fails(), "read the lock")


def test_a_port_taken_before_its_node_starts_moves_the_cluster_to_free_ones(tmp_path: Path) -> None:
    """The ports are chosen when the cluster is made and bound when it starts; another process may bind one between
    (a test's client socket, a parallel run). The cluster then starts on new ones."""
    cluster = LocalRedisCluster(masters=1, replicas_per_master=1, data_dir=tmp_path)
    taken = cluster.nodes[1].requested_port
    assert taken is not None
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert taken not in [node.port for node in cluster.nodes]

            async def write_and_read() -> bytes | None:
                client = client_of(cluster)
                try:
                    await client.set("k", "v")
                    return await client.get("k")
                finally:
                    await client.aclose()

            assert asyncio.run(write_and_read()) == b"v"
