"""Engine load, read in the background for the policies that weigh it (`cache_aware`, `sticky_least_loaded`).

A `LoadPoller` reads each engine's `/metrics` (`EngineBackend.load`) every `routing.load_interval_s`: its running and
waiting requests (every gateway process's) and the share of its KV cache in use, kept on each of its routing targets
(`Replica.engine_load`): the whole engine's for an engine that is one target, each rank's own for the ranks of a
data-parallel one (a rank the read does not report counts as not read). Between two reads the pool adds the requests
this process began and ended since (`Replica.load`), so a burst of placements sees its own weight at once. A read that
fails forgets the last one: the replica's load is then this process's in-flight count until a read succeeds. The default
policy (`sticky`) reads nothing and starts no poller.

`LoadBound` says when a replica counts as loaded: more than `routing.load_bound` requests above the least loaded
candidate, or its KV cache fuller than `routing.kv_usage_limit`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from backends.base import Load
from backends.errors import BackendError
from common.hashing import mix64
from gateway.background import background, stop
from gateway.routing.replica import Engine, EngineLoad, Replica

logger = logging.getLogger(__name__)

__all__ = ["LoadBound", "LoadPoller", "least_loaded"]


@dataclass(frozen=True, slots=True)
class LoadBound:
    """When a replica counts as loaded (see the module docstring)."""

    requests: int = 32
    kv_usage: float = 0.95

    def loaded(self, replica: Replica, least: int) -> bool:
        kv = replica.kv_usage
        return replica.load > least + self.requests or (kv is not None and kv > self.kv_usage)


def least_loaded(candidates: list[Replica], key: int) -> Replica:
    """The candidate with the fewest requests; ties go by rendezvous hash of `key`, so processes that see the same
    loads agree."""
    return min(candidates, key=lambda r: (r.load, -mix64(key ^ r.key)))


class LoadPoller:
    """Reads the load of every engine `engines()` lists, one read each every `interval_s`, for its targets;
    `on_read` sees each target's read."""

    def __init__(
        self,
        engines: Callable[[], list[Engine]],
        interval_s: float,
        on_read: Callable[[Replica, Load], None] | None = None,
    ) -> None:
        self._engines = engines
        self.interval_s = interval_s
        self._on_read = on_read
        self._task: asyncio.Task[None] | None = None

    async def poll(self) -> None:
        """Read every engine's load once, concurrently."""
        async with asyncio.TaskGroup() as group:
            for engine in self._engines():
                group.create_task(self._read(engine))

    async def _read(self, engine: Engine) -> None:
        # Before the read: requests begun during it are the engine's or counted after.
        in_flight = [target.in_flight for target in engine.targets]
        try:
            load = await engine.backend.load()
        except BackendError as exc:
            logger.debug("replica %s: load not read: %s", engine.id, exc, extra={"replica": engine.id})
            for target in engine.targets:
                target.engine_load = None
            return
        for target, before in zip(engine.targets, in_flight, strict=True):
            read = load if target.rank is None else load.ranks.get(target.rank)
            if read is None or (read.running is None and read.waiting is None):
                target.engine_load = None  # nothing reported: count what this process sends it
            else:
                target.engine_load = EngineLoad((read.running or 0) + (read.waiting or 0), read.kv_usage, before)
            if read is not None and self._on_read is not None:
                self._on_read(target, read)

    def start(self) -> None:
        if self._task is None:
            self._task = background(self._loop(), "replica-load")  # held here: the loop keeps weak references

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a bug in one round must not end load reading for good
                logger.exception("engine load round failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        if self._task is not None:
            await stop(self._task)
            self._task = None
