"""Shared fixtures. One section per resource; add new ones under their own heading."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from backends.sim.common import SimServerSettings
from backends.sim.engine import EngineSettings
from backends.sim.server import SimReplica, serve_in_process
from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.server import RunningGateway, serve_gateway
from rollout_cli.redis_cluster import LocalRedisCluster

# --------------------------------------------------------------------------------------------------------------
# Workers: under `-n 2 --dist loadgroup` (the README's test command) the tests that load the machine run on one
# worker, one after another as without xdist, while the other takes the rest.
# --------------------------------------------------------------------------------------------------------------

HEAVY = ("engines", "chaos", "benchmarks", "fuzz")
"""The real-engine tiers (never two engines at once), the soaks, the benchmark runs and the fuzzers: each keeps a
machine's cores busy for its length, and side by side they starve each other's timing."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy = tuple(Path(__file__).parent / folder for folder in HEAVY)
    for item in items:
        if any(folder in item.path.parents for folder in heavy):
            item.add_marker(pytest.mark.xdist_group("heavy"))


# --------------------------------------------------------------------------------------------------------------
# Redis: one real redis-server for the whole session, flushed before every test that asks for a client.
# Tests that restart or kill a server start their own EmbeddedRedis instead of touching the shared one.
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A real Redis Cluster (3 masters, a replica each) for the whole session, started when a test first asks."""
    with LocalRedisCluster(data_dir=tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    """A client of the session server with an empty keyspace; closed after the test."""
    client = Redis.from_url(redis_server.url, decode_responses=False)
    try:
        await client.flushall()
        yield client
    finally:
        await client.aclose()


# --------------------------------------------------------------------------------------------------------------
# Simulator replicas served in this process on ephemeral ports; `make_sim(dialect, engine=..., **server_kw)`.
# --------------------------------------------------------------------------------------------------------------

SimFactory = Callable[..., Awaitable[SimReplica]]


@pytest.fixture
async def make_sim() -> AsyncIterator[SimFactory]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(dialect: str = "vllm", engine: EngineSettings | None = None, **server: Any) -> SimReplica:
            if engine is None:
                engine = EngineSettings(block_size=16 if dialect == "vllm" else 1)
            settings = SimServerSettings(dialect=dialect, engine=engine, **server)  # type: ignore[arg-type]
            return await stack.enter_async_context(serve_in_process(settings))

        yield make


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    # Generous: the heavy tests load the machine on the other worker (a simulator's answer took 20 s once).
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        yield client


# --------------------------------------------------------------------------------------------------------------
# The gateway, served in this process on a free port over simulator replicas; `make_gateway(sims, **sections)`.
# --------------------------------------------------------------------------------------------------------------

ADMIN_TOKEN = "test-admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
GatewayFactory = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def make_gateway(redis_server: EmbeddedRedis, redis: Redis) -> AsyncIterator[GatewayFactory]:
    """Gateways on the session's Redis (flushed for this test by the `redis` fixture); sections as keywords
    (`fastpath={"enabled": False}` serves everything through the libraries alone)."""
    stack = contextlib.AsyncExitStack()

    async def make(replicas: list[Any], **sections: Any) -> RunningGateway:
        configs = [
            r if isinstance(r, ReplicaConfig) else ReplicaConfig(url=r.url, backend="sim", dialect=r.dialect)
            for r in replicas
        ]
        server = {"port": 0, "admin_token": ADMIN_TOKEN} | sections.pop("server", {})
        routing = {"health_interval_s": 0.2} | sections.pop("routing", {})
        settings = Settings(
            server=server, redis={"url": redis_server.url}, replicas=configs, routing=routing, **sections
        )
        return await stack.enter_async_context(serve_gateway(settings))

    try:
        yield make
    finally:
        # Closed in this task (a context entered here must be left here), watched by another.
        watchdog = asyncio.create_task(report_a_hang("make_gateway's gateways", 60.0))
        try:
            await stack.aclose()
        finally:
            watchdog.cancel()


async def report_a_hang(what: str, after_s: float) -> None:
    """After `after_s`, print the stack of every task of the loop (a gateway's shutdown once hung for minutes in one
    full run, not reproduced alone); cancelled when what it watches ends first."""
    await asyncio.sleep(after_s)
    print(f"{what}: not closed within {after_s:g} s; the loop's tasks:", file=sys.stderr)
    for pending in asyncio.all_tasks():
        pending.print_stack(file=sys.stderr)
