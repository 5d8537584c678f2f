"""Where a session's optimistic transaction (WATCH, MULTI, EXEC on its slot) runs.

On a single server, the store's one client. On a Redis Cluster, a plain client of the master that owns the slot:
a transaction on one slot is native to a cluster, but redis-py's cluster pipeline runs one on a thread and an
event loop of its own, so the store does not use it. After a failover or a slot migration that master answers
MOVED, or is gone: `redirected` lets the cluster client read the slots again, and the caller retries.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

__all__ = ["SlotClients"]


class SlotClients:
    """The client to run a transaction on a key's slot with (`for_key`); closed with `aclose`."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._cluster = client if isinstance(client, RedisCluster) else None
        self._masters: dict[str, aioredis.Redis] = {}  # by node name, host:port

    @property
    def clustered(self) -> bool:
        return self._cluster is not None

    def for_key(self, key: str) -> aioredis.Redis:
        if self._cluster is None:
            return self._client
        node = self._cluster.get_node_from_key(key)
        assert node is not None  # a master always, or SlotNotCoveredError
        client = self._masters.get(node.name)
        if client is None:
            # The cluster's own connection settings (credentials, TLS, timeouts), to that one node; its reply
            # parsers stay the cluster client's.
            settings = dict(self._cluster.get_connection_kwargs())
            settings.pop("response_callbacks", None)
            pool = aioredis.ConnectionPool(host=node.host, port=node.port, **settings)
            client = self._masters[node.name] = aioredis.Redis.from_pool(pool)
        return client

    async def redirected(self, key: str) -> None:
        """The master of `key`'s slot answered MOVED or ASK, or could not be reached: one command through the cluster
        client, which follows the redirection and reads the slots again, so that `for_key` answers the new master."""
        if self._cluster is not None:
            await self._cluster.exists(key)

    async def aclose(self) -> None:
        masters, self._masters = list(self._masters.values()), {}
        for client in masters:
            await client.aclose()
