"""Recovering the pool from an update that will not end by itself: its coordinating process died, or it outlasted
`weights.update_timeout_s`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from gateway.errors import StoreError
from gateway.store import Pausing, WeightsRecord
from gateway.weights.host import Coordinator
from gateway.weights.leader import Leadership
from gateway.weights.report import UpdateReport
from gateway.weights.sequence import Plan
from gateway.weights.state import State

logger = logging.getLogger(__name__)


class Watcher(Protocol):
    """The process's `Follower`, as far as a recovery hands the update back to it."""

    followed: str | None

    def following(self, token: str | None) -> bool: ...

    def watch(self, token: str | None, version: int | None) -> None: ...

    def follow(self, event: Pausing) -> None: ...


class Recovery:
    """A follower's way out of an update that hangs (docs/architecture.md §5)."""

    def __init__(self, weights: Coordinator, follower: Watcher, leader: Leadership) -> None:
        self.weights = weights
        self.follower = follower
        self.leader = leader
        self.bus = leader.bus

    async def recover(self, dead: str | None, version: int | None, died: bool) -> None:
        """The update `dead` will not end by itself: its coordinating process `died`, or it outlasted
        `weights.update_timeout_s`. After a death, take over its lock and bring the pool back to the version
        recorded in Redis (`rg:weights`, the last one announced): every replica is paused (`abort`: its requests
        resume on the gateway's side, tokens kept); one that reports that version resumes, one that reports another
        is loaded with it again from the recorded path, or held out as stale; the result is announced as an
        update's. Where another process took the lock meanwhile (a new update, another process recovering),
        follow that one; otherwise adopt the record and dispatch again."""
        bus, weights, follower = self.bus, self.weights, self.follower
        async with weights.lock:
            if not follower.following(dead):
                return
            token, ttl_s = bus.new_token(), weights.update_timeout_s + 30
            try:
                record = await bus.read()
                # The recovery is an update of the recorded version: its lock says so, as its `pausing` will.
                restoring = Pausing(record.version if record else weights.version, "abort", token)
                taken = died and dead is not None and await bus.take_over(dead, token, ttl_s, update=restoring)
                holder = None if taken else await bus.update_under_way()
            except StoreError as exc:
                logger.error("weights: cannot recover from the update to version %s yet: %s", version, exc)
                follower.watch(dead, version)  # again, a heartbeat later
                return
            if taken:
                await self._restore(token, record)
            elif holder is not None and holder.token != dead:
                follower.follow(holder)  # what its lock says it is, as if its `pausing` had arrived
            else:
                weights.adopt_record(record)

    async def _restore(self, token: str, record: WeightsRecord | None) -> None:
        """`recover`'s work once it holds the lock (`token`): the update sequence with a restoring load."""
        weights = self.weights
        version, source = (record.version, record.source) if record else (weights.version, weights.last_source)
        report = UpdateReport(version, "abort", started_at=time.time())
        weights.machine.to(State.PAUSING)
        try:
            await self.bus.announce(Pausing(version, "abort", token))
            async with asyncio.timeout(weights.update_timeout_s):
                await weights.sequence.run("abort", Plan.restore(version, source), report)
        finally:
            weights.version, weights.last_source = max(version, weights.version), source
            await self.leader.publish_result(report, weights.version, weights.last_source, token)
            await self.leader.give_back(token)
            self.follower.followed = None
            weights.end()
            report.finished_at = time.time()
        logger.warning(
            "weights: recovered on version %d: %s serve it; stale: %s",
            version,
            report.updated,
            report.stale,
            extra={"version": version},
        )
