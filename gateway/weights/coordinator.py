"""Weight versions: one coordinator per gateway process pauses the pool, updates every replica, verifies and resumes.

Generation awaits `until_serving()`, which returns at once unless an update (or an out-of-band pause) is under
way, so requests interrupted by an update wait on an event rather than polling. Updates are serialized; a
version older than or equal to the current one is a 409. A replica that fails to update is drained and marked
stale (it serves nothing until a later update succeeds on it), so no request ever mixes weights silently.

An update that loads on no replica is rolled back instead (`WeightsNotUpdated`, a 502): the version stays, and
each replica whose engine refused the load (`WeightsNotLoaded`) and still reports the previous version's label
resumes on the weights it kept, so the interrupted requests finish under the previous version. A replica that
failed otherwise (a timeout: its weights are unknown) or reports another label is held out as stale.

The coordinator is the facade of the package: the steps over the replicas are `sequence.UpdateSequence`, the bus
side of leading an update `leader.Leadership`, following the others' `follower.Follower`, recovering from a dead
coordinator `recovery.Recovery`, the out-of-band sync `bracket.OutOfBandSync`; its state moves along
`state.TRANSITIONS` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from backends.base import PauseMode
from gateway.background import stop
from gateway.errors import Conflict, StoreError, WeightsNotRecorded, WeightsNotUpdated, WeightsUpdateTimedOut
from gateway.routing import Engine, ReplicaPool
from gateway.store import Serving, WeightsBus, WeightsRecord
from gateway.weights.bracket import OutOfBandSync
from gateway.weights.follower import Follower
from gateway.weights.gate import ServingGate
from gateway.weights.labels import newer, version_label
from gateway.weights.leader import Leadership
from gateway.weights.report import UpdateReport
from gateway.weights.sequence import Plan, UpdateSequence
from gateway.weights.state import State, StateMachine
from gateway.weights.transfer import Transfers

logger = logging.getLogger(__name__)

MEMBER_TTL_S = 10.0
"""The default of `weights.member_ttl_s`: how long a gateway process counts as on the weights bus after its last
heartbeat (every fifth of it). A `wait` update waits for the live ones to drain their requests, so one that died
holds it for this long at most. A process coordinating an update is taken for dead, its lock taken over and the pool
recovered (`Recovery`), once its membership expired that long ago too: no heartbeat for twice the TTL, so that a
Redis failover, which stops every process's heartbeat for seconds, is not taken for a death."""


