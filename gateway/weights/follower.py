"""Following the updates other gateway processes coordinate.

On `pausing` this process stops dispatching (`FOLLOWING`) until the result (`serving`), and in `wait` mode drains
its own requests and reports it. It stays on the bus with a heartbeat. What it missed while its subscription was
down (a Redis restart or failover, this process starting mid-update) is read back as soon as the subscription is
in place again: an update that holds the lock is followed as if its `pausing` had arrived (the lock keeps that
event beside it: version, mode, token; `WeightsBus.update_under_way`), a result recorded in `rg:weights` adopted as
if its `serving` had. Serving on meanwhile would label tokens with one version and salt the engines' caches with
another (a `keep` update flushes nothing). A result missed while following is made up for from `rg:weights` once the
lock no longer names the update; an update whose coordinator died, or that outlasts `weights.update_timeout_s`, is
recovered (`Recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gateway.background import stop
from gateway.errors import StoreError
from gateway.store import Commit, Drained, Pausing, Serving, Subscribed
from gateway.store.core import backoff_s
from gateway.weights.host import Coordinator
from gateway.weights.leader import Leadership
from gateway.weights.recovery import Recovery
from gateway.weights.state import State

logger = logging.getLogger(__name__)


class Follower:
    """This process as a follower of the others' updates (and a member of the bus)."""

    def __init__(self, weights: Coordinator, leader: Leadership) -> None:
        self.weights = weights
        self.leader = leader
        self.bus = leader.bus
        self.followed: str | None = None  # the token of the update another process coordinates, while following
        self._draining: set[str] = set()  # the updates whose drain this process is reporting (`_drain_and_report`)
        self._follow_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.caught_up = asyncio.Event()  # set once the first subscription has read back what it missed
        self.recovery = Recovery(weights, self, leader)

    def start(self) -> None:
        """Follow updates that other gateway processes coordinate, and tell them this process is there."""
        if self._follow_task is None:
            # Hard references: the loop keeps only weak references to tasks.
            self._follow_task = asyncio.create_task(self._follow(), name="weights-follow")
            self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="weights-heartbeat")

    async def until_caught_up(self, within_s: float) -> None:
        """Until the first subscription has read back what it missed (`_catch_up`), `within_s` at most; at once where
        Redis does not answer (it catches up once Redis is back)."""
        try:
            await self.bus.holder()
        except StoreError:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.caught_up.wait(), within_s)

    async def aclose(self) -> None:
        await stop(self._follow_task, self._heartbeat_task)
        if self._heartbeat_task is not None:
            with contextlib.suppress(StoreError):
                await self.bus.leave()  # a `wait` update stops waiting for this process at once

    def following(self, token: str | None) -> bool:
        """Whether this process follows the update `token` now."""
        return self.weights.machine.state is State.FOLLOWING and self.followed == token

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self.bus.join(self.weights.member_ttl_s)
            except StoreError as exc:  # the others stop waiting for this process once its last heartbeat expires
                logger.warning("weights: heartbeat failed: %s", exc)
            await asyncio.sleep(self.weights.heartbeat_s)

    async def _follow(self) -> None:
        async for event in self.bus.events():
            if isinstance(event, Pausing):
                self.follow(event)
            elif isinstance(event, Serving):
                self.followed = None
                self.weights.adopt(event)
                self.weights.transfers.serving_seen(event)
            elif isinstance(event, Commit):
                self.weights.transfers.commit_asked(event)
            elif isinstance(event, Drained):
                self.leader.note_drained()
            elif isinstance(event, Subscribed):
                await self._catch_up()
                self.caught_up.set()

    async def _catch_up(self) -> None:
        """Read back what the events sent while this process was not subscribed said (see the module docstring).
        Nothing while it runs an update of its own (its result decides), nor where Redis does not answer (its next
        subscription reads again)."""
        weights = self.weights
        if weights.lock.locked() or weights.machine.state not in (State.SERVING, State.FOLLOWING):
            return
        try:
            update = await self.bus.update_under_way()
            record = await self.bus.read() if update is None else None
        except StoreError:
            return
        if weights.lock.locked():
            return  # this process began an update meanwhile
        if update is not None:
            if not self.following(update.token):
                logger.warning(
                    "weights: an update (version %s, %s) began unannounced here (lock %s): following it",
                    update.version,
                    update.mode,
                    update.token,
                )
            self.follow(update)  # the lock says what the missed `pausing` did (`WeightsBus.update_under_way`)
            return
        if weights.machine.state is State.FOLLOWING or (record is not None and record.version > weights.version):
            logger.warning("weights: version %s, recorded, was not announced here", record.version if record else None)
            self.followed = None
            weights.adopt_record(record)

    def follow(self, event: Pausing) -> None:
        """Follow the update `event` announces (or its lock says, for a process that missed the event): stop
        dispatching until its result; in `wait` mode, drain and report."""
        machine = self.weights.machine
        if machine.state not in (State.SERVING, State.FOLLOWING):
            return  # not while it coordinates one itself
        token = event.token
        if token is None or not self.following(token):  # not an update it follows already (`pausing` again)
            if machine.state is State.SERVING:
                self.weights.gate.close()
                machine.to(State.FOLLOWING)
            self.followed = token
            self.watch(token, event.version)
        if event.mode == "wait" and token is not None and token not in self._draining:
            self._drain_and_report(token)

    def _drain_and_report(self, token: str) -> None:
        """Follow a `wait` update: once this process's requests on the replicas without a native `wait` ended (it
        dispatches none meanwhile), report it drained to the coordinating process."""
        pool, bus = self.weights.pool, self.bus

        async def drain() -> None:
            for replica in pool.engines():
                if "wait" not in replica.backend.capabilities.pause_modes:
                    await self.weights.sequence.until_idle(replica)
            attempt = 0
            while self.following(token):  # the coordinating process waits for it while this one is alive
                try:
                    await bus.report_drained(token, self.weights.update_timeout_s + 30)
                    return
                except StoreError as exc:  # Redis away (a restart, a failover): again, until it is back
                    attempt += 1
                    logger.warning("weights: could not report this process drained (%s); retry %d", exc, attempt)
                    await asyncio.sleep(backoff_s(attempt))  # backoff between retries, not synchronisation

        self._draining.add(token)
        task = self.weights.spawn(drain(), "weights-drain")
        task.add_done_callback(lambda _: self._draining.discard(token))

    def watch(self, token: str | None, version: int | None) -> None:
        """Follow the update `token` to its result. If the process coordinating it dies first (no heartbeat on the
        bus for twice `member_ttl_s`), or it outlasts `weights.update_timeout_s`, recover (`Recovery.recover`)."""
        bus, weights = self.bus, self.weights
        holder = bus.holder_of(token) if token is not None else None

        async def watch() -> None:
            deadline = time.monotonic() + weights.update_timeout_s
            while self.following(token):
                await asyncio.sleep(weights.heartbeat_s)  # the heartbeat's own period: a death shows no sooner
                try:
                    update = await bus.update_under_way() if token is not None else None
                    lock = update.token if update is not None else None
                    # An out-of-band pause (no version) is not recovered from a death: the trainer may be writing
                    # weights into the engines, which must not serve until it says they are whole.
                    died = (
                        holder is not None and version is not None and not await bus.alive(holder, weights.member_ttl_s)
                    )
                    record = await bus.read() if lock is None and token is not None else None
                except StoreError:
                    continue  # Redis is away: nothing to decide by, and nobody can announce meanwhile
                if not self.following(token):
                    return
                if lock != token:
                    # The update ended, or another took the lock over, and the event saying so did not reach this
                    # process (its subscription was down: a Redis failover, a restart): as if it had.
                    logger.warning("weights: the update to version %s ended unannounced here", version)
                    if update is None:
                        self.followed = None
                        weights.adopt_record(record)
                    else:
                        self.follow(update)  # what it is was in the missed `pausing`, and is in its lock
                    return
                if died or time.monotonic() > deadline:
                    why = "its coordinating process died" if died else "no result within weights.update_timeout_s"
                    logger.error("weights: update to version %s: %s", version, why, extra={"version": version})
                    await self.recovery.recover(token, version, died)
                    return

        weights.spawn(watch(), "weights-watch")
