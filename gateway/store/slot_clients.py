"""Where a key's writes run when it matters which connection sends them: a session's optimistic transaction
(`SlotClients`), and writes acknowledged only once replicas hold them (`Durability`).

**Transactions.** On a single server, the store's one client. On a Redis Cluster, a plain client of the master that
owns the slot: a transaction on one slot is native to a cluster, but redis-py's cluster pipeline runs one on a
thread and an event loop of its own, so the store does not use it. After a failover or a slot migration that master
answers MOVED, or is gone: `redirected` lets the cluster client read the slots again, and the caller retries.

**Durable writes.** Redis replicates asynchronously: a master acknowledges a write before any replica has it, and a
failover in the milliseconds between promotes a replica without it. Where such a loss would lose a trajectory (a
session's finish: its meta, its `stream_id` claim, its stream entry) or mislabel versions (`rg:weights`), the store
sends the write and then `WAIT numreplicas timeout` in one pipeline on one connection to the master that owns the key's
slot (`SlotClients`; the store's own client on a single server). WAIT answers how many replicas acknowledged everything
that connection wrote up to then, and Redis replicates one ordered stream per master, so it also covers every earlier
write to that master: the samples a finish closes, whatever client wrote them. A WAIT sent on another connection (a pool
hands out any) would cover nothing that connection did not write.

Fewer replicas than asked within the timeout is `NotReplicated` (a `StoreError`): the write stays on the master,
and the caller does not acknowledge it (a finish is retried, then answered 503; a weight update is answered
`WeightsNotRecorded`). Every write sent through here is idempotent, so sending it again is the retry.

`replicas=None` (auto): 1 on a Redis Cluster whose layout has shown a replica, else 0 (no WAIT): a single server
without replicas, or a cluster of masters only, would refuse every write. Once a replica was seen it stays 1: a
replica that dies later makes writes to its master wait for another one (an operator restarts it), it does not
quietly turn durability off.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, MovedError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import StoreError
from gateway.store.keys import REDIS_ERRORS, call
from gateway.store.pipelines import Build

__all__ = ["Durability", "NotReplicated", "SlotClients"]

logger = logging.getLogger(__name__)

_REDIRECTED = (AskError, MovedError, RedisConnectionError, RedisTimeoutError, OSError)


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


class NotReplicated(StoreError):
    """A write reached fewer replicas than `redis.durable_replicas` within `redis.wait_timeout_ms`."""


class Durability:
    """Runs a key's writes followed by WAIT (see the module docstring); `aclose` closes the per-master clients."""

    def __init__(self, client: aioredis.Redis, replicas: int | None = 0, timeout_ms: int = 1000) -> None:
        self._slots = SlotClients(client)
        self._cluster = client if isinstance(client, RedisCluster) else None
        self._replicas = replicas
        self.timeout_ms = timeout_ms
        self._said_none = False

    @property
    def replicas(self) -> int:
        """The replicas a write waits for now (auto resolved from the cluster's layout)."""
        if self._replicas is not None:
            return self._replicas
        if self._cluster is None:
            return 0
        if self._cluster.get_replicas():  # the layout the client read (empty before its first command)
            self._replicas = 1
            return 1
        if not self._said_none and self._cluster.get_primaries():
            self._said_none = True
            logger.warning(
                "redis.durable_replicas: the Redis Cluster lists no replica; finishes and weight records are "
                "acknowledged without WAIT until one appears (a failover may lose the last writes)"
            )
        return 0

    async def write(self, key: str, build: Build, what: str) -> list[Any]:
        """The replies to `build`'s commands (all on `key`'s slot), sent to the master that owns it and, where
        `replicas` > 0, followed there by WAIT. A command's error, a redirection (the slot moved: the layout is
        read again) or a transport failure is a `StoreError`; too few replicas a `NotReplicated`."""
        replicas = self.replicas
        try:
            async with self._slots.for_key(key).pipeline(transaction=False) as pipe:
                build(pipe)
                if replicas:
                    pipe.wait(replicas, self.timeout_ms)
                replies = await pipe.execute(raise_on_error=False)
        except _REDIRECTED as exc:
            await self._redirected(key, what)
            raise StoreError(f"redis: {what} failed: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise StoreError(f"redis: {what} failed: {exc}") from exc
        for reply in replies:
            if isinstance(reply, _REDIRECTED):
                await self._redirected(key, what)
            if isinstance(reply, Exception):
                raise StoreError(f"redis: {what} failed: {reply}") from reply
        if not replicas:
            return replies
        *answers, acknowledged = replies
        if int(acknowledged) < replicas:
            raise NotReplicated(
                f"redis: {what}: {acknowledged} of {replicas} replicas acknowledged within {self.timeout_ms} ms "
                "(redis.durable_replicas, redis.wait_timeout_ms); not acknowledged"
            )
        return answers

    async def _redirected(self, key: str, what: str) -> None:
        """The slot's master moved or is gone: let the cluster client read the layout again (best effort: the
        caller retries, and its next attempt finds the new master, or fails again the same way)."""
        if self._cluster is not None:
            with contextlib.suppress(StoreError):
                await call(self._slots.redirected(key), what)

    async def aclose(self) -> None:
        await self._slots.aclose()
