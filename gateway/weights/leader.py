"""Coordinating an update among the gateway processes that share one Redis: the bus side of the leader.

The process that runs an update takes `rg:weights:lock`, checks the version against `rg:weights`, announces
`pausing` (the others stop dispatching), in `wait` mode waits for the others to drain their own requests, and at
the end records and announces the result (`serving`) before it lets the lock go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from backends.base import PauseMode
from gateway.errors import Conflict, StoreError
from gateway.store import Pausing, Serving, WeightsBus
from gateway.weights.report import SLOW_DRAIN_S, UpdateReport

logger = logging.getLogger(__name__)


class Leadership:
    """This process as the one that updates the shared replicas."""

    def __init__(self, bus: WeightsBus, *, member_ttl_s: float, update_timeout_s: float) -> None:
        self.bus = bus
        self.member_ttl_s = member_ttl_s
        self.heartbeat_s = member_ttl_s / 5
        self.update_timeout_s = update_timeout_s
        self._drained_news = asyncio.Event()  # a follower reported its requests drained (`followers_drained`)

    async def take(self, version: int | None, mode: PauseMode, *, transfer: int | None = None) -> str:
        """Take the Redis lock, check that `version` is still new cluster-wide, tell the others to stop dispatching
        (and, in `wait` mode, to drain their own requests: `followers_drained`). `transfer`: the version of the
        in-memory transfer the lock is taken for (any process may relay its commit). The lock's token; a 409 where
        another process holds the lock or recorded `version` already."""
        token = self.bus.new_token()
        pausing = Pausing(version, mode, token, transfer)
        # On the bus before the lock: a holder whose heartbeat is not there counts as dead (`WeightsBus.acquire`).
        await self.bus.join(self.member_ttl_s)
        # The lock says what the update is: a process that misses `pausing` (it starts, or its subscription is
        # down) follows it from the lock as if it had heard it (`Follower._catch_up`).
        if not await self.bus.acquire(token, self.update_timeout_s + 30, self.member_ttl_s, update=pausing):
            raise Conflict("another gateway process is applying a weight update", param="version")
        try:
            record = await self.bus.read()
            if version is not None and record is not None and record.version >= version:
                raise Conflict(f"weight version {version} is not newer than {record.version}", param="version")
            await self.bus.announce(pausing)
        except BaseException:
            await self.give_back(token)
            raise
        return token

    async def give_back(self, token: str) -> None:
        """Let the lock go (a Redis still away after the retries: it expires with its TTL)."""
        with contextlib.suppress(StoreError):
            await self.bus.release(token)

    @contextlib.asynccontextmanager
    async def held(self, version: int | None, mode: PauseMode) -> AsyncIterator[str]:
        """`take` for the length of a block."""
        token = await self.take(version, mode)
        try:
            yield token
        finally:
            await self.give_back(token)

    def note_drained(self) -> None:
        """A `drained` event arrived: `followers_drained` reads the reports again."""
        self._drained_news.set()

    async def followers_drained(self, mode: PauseMode, token: str, version: int | None) -> None:
        """`wait` across processes: before any replica is paused, every other live gateway process on the bus has
        stopped dispatching and seen its own requests end on the replicas without a native `wait` (the pause that
        follows aborts whatever runs there, whichever process sent it). While some have not reported it, `pausing`
        goes out again every heartbeat: a process whose subscription was down missed it, and a report written to a
        Redis master that died before its replica had it is lost (a failover)."""
        if mode != "wait":
            return
        # The processes on the bus when `pausing` went out; one that joins later never saw it, so is not waited for.
        expected = await self.bus.members()
        started = time.monotonic()
        while True:
            self._drained_news.clear()
            waiting = (expected & await self.bus.members()) - await self.bus.drained(token)
            if not waiting:
                return
            if (waited := time.monotonic() - started) > SLOW_DRAIN_S:
                logger.warning(
                    "weights: the wait update to version %s has waited %.0f s for gateway processes %s to report "
                    "their requests drained",
                    version,
                    waited,
                    sorted(waiting),
                    extra={"version": version},
                )
            else:
                logger.info("weights: waiting for %d gateway processes to drain their requests", len(waiting))
            # Woken by each report; re-read at least every heartbeat, so a process that died stops being waited for.
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self._drained_news.wait()
            except TimeoutError:
                await self.bus.announce(Pausing(version, mode, token))

    async def publish_result(
        self, report: UpdateReport, version: int, source: str | None, token: str | None = None
    ) -> StoreError | None:
        """Record in `rg:weights` and announce the version the pool serves after `report` (the previous one after a
        failed update: the followers keep it), naming the lock `token` the update held. The engines run it whatever
        happens here: a record Redis did not take, or took on fewer replicas than `redis.durable_replicas`
        (`WeightsBus.record`, retried), is logged and returned, for the update to answer `WeightsNotRecorded`; the
        announcement goes out all the same."""
        event = Serving(version, source, report.status, tuple(report.updated), tuple(report.stale), token)
        unrecorded: StoreError | None = None
        try:
            await self.bus.record(version, "serving", source, report.updated, report.stale)
        except StoreError as exc:
            logger.error("weights: version %d not recorded: %s", version, exc, extra={"version": version})
            unrecorded = exc
        try:
            await self.bus.announce(event)
        except StoreError as exc:  # the followers time out and re-read
            logger.error("weights: could not announce version %d: %s", version, exc, extra={"version": version})
        return unrecorded

    async def record_again(self, report: UpdateReport, version: int, source: str | None) -> StoreError | None:
        """Record `report`'s result again (its first record was not durable: `publish_result`), under the update
        lock, so that no other process's newer record is overwritten: a newer version recorded meanwhile is a 409.
        Nothing is announced (the first time was). The error where it is still not durable."""
        token = self.bus.new_token()
        if not await self.bus.acquire(token, self.update_timeout_s + 30, self.member_ttl_s):
            raise Conflict("another gateway process is applying a weight update", param="version")
        try:
            record = await self.bus.read()
            if record is not None and record.version > version:
                raise Conflict(f"weight version {record.version} is recorded since; {version} is not newer")
            await self.bus.record(version, "serving", source, report.updated, report.stale)
        except StoreError as exc:
            logger.error("weights: version %d not recorded: %s", version, exc, extra={"version": version})
            return exc
        finally:
            await self.give_back(token)
        return None
