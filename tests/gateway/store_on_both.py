"""The store and trainer suites run on both deployments of Redis: the single server and a real Redis Cluster.
Their conftest files import these fixtures: `redis_url` (parametrized) and `redis`, a flushed client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from gateway.embedded_redis import EmbeddedRedis
from rollout_cli.redis_cluster import LocalRedisCluster


@pytest.fixture(params=["single", "cluster"])
def redis_url(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> str:
    if request.param == "cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    """A client of `redis_url` with an empty keyspace (every master flushed); closed after the test."""
    client: Any
    if redis_url.startswith("redis+cluster://"):
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        client = RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.masters()], password=cluster.password
        )
        await client.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        client = Redis.from_url(redis_url, decode_responses=False)
        await client.flushall()
    try:
        yield cast(Redis, client)
    finally:
        await client.aclose()
