"""The Redis Cluster client: redis-py's, reading the cluster's layout again after a node stops answering.

redis-py reads the layout again after a connection error on the node that serves a key, but not after one on the
node it asks for the keys of a command whose keys move (`COMMAND GETKEYS`, for XREADGROUP): that node is the first
master it saw, and once a failover took it away, every XREADGROUP failed for good (seen in the chaos soak). Here
any connection or timeout error reads the layout again (at most once per `_REFRESH_S`), then goes to the caller,
whose own retry policy decides.

redis-py has no documented call that reads the layout again: `read_layout` runs the two steps its own `initialize`
runs once (`nodes_manager.initialize`, `commands_parser.initialize`; attributes without an underscore, named in the
class's `__slots__`). pyproject.toml pins redis-py's minor version for it, and the failover test
(tests/rollout_cli/test_redis_cluster.py, an XREADGROUP after the first master is killed) fails if it stops working.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config.redis import cluster_nodes

__all__ = ["FailoverAwareCluster", "connect_cluster"]

_REFRESH_S = 0.25  # a burst of failures reads the layout once


class FailoverAwareCluster(RedisCluster):
    """`RedisCluster` that reads the layout again, and picks a live node to ask for keys, after a node failed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refresh_lock = asyncio.Lock()
        self._refreshed_at = 0.0

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError):
            await self.read_layout()
            raise

    async def read_layout(self) -> None:
        """Read the slots and nodes from a live node; the node asked for keys becomes a live master."""
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed_at < _REFRESH_S:
                return
            self._refreshed_at = time.monotonic()
            try:
                await self.nodes_manager.initialize()
                await self.commands_parser.initialize(self.get_default_node())
            except (RedisError, RedisClusterException, OSError):
                pass  # no node answers yet: the next failure tries again


def connect_cluster(url: str, socket_timeout_s: float, max_connections: int) -> RedisCluster:
    """The cluster client over the startup nodes `redis+cluster://[user:password@]host:port[,host:port...]` lists
    (any one reachable is enough). It follows MOVED and ASK redirections and, when a node fails, reads the slots
    again and retries on the new master."""
    parts = urlsplit(url)
    return FailoverAwareCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in cluster_nodes(url)],  # checked by the config
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        ssl=parts.scheme == "rediss+cluster",
        max_connections=max_connections,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
    )