class WeightCoordinator:
    """Owns the current version and the pause → update → verify → resume sequence."""

    def __init__(
        self,
        pool: ReplicaPool,
        *,
        initial_version: int = 0,
        default_mode: PauseMode = "abort",
        update_timeout_s: float = 600.0,
        transfer_commit_timeout_s: float = 300.0,
        bus: WeightsBus | None = None,
        member_ttl_s: float = MEMBER_TTL_S,
        flush_caches: bool = True,
    ) -> None:
        self.pool = pool
        self.bus = bus
        self.member_ttl_s = member_ttl_s
        self.heartbeat_s = member_ttl_s / 5
        self._version = initial_version
        self._version_moved = asyncio.Event()  # set (and replaced) whenever the version changes
        self.default_mode = default_mode
        self.update_timeout_s = update_timeout_s
        self.last_source: str | None = None
        self.updates = 0
        self.machine = StateMachine()
        self.gate = ServingGate()
        # Serializes what changes the replicas' weights in this process (updates, catch-ups, the recovery), each
        # within one task; an out-of-band sync holds it only while it pauses and while it resumes.
        self.lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.flush_caches = flush_caches
        self.sequence = UpdateSequence(pool, self.machine, self._tasks, flush_caches=flush_caches)
        self.leader = (
            Leadership(bus, member_ttl_s=member_ttl_s, update_timeout_s=update_timeout_s) if bus is not None else None
        )
        self._follower: Follower | None = None
        self.transfers = Transfers(self, transfer_commit_timeout_s)  # the two-phase in-memory updates
        self._bracket: OutOfBandSync | None = None  # the out-of-band sync held now
        self._expired: OutOfBandSync | None = None  # the last one that ended at its deadline (a later resume's 409)
        # The version an update of this process is loading (None: none, or an out-of-band sync's, not known yet).
        self.upcoming_version: int | None = None
        # The last update whose version serves but whose record is not durable (`WeightsNotRecorded`): the same
        # request again records it (`_record_again`) instead of a 409 for a version not newer.
        self._unrecorded: UpdateReport | None = None
        # Called with the report of every update this process ran, a failed one included (`report.status`).
        self.on_update: list[Callable[[UpdateReport], Awaitable[None] | None]] = []

    @property
    def version(self) -> int:
        """The weight version the pool serves, as this process knows it (its own updates, the others' results)."""
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        if version != self._version:
            self._version = version
            self._version_moved.set()  # wakes `version_after`'s waiters
            self._version_moved = asyncio.Event()

    async def version_after(self, version: int, timeout: float) -> int:
        """The version once it is other than `version`, or at `timeout` (seconds) whatever it is then."""
        if self._version == version:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._version_moved.wait()
        return self._version

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def serving(self) -> bool:
        return self.gate.is_open

    @property
    def released_at(self) -> float:
        """Monotonic time the held requests were last released: the origin of each continuation's dispatch
        latency."""
        return self.gate.released_at

    async def until_serving(self, timeout: float | None = None) -> None:
        """Return once no update or pause is under way (at once in the common case)."""
        await self.gate.wait(timeout)

    def begin(self) -> None:
        """An update sequence starts here: stop dispatching."""
        self.gate.close()
        self.machine.to(State.PAUSING)

    def end(self) -> None:
        """An update sequence ended (however): dispatch again."""
        self.machine.to(State.SERVING)
        self.gate.release()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A background task of the coordinator, stopped by `aclose`."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)  # hard reference until done
        task.add_done_callback(self._tasks.discard)
        return task

    # -- full update ---------------------------------------------------------------------------

    async def update(self, version: int, source: str | None = None, mode: PauseMode | None = None) -> UpdateReport:
        """Pause every replica, load `version` (from the path `source`, or with None: synced out of band, only
        relabel), verify, resume. Some replicas failing is a `partial` report (they are stale); all of them
        failing raises `WeightsNotUpdated` after the rollback (see the module docstring)."""
        mode = mode or self.default_mode
        if (again := await self._record_again(version)) is not None:
            return again
        async with self.lock, self._leading(version, mode) as token:
            self._expired = None
            started = time.monotonic()
            previous = self.version
            report = UpdateReport(version, mode, started_at=time.time())
            self.upcoming_version = version
            self.begin()
            timed_out = False
            unrecorded: StoreError | None = None
            try:
                async with asyncio.timeout(self.update_timeout_s):
                    await self.followers_drained(mode, token, version)
                    await self.sequence.run(mode, Plan.update(version, source, previous), report)
            except TimeoutError:
                timed_out = True
            finally:
                self.upcoming_version = None
                self.version = version if report.updated else self.version
                self.last_source = source if report.updated else self.last_source
                unrecorded = await self.publish_result(report, token)
                self.end()
                report.finished_at = time.time()
            report.duration_s = time.monotonic() - started
            if timed_out:
                await self.announce(report)
                raise self._timed_out(previous, report)
            if not report.updated:
                await self.announce(report)  # a failed update is announced too (status "failed")
                raise self.failed(previous, report)
            self.updates += 1
            logger.info(
                "weights: version %d (%s) on %s; stale: %s",
                version,
                mode,
                report.updated,
                report.stale,
                extra={"version": version},
            )
            await self.announce(report)
            if unrecorded is not None:
                raise self.not_recorded(report, unrecorded)
            return report

    async def _record_again(self, version: int) -> UpdateReport | None:
        """A request for the version that serves here unrecorded (`WeightsNotRecorded`), sent again: its record
        written again under the bus lock; the report, or `WeightsNotRecorded` once more. None for any other
        request (it goes its own way: a version not newer is a 409)."""
        report = self._unrecorded
        if report is None or version != self.version or self.leader is None:
            return None
        async with self.lock:
            if self._unrecorded is not report or version != self.version:
                return None  # recorded, or overtaken, meanwhile
            unrecorded = await self.leader.record_again(report, self.version, self.last_source)
            if unrecorded is not None:
                raise self.not_recorded(report, unrecorded)
            self._unrecorded = None
            logger.info("weights: version %d recorded", version, extra={"version": version})
            return report

    def not_recorded(self, report: UpdateReport, cause: StoreError) -> WeightsNotRecorded:
        """The error for an update whose version serves but whose record in `rg:weights` is not durable; the same
        request again records it (`_record_again`)."""
        self._unrecorded = report
        message = (
            f"weight version {report.version} serves on {report.updated} (stale: {report.stale}), but its record "
            "(rg:weights) did not reach the Redis replicas redis.durable_replicas asks for, or Redis at all: a Redis "
            "failover could lose it; the same request again records it"
        )
        logger.error("weights: %s (%s)", message, cause, extra={"version": report.version})
        details: dict[str, object] = {
            "version": self.version,
            "status": report.status,
            "updated": report.updated,
            "stale": report.stale,
        }
        return WeightsNotRecorded(message, details)

    def failed(self, previous: int, report: UpdateReport) -> WeightsNotUpdated:
        """The error for an update that loaded nowhere, naming each replica's failure."""
        why = "; ".join(f"{replica}: {error}" for replica, error in report.errors.items()) or "no replica in the pool"
        serving = f"replicas {report.kept} serve version {previous} as before" if report.kept else "no replica serves"
        logger.error(
            "weights: version %d loaded on no replica (%s); %s; stale: %s",
            report.version,
            why,
            serving,
            report.stale,
            extra={"version": report.version},
        )
        details: dict[str, object] = {
            "version": previous,
            "requested_version": report.version,
            "status": report.status,
            "kept": report.kept,
            "stale": report.stale,
            "errors": report.errors,
        }
        return WeightsNotUpdated(f"weight version {report.version} loaded on no replica ({why}); {serving}", details)

    def _timed_out(self, previous: int, report: UpdateReport) -> WeightsUpdateTimedOut:
        """The error for an update past `weights.update_timeout_s`, saying where it stopped."""
        serving = report.updated or report.kept
        message = (
            f"weight version {report.version} did not finish within weights.update_timeout_s = "
            f"{self.update_timeout_s:g} s; the gateway serves version {self.version} (on {serving}), "
            f"stale: {report.stale}"
        )
        logger.error("weights: %s", message, extra={"version": report.version})
        details: dict[str, object] = {
            "version": self.version,
            "previous_version": previous,
            "requested_version": report.version,
            "status": report.status,
            "updated": report.updated,
            "kept": report.kept,
            "stale": report.stale,
            "errors": report.errors,
        }
        return WeightsUpdateTimedOut(message, details)

    def check_newer(self, version: int) -> None:
        if version <= self.version:
            raise Conflict(f"weight version {version} is not newer than {self.version}", param="version")

    def check_idle(self) -> None:
        """Under `lock`: nothing but an out-of-band sync or an in-memory transfer can hold the replicas now; while
        one does, a 409."""
        if (held := self.transfers.held) is not None:
            raise Conflict(
                f"an in-memory transfer of version {held.version} is under way "
                f"(POST /admin/weights/{held.version}/commit ends it)",
                param="version",
            )
        if self.machine.state is State.PAUSED:
            raise Conflict(
                "the gateway is paused for an out-of-band weight sync (POST /admin/resume ends it)", param="version"
            )

    @contextlib.asynccontextmanager
    async def _leading(self, version: int, mode: PauseMode) -> AsyncIterator[str | None]:
        """This process as the one that updates the shared replicas for the length of a block (`Leadership`; the
        lock's token, None without a bus)."""
        self.check_idle()
        self.check_newer(version)
        if self.leader is None:
            yield None
            return
        async with self.leader.held(version, mode) as token:
            yield token

    async def followers_drained(self, mode: PauseMode, token: str | None, version: int | None) -> None:
        if self.leader is not None and token is not None:
            await self.leader.followers_drained(mode, token, version)

    async def publish_result(self, report: UpdateReport, token: str | None) -> StoreError | None:
        """Record and announce the result of the update that held the lock `token` (`Leadership.publish_result`);
        the error where the record is not durable."""
        if self.leader is None:
            return None
        return await self.leader.publish_result(report, self.version, self.last_source, token)

    async def load_current(self, replica: Engine) -> bool:
        """Load the current version onto one replica (a newcomer, or one that restarted on other weights).

        Serialized with updates (the same lock): run concurrently, a catch-up and an update could interleave
        inside the engine and leave it holding one version's weights under the other's label. Returns whether
        the replica now serves the current version; False when the weights did not come from a path, while an
        out-of-band sync holds the replicas (the next health probe tries again), or when the replica runs a newer
        version by now (the catch-up was decided before an update this process has not heard of yet: loading
        would take the replica back to older weights)."""
        async with self.lock:
            if self.last_source is None or self.machine.state is State.PAUSED or self.transfers.held is not None:
                return False
            label = version_label(self.version)
            found = await replica.backend.weight_version()
            if newer(found, self.version):
                return False
            cache_clean = True
            if found != label:
                # Flushed whatever the salt: requests sent to it before it was held out (it restarted unseen) were
                # salted for this version but prefilled under the weights it ran, and their blocks are cached.
                cache_clean = await replica.backend.update_weights(label, self.last_source, flush=True)
                if await replica.backend.weight_version() != label:
                    return False
            self.pool.set_version(replica, self.version)
            if not cache_clean:
                # Requests that ran on the old weights hold KV blocks; they would enter the prefix cache when they
                # finish and later prompts would reuse them. Out of rotation until they are gone and it is flushed.
                self.sequence.flush_when_idle(replica)
            self.pool.notify()
            return True

    # -- out-of-band sync (NCCL, checkpoint engine) ----------------------------------------------

    async def pause(self, mode: PauseMode | None = None) -> OutOfBandSync:
        """Pause for an out-of-band weight sync; `resume(version)` ends it. Past `weights.update_timeout_s` from
        now it ends as a failed update instead (`_end_at_deadline`)."""
        mode = mode or self.default_mode
        async with self.lock:
            self.check_idle()
            started = time.monotonic()
            token = await self.leader.take(None, mode) if self.leader is not None else None
            report = UpdateReport(self.version, mode, started_at=time.time())
            self.begin()
            try:
                async with asyncio.timeout(self.update_timeout_s):
                    await self.followers_drained(mode, token, None)
                await self.sequence.pause(mode, report)
            except BaseException:
                self.machine.to(State.SERVING)
                self.gate.reopen()
                if self.leader is not None and token is not None:
                    await self.leader.give_back(token)
                raise
            self.machine.to(State.PAUSED)
            now = time.monotonic()
            bracket = OutOfBandSync(token, report, started, now, started + self.update_timeout_s)
            self._bracket, self._expired = bracket, None
            bracket.arm(self._end_at_deadline)
            return bracket

    async def resume(self, version: int) -> UpdateReport:
        """Label the out-of-band weights `version` on every replica, verify, resume."""
        if (again := await self._record_again(version)) is not None:
            return again
        bracket = self._bracket
        if bracket is None:
            raise self._not_paused()
        self.check_newer(version)  # a 409 here leaves the gateway paused: resume again with a newer version
        self._bracket = None
        bracket.disarm()
        report = bracket.report
        report.version = version
        unrecorded: StoreError | None = None
        async with self.lock:
            try:
                await self.sequence.finish(Plan.relabel_synced(version, self.version), report)
                self.version = version
            finally:
                unrecorded = await self._close(bracket)
        report.duration_s = time.monotonic() - bracket.paused_at  # pause → resume: the whole out-of-band sync
        self.updates += 1
        await self.announce(report)
        if unrecorded is not None:
            raise self.not_recorded(report, unrecorded)
        return report

    def _not_paused(self) -> Conflict:
        expired = self._expired
        if expired is None:
            return Conflict("the gateway is not paused (POST /admin/pause first)")
        return Conflict(
            f"the out-of-band weight sync was not resumed within {expired.timeout_s:g} s (weights.update_timeout_s): "
            f"it ended as a failed update and the replicas serve version {self.version} "
            f"(kept: {expired.report.kept}; stale: {expired.report.stale}); POST /admin/pause to sync again"
        )

    async def _close(self, bracket: OutOfBandSync) -> StoreError | None:
        """The end of an out-of-band sync, however it ended: the result published, the bus lock given back, serving.
        The error where the result's record is not durable (`publish_result`)."""
        unrecorded = await self.publish_result(bracket.report, bracket.token)
        if self.leader is not None and bracket.token is not None:
            await self.leader.give_back(bracket.token)
        self.end()
        bracket.report.finished_at = time.time()
        return unrecorded

    async def _end_at_deadline(self, bracket: OutOfBandSync) -> None:
        """The out-of-band sync was not resumed in time (the trainer died, or forgot): end it as a failed update.
        Each replica whose label shows the version the pool served resumes on it (`kept`); any other is stale."""
        async with self.lock:
            if self._bracket is not bracket:
                return  # resumed meanwhile
            self._bracket, self._expired = None, bracket
            report = bracket.report
            try:
                await self.sequence.finish(Plan.abandon(self.version), report)
            finally:
                await self._close(bracket)
        report.duration_s = time.monotonic() - bracket.paused_at
        logger.error(
            "weights: the out-of-band sync was not resumed within %g s (weights.update_timeout_s): ended as a failed "
            "update; version %d serves on %s; stale: %s",
            bracket.timeout_s,
            self.version,
            report.kept,
            report.stale,
            extra={"version": self.version},
        )
        await self.announce(report)

    # -- several gateway processes on one Redis ----------------------------------------------------

    async def start_following(self, within_s: float = 5.0) -> None:
        """Follow updates that other gateway processes coordinate, and tell them this process is there. Returns once
        it is subscribed and knows of an update running now (it follows it: a process started mid-update must not
        serve before its end), or after `within_s` where Redis does not answer (it catches up once it does)."""
        if self.leader is not None and self._follower is None:
            self._follower = Follower(self, self.leader)
            self._follower.start()
            await self._follower.until_caught_up(within_s)

    async def adopt_recorded(self) -> bool:
        """Adopt the version `rg:weights` records where it is newer than this process's (a `serving` event it
        missed); whether it was. False too while an update runs here or Redis does not answer."""
        if self.bus is None or not self.serving or self.lock.locked():
            return False
        try:
            record = await self.bus.read()
        except StoreError:
            return False
        if record is None or record.version <= self.version or not self.serving:
            return False
        logger.warning("weights: version %d, recorded, was not announced here", record.version)
        self.adopt_record(record)
        return True

    def adopt_record(self, record: WeightsRecord | None) -> None:
        """`adopt` what `rg:weights` records, as if its `serving` event had arrived (none: serve on as is)."""
        self.adopt(record.as_event() if record else Serving(self.version))

    def adopt(self, event: Serving) -> None:
        """Take another process's update result: its version (where not older), its updated and stale replicas;
        dispatch again. Ignored while this process runs an update of its own (a result of a process whose lock it
        took over, thinking it dead): its own result decides."""
        if self.machine.state not in (State.SERVING, State.FOLLOWING):
            logger.warning("weights: ignored another process's result (version %s) while %s", event.version, self.state)
            return
        version = event.version
        if version is not None and version >= self.version:
            if version > self.version:  # a failed update, or a recovery, announces the version it kept
                self.updates += 1
            self.version = version
            self.last_source = event.source if event.source is not None else self.last_source
            updated, stale = set(event.updated), set(event.stale)
            for replica in self.pool.engines():
                if replica.id in updated:
                    self.pool.set_version(replica, version)
                elif replica.id in stale:
                    self.pool.mark_stale(replica)
            self.pool.notify()
        if self.machine.state is State.FOLLOWING:
            self.machine.to(State.SERVING)
        self.gate.release()

    async def announce(self, report: UpdateReport) -> None:
        for callback in self.on_update:
            result = callback(report)
            if result is not None:
                await result

    async def aclose(self) -> None:
        self.gate.aclose()
        if self._follower is not None:
            await self._follower.aclose()
        await self.transfers.aclose()
        for bracket in (self._bracket, self._expired):  # a deadline may be ending one now
            if bracket is not None:
                await bracket.aclose()
        await stop(*self._tasks)
