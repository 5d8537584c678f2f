"""A real Redis Cluster on this host, for tests and benchmarks: `masters` primaries and `replicas_per_master`
replicas of each, every one an `EmbeddedRedis` (the same binary, data directory and lifecycle) started with
`cluster-enabled yes`, formed the way an operator forms one by hand: the 16,384 slots split over the masters
(CLUSTER ADDSLOTSRANGE), every node introduced to the first (CLUSTER MEET), each replica attached to its master
(CLUSTER REPLICATE); ready once every node reports `cluster_state:ok` and sees every other.

`url` is the gateway's cluster URL, `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...` (every node a startup node).
`kill_master(i)` SIGKILLs a master; with a replica the cluster promotes it after `node_timeout_ms`
(`wait_for_failover`). `revive(node)` starts a killed node again, as an operator's supervisor would: it rejoins as
a replica of the master that took its slots over, so that its shard has a replica again (writes that wait for one,
`redis.durable_replicas`, go on).

```python
with LocalRedisCluster() as cluster:
    client = redis.asyncio.cluster.RedisCluster.from_url(cluster.nodes[0].url)  # its password in the URL
```
"""

from __future__ import annotations

import secrets
import shutil
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import redis

from gateway.embedded_redis import EmbeddedRedis, PortTaken
from gateway.errors import StoreError

__all__ = ["LocalRedisCluster", "SLOTS"]

SLOTS = 16384
BUS_PORT_OFFSET = 10000
_HOST = "127.0.0.1"
_PORT_ATTEMPTS = 3  # the cluster's ports are chosen before its nodes start: another process may take one


