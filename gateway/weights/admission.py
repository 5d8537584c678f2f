"""A replica joins, or rejoins, the pool on the pool's weights: admission, the check on every health probe, and the
catch-up that loads the current version onto a replica behind it."""

from __future__ import annotations

import asyncio
import logging

from backends.base import EngineBackend
from backends.errors import BackendError
from gateway.background import stop
from gateway.errors import InvalidRequest
from gateway.routing import Engine, ReplicaPool
from gateway.weights.coordinator import WeightCoordinator
from gateway.weights.labels import parse_version

logger = logging.getLogger(__name__)


async def reported_version(backend: EngineBackend) -> int | None:
    """The version an engine's label names; None where it cannot be read or is no version (logged)."""
    try:
        return parse_version(await backend.weight_version())
    except (BackendError, InvalidRequest) as exc:
        logger.warning("replica %s: cannot read its weight version: %s", backend.id, exc, extra={"replica": backend.id})
        return None


class ReplicaAdmission:
    """Keeps every serving replica on the coordinator's version: a newcomer serves only once it runs it, and a
    replica that restarted on other weights is held out (and, where the weights came from a path, loaded with
    them)."""

    def __init__(self, pool: ReplicaPool, weights: WeightCoordinator) -> None:
        self.pool = pool
        self.weights = weights
        self._catching_up: dict[str, asyncio.Task[None]] = {}

    async def admit(self, backend: EngineBackend) -> Engine:
        """Add `backend` to the pool; it serves only once it runs the current weight version."""
        version = await reported_version(backend)
        replica = self.pool.add(backend, version=version, stale=version != self.weights.version)
        if replica.stale and self.weights.last_source is not None:
            await self.catch_up(replica)
        return replica

    async def verify(self, replica: Engine) -> None:
        """Run on every successful health probe. A restarted engine runs its initial weights, so a replica serves
        only while it reports the pool's version; otherwise it is held out (stale) and, where the weights came
        from a path, loaded with them — never left to sample under other weights than it is labelled with."""
        weights = self.weights
        if not weights.serving:
            return  # mid-update the versions differ by design; the update itself verifies every replica
        updates = weights.updates
        version = await reported_version(replica.backend)
        if version is None:
            # The read failed (a reset connection, a busy engine): that proves nothing about its weights. Holding
            # the replica out on it would keep it out for good, since a later reading of the pool's version does
            # not re-admit a stale replica (only loading the weights does).
            return

        def moved() -> bool:  # an update began or ended meanwhile (a `serving` event too): the reading proves nothing
            return not weights.serving or weights.updates != updates or version == weights.version

        if moved():
            return
        if version > weights.version and await weights.adopt_recorded():
            return  # this process had missed an update's result (its subscription was down): now it has it
        if moved():
            return
        if not replica.stale:
            logger.warning(
                "replica %s reports weight version %s, the pool runs %d: held out until it catches up",
                replica.id,
                version,
                weights.version,
                extra={"replica": replica.id, "version": version},
            )
        self.pool.mark_stale(replica, runs=version)
        self.pool.notify()
        # Never back to an older version: a replica ahead of every record (one lost to a Redis failover) waits for
        # the next update rather than have two processes load their own versions onto it in turns.
        if weights.last_source is not None and version < weights.version:
            self._catch_up_in_background(replica)

    async def catch_up(self, replica: Engine) -> None:
        """Load the current weights onto a replica (only possible when they came from a path)."""
        try:
            await self.weights.load_current(replica)
        except BackendError as exc:
            logger.error(
                "replica %s could not load version %s: %s",
                replica.id,
                self.weights.version,
                exc,
                extra={"replica": replica.id, "version": self.weights.version},
            )

    def _catch_up_in_background(self, replica: Engine) -> None:
        """The health loop must not wait for a weight load (it queues behind any update in progress)."""
        if replica.id in self._catching_up:
            return
        task = asyncio.create_task(self.catch_up(replica), name=f"catch-up-{replica.id}")
        self._catching_up[replica.id] = task  # hard reference until done
        task.add_done_callback(lambda _: self._catching_up.pop(replica.id, None))

    async def aclose(self) -> None:
        await stop(*self._catching_up.values())