class LocalRedisCluster:
    """A Redis Cluster of real `redis-server` processes on 127.0.0.1. Not started by the constructor."""

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 1,
        *,
        data_dir: Path | None = None,
        node_timeout_ms: int = 1000,
        startup_timeout_s: float = 30.0,
    ) -> None:
        if masters < 1 or replicas_per_master < 0:
            raise ValueError("a cluster needs at least one master and a non-negative number of replicas")
        self.masters_count = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout_s = startup_timeout_s
        self.password = secrets.token_hex(24)  # one for every node: replicas log in to their master with it
        config = {
            "masterauth": self.password,
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
            # A replica promoted by a failover serves at once, whatever its last contact with the master.
            "cluster-replica-validity-factor": "0",
            # Slots of a dead master without a replica do not stop the rest of the cluster from serving.
            "cluster-require-full-coverage": "no",
        }
        self._config, self._data_dir = config, data_dir
        self.nodes = self._new_nodes()

    def _new_nodes(self) -> list[EmbeddedRedis]:
        """The nodes, on free ports (a node keeps its port when it is revived: the others know it by it)."""
        total = self.masters_count * (1 + self.replicas_per_master)
        return [
            EmbeddedRedis(
                data_dir=self._data_dir / f"node-{i}" if self._data_dir else None,
                port=port,
                password=self.password,
                extra_config=self._config,
            )
            for i, port in enumerate(_cluster_ports(total))
        ]

    @property
    def url(self) -> str:
        """The gateway's URL of this cluster, with its password: every node is a startup node."""
        nodes = ",".join(f"{_HOST}:{node.port}" for node in self.nodes)
        return f"redis+cluster://:{quote(self.password, safe='')}@{nodes}"

    def masters(self) -> list[EmbeddedRedis]:
        """The nodes that are masters now (a failover changes which)."""
        return [node for node in self._alive() if _role(node) == "master"]

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            try:
                for node in self.nodes:
                    node.start()
                self._form()
                return
            except PortTaken:
                self.stop()
                if attempt == _PORT_ATTEMPTS:
                    raise
                # Another process bound a port between its choice and a node's start: all on new ports (a node's
                # files of this attempt name the old ones).
                if self._data_dir is not None:
                    for i in range(len(self.nodes)):
                        shutil.rmtree(self._data_dir / f"node-{i}", ignore_errors=True)
                self.nodes = self._new_nodes()
            except BaseException:
                self.stop()
                raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill_master(self, index: int = 0) -> EmbeddedRedis:
        """SIGKILL the `index`-th current master; the node killed."""
        victim = self.masters()[index]
        victim.kill()
        return victim

    def revive(self, node: EmbeddedRedis, timeout_s: float = 30.0) -> None:
        """Start the killed `node` again (its port, data and nodes.conf) and return once it is a replica in sync
        with a master: the cluster tells it that its slots have a newer owner, and it replicates that one."""
        node.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                role = _command(node, "ROLE")
                if _text(role[0]) == "slave" and _text(role[3]) == "connected":
                    return
            except redis.RedisError:
                pass  # still loading, or settling: ask again
            if time.monotonic() > deadline:
                raise StoreError(f"the revived node did not replicate a master within {timeout_s:g} s")
            time.sleep(0.05)

    def replicas_of(self, master: EmbeddedRedis) -> list[EmbeddedRedis]:
        """The live nodes replicating `master` now (as its ROLE lists them)."""
        ports = {int(port) for _, port, _ in _command(master, "ROLE")[2]}
        return [node for node in self._alive() if node.port in ports]

    def wait_for_failover(self, timeout_s: float = 30.0) -> None:
        """Until every slot is served again by a live master (a replica promoted) and the live nodes agree."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._all_slots_served():
                    return
            except redis.RedisError:
                pass  # a node still settling: ask again
            if time.monotonic() > deadline:
                raise StoreError(f"the cluster did not fail over within {timeout_s:g} s")
            time.sleep(0.05)

    def master_of(self, slot: int) -> EmbeddedRedis:
        """The live master that serves `slot` now."""
        for first, last, master, *_ in _command(self._alive()[0], "CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return next(node for node in self._alive() if node.port == int(master[1]))
        raise StoreError(f"slot {slot} is not served")

    def start_migration(self, slot: int, to: EmbeddedRedis) -> EmbeddedRedis:
        """Begin moving `slot` to the master `to` and move every key it holds (MIGRATE), leaving the slot in
        migration: the old master answers ASK for it. `finish_migration` hands the slot over. The old master."""
        source = self.master_of(slot)
        source_id, target_id = _text(_command(source, "CLUSTER", "MYID")), _text(_command(to, "CLUSTER", "MYID"))
        _command(to, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        _command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := _command(source, "CLUSTER", "GETKEYSINSLOT", slot, 100):
            _command(source, "MIGRATE", _HOST, to.port, "", 0, 5000, "AUTH", self.password, "KEYS", *keys)
        return source

    def finish_migration(self, slot: int, to: EmbeddedRedis) -> None:
        """`to` serves `slot` from now on; every master is told (the old one then answers MOVED)."""
        target_id = _text(_command(to, "CLUSTER", "MYID"))
        for node in [to, *(m for m in self.masters() if m is not to)]:
            _command(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # -- forming the cluster ------------------------------------------------------------------------------------

    def _form(self) -> None:
        masters = self.nodes[: self.masters_count]
        per_master = SLOTS // self.masters_count
        for index, node in enumerate(masters):
            first = index * per_master
            last = SLOTS - 1 if index == self.masters_count - 1 else first + per_master - 1
            _command(node, "CLUSTER", "ADDSLOTS", *range(first, last + 1))  # Redis 6 has no RANGE
        for node in self.nodes[1:]:
            _command(node, "CLUSTER", "MEET", _HOST, self.nodes[0].port)
        self._wait(lambda: all(len(_known_nodes(node)) == len(self.nodes) for node in self.nodes), "every node met")
        replicas = self.nodes[self.masters_count :]
        for index, node in enumerate(replicas):
            master = masters[index % self.masters_count]
            master_id = _command(master, "CLUSTER", "MYID")
            _command(node, "CLUSTER", "REPLICATE", _text(master_id))
        self._wait(self._formed, "cluster_state:ok with every replica attached")

    def _formed(self) -> bool:
        if not self._all_slots_served():
            return False
        roles = [_role(node) for node in self.nodes]
        if roles.count("slave") != len(self.nodes) - self.masters_count:
            return False
        # Every node's layout lists every master's replicas too: a client reads it from whichever node it asks, and a
        # node behind on the gossip listed a slot range without its replica just after formation (seen in CI).
        return all(
            len(replicas) >= self.replicas_per_master
            for node in self.nodes
            for _, _, _, *replicas in _command(node, "CLUSTER", "SLOTS")
        )

    def _all_slots_served(self) -> bool:
        alive = self._alive()
        if not alive or not all(_info(node).get("cluster_state") == "ok" for node in alive):
            return False
        ports = {node.port for node in alive}
        # Every live node's view, not one's: a client that reads the layout from a node still behind on the gossip
        # would go on sending a killed master's slots to it.
        for node in alive:
            ranges = _command(node, "CLUSTER", "SLOTS")
            served: int = sum(last - first + 1 for first, last, master, *_ in ranges if int(master[1]) in ports)
            if served != SLOTS:
                return False
        return True

    def _alive(self) -> list[EmbeddedRedis]:
        return [node for node in self.nodes if node.pid is not None]

    def _wait(self, condition: object, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                if callable(condition) and condition():
                    return
            except redis.RedisError:
                pass  # a node still settling (e.g. CLUSTERDOWN): ask again
            if time.monotonic() > deadline:
                raise StoreError(f"local Redis Cluster: not {what} within {self.startup_timeout_s:g} s")
            time.sleep(0.05)


def _cluster_ports(count: int) -> list[int]:
    """`count` free ports whose cluster bus ports (port + 10000: Redis 6 has no `cluster-port`) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as data, socket.socket() as bus:
            data.bind((_HOST, 0))
            port = data.getsockname()[1]
            if port > 65535 - BUS_PORT_OFFSET or port in ports:
                continue
            try:
                bus.bind((_HOST, port + BUS_PORT_OFFSET))
            except OSError:
                continue
            ports.append(port)
    return ports


def _command(node: EmbeddedRedis, *args: str | int) -> Any:
    """One command to one node, on a connection of its own (this runs rarely: forming, watching a failover)."""
    with redis.Redis(host=_HOST, port=node.port, password=node.password, socket_timeout=2.0) as client:
        return client.execute_command(*args)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _info(node: EmbeddedRedis) -> dict[str, str]:
    raw = _text(_command(node, "CLUSTER", "INFO"))
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


def _known_nodes(node: EmbeddedRedis) -> list[str]:
    raw = _text(_command(node, "CLUSTER", "NODES"))
    return [line for line in raw.splitlines() if line and "handshake" not in line]


def _role(node: EmbeddedRedis) -> str:
    role = _command(node, "ROLE")
    return _text(role[0])
