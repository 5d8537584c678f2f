"""Weight versions: one coordinator per gateway pauses the pool, updates every replica, verifies and resumes.

Generation awaits `until_serving()`, which returns at once unless an update (or an out-of-band pause) is under
way, so requests interrupted by an update wait on an event rather than polling. Updates are serialized; a
version older than or equal to the current one is a 409. A replica that fails to update is drained and marked
stale (it serves nothing until a later update succeeds on it), so no request ever mixes weights silently.

An update that loads on no replica is rolled back instead (`WeightsNotUpdated`, a 502): the version stays, and
each replica whose engine refused the load (`WeightsNotLoaded`) and still reports the previous version's label
resumes on the weights it kept, so the interrupted requests finish under the previous version. A replica that
failed otherwise (a timeout: its weights are unknown) or reports another label is held out as stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from backends.base import PauseMode
from backends.errors import BackendError, WeightsNotLoaded
from gateway.background import stop
from gateway.errors import Conflict, InvalidRequest, StoreError, WeightsNotUpdated
from gateway.routing import Replica, ReplicaPool
from gateway.store import WeightsBus, WeightsRecord
from gateway.store.core import backoff_s

logger = logging.getLogger(__name__)

CoordinatorState = Literal["serving", "pausing", "paused", "updating", "resuming", "following"]
UpdateStatus = Literal["updated", "partial", "failed"]
INITIAL_LABELS = frozenset({"default", ""})
MEMBER_TTL_S = 10.0
"""The default of `weights.member_ttl_s`: how long a gateway process counts as on the weights bus after its last
heartbeat (every fifth of it). A `wait` update waits for the live ones to drain their requests, so one that died
holds it for this long at most. A process coordinating an update is taken for dead, its lock taken over and the pool
recovered (`WeightCoordinator._recover`), once its membership expired that long ago too: no heartbeat for twice the
TTL, so that a Redis failover, which stops every process's heartbeat for seconds, is not taken for a death."""


def _pausing(version: int | None, mode: PauseMode, token: str) -> dict[str, object]:
    """The `pausing` event of the update `token` on the weights bus."""
    return {"event": "pausing", "version": version, "mode": mode, "token": token}


def version_label(version: int) -> str:
    """The label engines carry for a gateway version."""
    return str(version)


@functools.lru_cache(maxsize=64)  # asked once per segment; a set made per call otherwise
def version_labels(version: int) -> frozenset[str]:
    """Every label engines may carry for a gateway version: its own and, for version 0, the engines' initial ones
    (an engine that never had an update labels its tokens "default")."""
    return _VERSION_0_LABELS if version == 0 else frozenset((version_label(version),))


_VERSION_0_LABELS = frozenset({version_label(0)}) | INITIAL_LABELS


def parse_version(label: str) -> int:
    """A gateway version from an engine label; the engines' initial label ("default") is version 0."""
    if label in INITIAL_LABELS:
        return 0
    try:
        return int(label)
    except ValueError:
        raise InvalidRequest(f"engine weight version {label!r} is not an integer") from None


def _newer(label: str, version: int) -> bool:
    """Whether the engine label `label` names a version after `version` (a label that is no version: False)."""
    try:
        return parse_version(label) > version
    except InvalidRequest:
        return False


def _ids(value: object) -> set[str]:
    return {str(v) for v in value} if isinstance(value, list) else set()


@dataclass
class UpdateReport:
    """What one update did, for the admin API and metrics: the replicas that run `version` (`updated`), those
    held out (`stale`), those rolled back onto the previous weights after a failed update (`kept`), and the
    engines' errors by replica."""

    version: int
    mode: PauseMode
    updated: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    flush_pending: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    # Wall-clock times of its phases (the dashboard's timeline): pause asked, every replica paused, the weights
    # loaded and verified, serving again. 0.0: the phase was not reached.
    started_at: float = 0.0
    paused_at: float = 0.0
    loaded_at: float = 0.0
    finished_at: float = 0.0
    # Replicas whose engine refused the load and said it kept its weights: rolled back if no replica updated.
    refused: list[str] = field(default_factory=list)

    def note(self, replica: str, error: str) -> None:
        """Record a replica's failure (after any earlier one of the same update)."""
        earlier = self.errors.get(replica)
        self.errors[replica] = f"{earlier}; {error}" if earlier else error

    @property
    def status(self) -> UpdateStatus:
        """`updated`: every replica runs `version`; `partial`: some do, the others are stale; `failed`: none do."""
        if not self.updated:
            return "failed"
        return "partial" if self.stale else "updated"


class WeightCoordinator:
    """Owns the current version and the pause → update → verify → resume sequence."""

    def __init__(
        self,
        pool: ReplicaPool,
        *,
        initial_version: int = 0,
        default_mode: PauseMode = "abort",
        update_timeout_s: float = 600.0,
        bus: WeightsBus | None = None,
        member_ttl_s: float = MEMBER_TTL_S,
    ) -> None:
        self.pool = pool
        self.bus = bus
        self.member_ttl_s = member_ttl_s
        self.heartbeat_s = member_ttl_s / 5
        self._follow_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._drained_news = asyncio.Event()  # a follower reported its requests drained (`_followers_drained`)
        self.version = initial_version
        self.default_mode = default_mode
        self.update_timeout_s = update_timeout_s
        self.state: CoordinatorState = "serving"
        self.last_source: str | None = None
        self.updates = 0
        self._serving = asyncio.Event()
        self._serving.set()
        # Monotonic time waiters were last released (an update, a resume or a followed update ended): the origin
        # of each continuation's dispatch latency.
        self.released_at = 0.0
        self._gc_deferred = False  # `_release` turned the cyclic GC off; `_enable_gc` turns it back on
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._paused_report: UpdateReport | None = None
        self._paused_at = 0.0
        self._paused_token: str | None = None
        self._paused_leadership: contextlib.AbstractAsyncContextManager[str | None] | None = None
        self._followed: str | None = None  # the token of the update another process coordinates, while following
        self._draining: set[str] = set()  # the updates whose drain this process is reporting (`_drain_and_report`)
        # Called with the report of every update this process ran, a failed one included (`report.status`).
        self.on_update: list[Callable[[UpdateReport], Awaitable[None] | None]] = []

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    def _release(self) -> None:
        """Let the held requests go. Each one wakes in the next pass of the event loop and hands its continuation
        to the engine's HTTP client before it first suspends (a pooled connection is at hand); the client writes
        it from a task of its own, in the pass after. So the burst is two passes of the loop, whatever its size."""
        self.released_at = time.monotonic()
        defer_gc = gc.isenabled()
        if defer_gc:
            # A cyclic collection inside those passes stalls every request behind it, and the burst of new objects
            # triggers them: a full one walks every held stream's state on the heap. Collect once
            # the requests are out instead: `gc.enable` is queued behind the waiters' wake-ups, then (one hop
            # later) behind the write tasks they started.
            gc.disable()
            self._gc_deferred = True
        self._serving.set()
        if defer_gc:
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._enable_gc)

    def _enable_gc(self) -> None:
        """Undo `_release`'s deferral (once; `aclose` too, should the loop stop before the callback runs)."""
        if self._gc_deferred:
            self._gc_deferred = False
            gc.enable()

    async def until_serving(self, timeout: float | None = None) -> None:
        """Return once no update or pause is under way (at once in the common case)."""
        if self._serving.is_set():
            return
        # Not `wait_for`, which wraps each waiter in a task of its own: with 1,000 requests held, that is 1,000
        # more tasks to create, and two more loop passes before each one runs after the release.
        async with asyncio.timeout(timeout):
            await self._serving.wait()

    # -- full update ---------------------------------------------------------------------------

    async def update(self, version: int, source: str | None = None, mode: PauseMode | None = None) -> UpdateReport:
        """Pause every replica, load `version` (from the path `source`, or with None: synced out of band, only
        relabel), verify, resume. Some replicas failing is a `partial` report (they are stale); all of them
        failing raises `WeightsNotUpdated` after the rollback (see the module docstring)."""
        mode = mode or self.default_mode
        async with self._lock, self._leadership(version, mode) as token:
            started = time.monotonic()
            previous = self.version
            report = UpdateReport(version, mode, started_at=time.time())
            self._serving.clear()
            try:
                async with asyncio.timeout(self.update_timeout_s):
                    await self._followers_drained(mode, token, version)
                    await self._pause_all(mode, report)
                    report.paused_at = time.time()
                    self.state = "updating"
                    await self._update_all(version, source, report)
                    await self._settle_refusals(previous, report)
                    report.loaded_at = time.time()
                    self.state = "resuming"
                    await self._resume_all(report)
            finally:
                self.version = version if report.updated else self.version
                self.last_source = source if report.updated else self.last_source
                await self._publish_result(token, report)
                self.state = "serving"
                self._release()
                report.finished_at = time.time()
            report.duration_s = time.monotonic() - started
            if not report.updated:
                await self._announce(report)  # a failed update is announced too (status "failed")
                raise self._failed(previous, report)
            self.updates += 1
            logger.info(
                "weights: version %d (%s) on %s; stale: %s",
                version,
                mode,
                report.updated,
                report.stale,
                extra={"version": version},
            )
            await self._announce(report)
            return report

    def _failed(self, previous: int, report: UpdateReport) -> WeightsNotUpdated:
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

    def _check_newer(self, version: int) -> None:
        if version <= self.version:
            raise Conflict(f"weight version {version} is not newer than {self.version}", param="version")

    async def _pause_all(self, mode: PauseMode, report: UpdateReport) -> None:
        self.state = "pausing"
        async with asyncio.TaskGroup() as group:
            for replica in self.pool.all():
                group.create_task(self._pause_one(replica, mode, report))

    async def _pause_one(self, replica: Replica, mode: PauseMode, report: UpdateReport) -> None:
        try:
            if mode == "wait" and "wait" not in replica.backend.capabilities.pause_modes:
                await self._drain(replica)  # no native wait: our own in-flight finish, then nothing to abort
                await replica.backend.pause("abort")
            else:
                await replica.backend.pause(mode)
        except BackendError as exc:
            report.note(replica.id, f"pause failed: {exc}")
            self._mark_stale(replica, report, f"pause failed: {exc}")

    async def _drain(self, replica: Replica) -> None:
        while replica.in_flight:
            await self.pool.wait_for_change(1.0)

    async def _update_all(self, version: int, source: str | None, report: UpdateReport) -> None:
        async with asyncio.TaskGroup() as group:
            for replica in self.pool.all():
                if replica.id not in report.stale:
                    group.create_task(self._update_one(replica, version, source, report))

    async def _update_one(self, replica: Replica, version: int, source: str | None, report: UpdateReport) -> None:
        label = version_label(version)
        try:
            cache_clean = await replica.backend.update_weights(label, source)
            reported = await replica.backend.weight_version()
        except WeightsNotLoaded as exc:
            # Not stale yet: if no replica loads `version`, this one may serve on (`_settle_refusals`).
            logger.error("replica %s: %s", replica.id, exc, extra={"replica": replica.id, "version": version})
            report.note(replica.id, str(exc))
            report.refused.append(replica.id)
            return
        except BackendError as exc:
            report.note(replica.id, f"update failed: {exc}")
            self._mark_stale(replica, report, f"update failed: {exc}")
            return
        if reported != label:
            why = f"reports version {reported!r} after the update, not {label!r}"
            report.note(replica.id, why)
            self._mark_stale(replica, report, why)
            return
        replica.version = version
        replica.stale = False
        report.updated.append(replica.id)
        if not cache_clean:
            report.flush_pending.append(replica.id)
            self._flush_when_idle(replica)

    async def _settle_refusals(self, previous: int, report: UpdateReport, rollback: bool = True) -> None:
        """The replicas whose engine refused the load kept the previous weights. If another replica loaded the new
        version, they are stale (no request may mix versions). If none did, the update is rolled back: each one
        that still reports the previous version's label serves on as before (its stale flag, too, is as before);
        one that reports anything else is stale, since nobody can tell which weights it runs. Without `rollback`
        (weights synced out of band are in the engines already), they are stale."""
        replicas = [r for r in self.pool.all() if r.id in report.refused]
        if report.updated or not rollback:
            for replica in replicas:
                self._mark_stale(replica, report, f"did not load version {report.version}; runs {previous} still")
            return
        labels = version_labels(previous)
        async with asyncio.TaskGroup() as group:
            readings = {replica.id: group.create_task(self._label_of(replica)) for replica in replicas}
        for replica in replicas:
            label = readings[replica.id].result()
            if label not in labels:
                why = f"reports version {label!r} after the failed update, not {version_label(previous)!r}"
                report.note(replica.id, why)
                self._mark_stale(replica, report, why)
            elif replica.stale:
                report.stale.append(replica.id)  # held out before the update; nothing changed that
            else:
                report.kept.append(replica.id)

    async def _label_of(self, replica: Replica) -> str | None:
        try:
            return await replica.backend.weight_version()
        except BackendError as exc:
            logger.error(
                "replica %s: cannot read its weight version: %s", replica.id, exc, extra={"replica": replica.id}
            )
            return None

    async def _resume_all(self, report: UpdateReport) -> None:
        async with asyncio.TaskGroup() as group:
            for replica in self.pool.all():
                group.create_task(self._resume_one(replica, report))

    async def _resume_one(self, replica: Replica, report: UpdateReport) -> None:
        try:
            if replica.id in report.stale:
                # Never let a stale replica continue frozen requests under old weights: end them; the gateway
                # resumes each one on a replica that has the new weights.
                await replica.backend.pause("abort")
            await replica.backend.resume()
        except BackendError as exc:
            report.note(replica.id, f"resume failed: {exc}")
            self._mark_stale(replica, report, f"resume failed: {exc}")
            if replica.id in report.kept:
                report.kept.remove(replica.id)

    def _mark_stale(self, replica: Replica, report: UpdateReport, why: str) -> None:
        logger.error(
            "replica %s marked stale: %s", replica.id, why, extra={"replica": replica.id, "version": report.version}
        )
        replica.stale = True
        if replica.id not in report.stale:
            report.stale.append(replica.id)
        if replica.id in report.updated:
            report.updated.remove(replica.id)

    def _flush_when_idle(self, replica: Replica) -> None:
        """The engine switched weights but kept old KV for requests still running (SGLang in_place): take the
        replica out of rotation until they finish, flush its prefix cache, then let new work in."""
        replica.draining = True

        async def flush() -> None:
            try:
                while True:
                    await self._drain(replica)
                    if await replica.backend.flush_cache():
                        return
                    await self.pool.wait_for_change(0.5)
            except BackendError as exc:
                logger.error("replica %s: cache flush failed: %s", replica.id, exc, extra={"replica": replica.id})
                replica.stale = True
            finally:
                replica.draining = False
                self.pool.notify()

        task = asyncio.create_task(flush(), name=f"flush-{replica.id}")
        self._background.add(task)  # hard reference until done
        task.add_done_callback(self._background.discard)

    async def load_current(self, replica: Replica) -> bool:
        """Load the current version onto one replica (a newcomer, or one that restarted on other weights).

        Serialized with updates (the same lock): run concurrently, a catch-up and an update could interleave
        inside the engine and leave it holding one version's weights under the other's label. Returns whether
        the replica now serves the current version; False when the weights did not come from a path, or when the
        replica runs a newer version by now (the catch-up was decided before an update this process has not heard
        of yet: loading would take the replica back to older weights)."""
        async with self._lock:
            if self.last_source is None:
                return False
            label = version_label(self.version)
            found = await replica.backend.weight_version()
            if _newer(found, self.version):
                return False
            cache_clean = True
            if found != label:
                cache_clean = await replica.backend.update_weights(label, self.last_source)
                if await replica.backend.weight_version() != label:
                    return False
            replica.version, replica.stale = self.version, False
            if not cache_clean:
                # Requests that ran on the old weights hold KV blocks; they would enter the prefix cache when they
                # finish and later prompts would reuse them. Out of rotation until they are gone and it is flushed.
                self._flush_when_idle(replica)
            self.pool.notify()
            return True

    # -- out-of-band sync (NCCL, checkpoint engine) ----------------------------------------------

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Pause for an out-of-band weight sync; `resume(version)` ends it."""
        await self._lock.acquire()
        mode = mode or self.default_mode
        leadership = self._leadership(None, mode)
        try:
            self._paused_token = await leadership.__aenter__()
            self._paused_leadership = leadership
            self._serving.clear()
            report = UpdateReport(self.version, mode, started_at=time.time())
            async with asyncio.timeout(self.update_timeout_s):
                await self._followers_drained(mode, self._paused_token, None)
            await self._pause_all(mode, report)
            report.paused_at = time.time()
            self.state = "paused"
            self._paused_report = report
            self._paused_at = time.monotonic()
        except BaseException:
            self.state = "serving"
            self._serving.set()
            if self._paused_leadership is not None:
                await self._paused_leadership.__aexit__(None, None, None)
                self._paused_leadership = None
            self._lock.release()
            raise

    async def resume(self, version: int) -> UpdateReport:
        """Label the out-of-band weights `version` on every replica, verify, resume."""
        report = self._paused_report
        if self.state != "paused" or report is None:
            raise Conflict("the gateway is not paused (POST /admin/pause first)")
        self._check_newer(version)  # a 409 here leaves the gateway paused: resume again with a newer version
        report.version = version
        try:
            self.state = "updating"
            await self._update_all(version, None, report)
            await self._settle_refusals(self.version, report, rollback=False)
            report.loaded_at = time.time()
            self.state = "resuming"
            await self._resume_all(report)
            self.version = version
        finally:
            self._paused_report = None
            await self._publish_result(self._paused_token, report)
            if self._paused_leadership is not None:
                await self._paused_leadership.__aexit__(None, None, None)
                self._paused_leadership = None
            self.state = "serving"
            self._release()
            self._lock.release()
            report.finished_at = time.time()
        report.duration_s = time.monotonic() - self._paused_at  # pause → resume: the whole out-of-band sync
        self.updates += 1
        await self._announce(report)
        return report

    # -- several gateway processes on one Redis ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def _leadership(self, version: int | None, mode: PauseMode) -> AsyncIterator[str | None]:
        """Become the one process that updates the shared replicas: take the Redis lock, check that `version`
        is still new cluster-wide, tell the others to stop dispatching (and, in `wait` mode, to drain their own
        requests: `_followers_drained`). Yields the lock token (None alone)."""
        if version is not None:
            self._check_newer(version)
        if self.bus is None:
            yield None
            return
        token = self.bus.new_token()
        # On the bus before the lock: a holder whose heartbeat is not there counts as dead (`WeightsBus.acquire`).
        await self.bus.join(self.member_ttl_s)
        if not await self.bus.acquire(token, self.update_timeout_s + 30, self.member_ttl_s):
            raise Conflict("another gateway process is applying a weight update", param="version")
        try:
            record = await self.bus.read()
            if version is not None and record is not None and record.version >= version:
                raise Conflict(f"weight version {version} is not newer than {record.version}", param="version")
            await self.bus.announce(_pausing(version, mode, token))
            yield token
        finally:
            with contextlib.suppress(StoreError):
                await self.bus.release(token)

    async def _publish_result(self, token: str | None, report: UpdateReport) -> None:
        if self.bus is None or token is None:
            return
        event = {
            "event": "serving",
            "version": self.version,  # the previous one after a failed update: the followers keep it
            "source": self.last_source,
            "status": report.status,
            "updated": report.updated,
            "stale": report.stale,
        }
        try:
            await self.bus.record(self.version, "serving", self.last_source, report.updated, report.stale)
            await self.bus.announce(event)
        except StoreError as exc:  # the engines are updated; the followers time out and re-read
            logger.error(
                "weights: could not announce version %d: %s", self.version, exc, extra={"version": self.version}
            )

    def start_following(self) -> None:
        """Follow updates that other gateway processes coordinate, and tell them this process is there."""
        if self.bus is not None and self._follow_task is None:
            # Hard references: the loop keeps only weak references to tasks.
            self._follow_task = asyncio.create_task(self._follow(), name="weights-follow")
            self._heartbeat_task = asyncio.create_task(self._heartbeat(self.bus), name="weights-heartbeat")

    async def _heartbeat(self, bus: WeightsBus) -> None:
        while True:
            try:
                await bus.join(self.member_ttl_s)
            except StoreError as exc:  # the others stop waiting for this process once its last heartbeat expires
                logger.warning("weights: heartbeat failed: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def _follow(self) -> None:
        assert self.bus is not None
        async for event in self.bus.events():
            kind = event.get("event")
            if kind == "pausing" and self.state in ("serving", "following"):  # not while it coordinates one itself
                token = event.get("token")
                token = token if isinstance(token, str) else None
                if token is None or not self._following(token):  # not an update it follows already (`pausing` again)
                    self._serving.clear()
                    self.state = "following"
                    self._followed = token
                    self._watch(token, event.get("version"))
                if event.get("mode") == "wait" and token is not None and token not in self._draining:
                    self._drain_and_report(token)
            elif kind == "serving":
                self._followed = None
                self._adopt(event)
            elif kind == "drained":
                self._drained_news.set()

    async def _followers_drained(self, mode: PauseMode, token: str | None, version: int | None) -> None:
        """`wait` across processes: before any replica is paused, every other live gateway process on the bus has
        stopped dispatching and seen its own requests end on the replicas without a native `wait` (the pause that
        follows aborts whatever runs there, whichever process sent it). While some have not reported it, `pausing`
        goes out again every heartbeat: a process whose subscription was down missed it, and a report written to a
        Redis master that died before its replica had it is lost (a failover)."""
        if mode != "wait" or self.bus is None or token is None:
            return
        # The processes on the bus when `pausing` went out; one that joins later never saw it, so is not waited for.
        expected = await self.bus.members()
        while True:
            self._drained_news.clear()
            waiting = (expected & await self.bus.members()) - await self.bus.drained(token)
            if not waiting:
                return
            logger.info("weights: waiting for %d gateway processes to drain their requests", len(waiting))
            # Woken by each report; re-read at least every heartbeat, so a process that died stops being waited for.
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self._drained_news.wait()
            except TimeoutError:
                await self.bus.announce(_pausing(version, mode, token))

    def _drain_and_report(self, token: str) -> None:
        """Follow a `wait` update: once this process's requests on the replicas without a native `wait` ended (it
        dispatches none meanwhile), report it drained to the coordinating process."""
        bus = self.bus
        assert bus is not None

        async def drain() -> None:
            for replica in self.pool.all():
                if "wait" not in replica.backend.capabilities.pause_modes:
                    await self._drain(replica)
            attempt = 0
            while self._following(token):  # the coordinating process waits for it while this one is alive
                try:
                    await bus.report_drained(token, self.update_timeout_s + 30)
                    return
                except StoreError as exc:  # Redis away (a restart, a failover): again, until it is back
                    attempt += 1
                    logger.warning("weights: could not report this process drained (%s); retry %d", exc, attempt)
                    await asyncio.sleep(backoff_s(attempt))  # backoff between retries, not synchronisation

        self._draining.add(token)
        task = asyncio.create_task(drain(), name="weights-drain")
        task.add_done_callback(lambda _: self._draining.discard(token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _watch(self, token: str | None, version: object) -> None:
        """Follow the update `token` to its result. If the process coordinating it dies first (no heartbeat on the
        bus for twice `member_ttl_s`), or it outlasts `weights.update_timeout_s`, recover (`_recover`)."""
        bus = self.bus
        assert bus is not None
        holder = bus.holder_of(token) if token is not None else None

        async def watch() -> None:
            deadline = time.monotonic() + self.update_timeout_s
            while self._following(token):
                await asyncio.sleep(self.heartbeat_s)  # the heartbeat's own period: a death shows no sooner
                try:
                    lock = await bus.holder() if token is not None else token
                    # An out-of-band pause (no version) is not recovered from a death: the trainer may be writing
                    # weights into the engines, which must not serve until it says they are whole.
                    died = holder is not None and version is not None and not await bus.alive(holder, self.member_ttl_s)
                    record = await bus.read() if lock is None and token is not None else None
                except StoreError:
                    continue  # Redis is away: nothing to decide by, and nobody can announce meanwhile
                if not self._following(token):
                    return
                if lock != token:
                    # The update ended, or another took the lock over, and the event saying so did not reach this
                    # process (its subscription was down: a Redis failover, a restart): as if it had.
                    logger.warning("weights: the update to version %s ended unannounced here", version)
                    if lock is None:
                        self._followed = None
                        self._adopt_record(record)
                    else:
                        self._followed = lock
                        self._watch(lock, None)  # what it is, out of band or not, was in the missed `pausing`
                    return
                if died or time.monotonic() > deadline:
                    why = "its coordinating process died" if died else "no result within weights.update_timeout_s"
                    logger.error("weights: update to version %s: %s", version, why, extra={"version": version})
                    await self._recover(token, version, died)
                    return

        task = asyncio.create_task(watch(), name="weights-watch")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _following(self, token: str | None) -> bool:
        return self.state == "following" and self._followed == token

    async def _recover(self, dead: str | None, version: object, died: bool) -> None:
        """The update `dead` will not end by itself: its coordinating process `died`, or it outlasted
        `weights.update_timeout_s`. After a death, take over its lock and bring the pool back to the version
        recorded in Redis (`rg:weights`, the last one announced): every replica is paused (`abort`: its requests
        resume on the gateway's side, tokens kept); one that reports that version resumes, one that reports another
        is loaded with it again from the recorded path, or held out as stale; the result is announced as an
        update's. Where another process took the lock meanwhile (a new update, another process recovering),
        follow that one; otherwise adopt the record and dispatch again."""
        bus = self.bus
        assert bus is not None
        async with self._lock:
            if not self._following(dead):
                return
            token, ttl_s = bus.new_token(), self.update_timeout_s + 30
            try:
                taken = died and dead is not None and await bus.take_over(dead, token, ttl_s)
                holder = None if taken else await bus.holder()
                record = await bus.read()
            except StoreError as exc:
                logger.error("weights: cannot recover from the update to version %s yet: %s", version, exc)
                self._watch(dead, version)  # again, a heartbeat later
                return
            if taken:
                await self._restore(token, record)
            elif holder is not None and holder != dead:
                self._followed = holder
                self._watch(holder, None)  # its own `pausing` says what it is (if it was missed: no recovery)
            else:
                self._adopt_record(record)

    async def _restore(self, token: str, record: WeightsRecord | None) -> None:
        """`_recover`'s work once it holds the lock (`token`)."""
        assert self.bus is not None
        version, source = (record.version, record.source) if record else (self.version, self.last_source)
        report = UpdateReport(version, "abort", started_at=time.time())
        self.state = "pausing"
        try:
            await self.bus.announce(_pausing(version, "abort", token))
            async with asyncio.timeout(self.update_timeout_s):
                await self._pause_all("abort", report)
                report.paused_at = time.time()
                self.state = "updating"
                async with asyncio.TaskGroup() as group:
                    for replica in self.pool.all():
                        if replica.id not in report.stale:
                            group.create_task(self._restore_one(replica, version, source, report))
                await self._settle_refusals(version, report, rollback=False)
                report.loaded_at = time.time()
                self.state = "resuming"
                await self._resume_all(report)
        finally:
            self.version, self.last_source = max(version, self.version), source
            await self._publish_result(token, report)
            with contextlib.suppress(StoreError):
                await self.bus.release(token)
            self._followed = None
            self.state = "serving"
            self._release()
            report.finished_at = time.time()
        logger.warning(
            "weights: recovered on version %d: %s serve it; stale: %s",
            version,
            report.updated,
            report.stale,
            extra={"version": version},
        )

    async def _restore_one(self, replica: Replica, version: int, source: str | None, report: UpdateReport) -> None:
        """Bring one paused replica to `version`: as it is where it reports that version, loaded from `source`
        where it reports another, stale where there is no path to load it from."""
        label = await self._label_of(replica)
        if label in version_labels(version):
            replica.version, replica.stale = version, False
            report.updated.append(replica.id)
        elif source is not None:
            await self._update_one(replica, version, source, report)
        else:
            why = f"reports version {label!r} after an interrupted update, and version {version} has no path"
            report.note(replica.id, why)
            self._mark_stale(replica, report, why)

    async def adopt_recorded(self) -> bool:
        """Adopt the version `rg:weights` records where it is newer than this process's (a `serving` event it
        missed); whether it was. False too while an update runs here or Redis does not answer."""
        if self.bus is None or not self.serving or self._lock.locked():
            return False
        try:
            record = await self.bus.read()
        except StoreError:
            return False
        if record is None or record.version <= self.version or not self.serving:
            return False
        logger.warning("weights: version %d, recorded, was not announced here", record.version)
        self._adopt_record(record)
        return True

    def _adopt_record(self, record: WeightsRecord | None) -> None:
        """`_adopt` what `rg:weights` records, as if its `serving` event had arrived (none: serve on as is)."""
        self._adopt(record.as_event() if record else {"version": self.version})

    def _adopt(self, event: dict[str, object]) -> None:
        version = event.get("version")
        if isinstance(version, int) and version >= self.version:
            if version > self.version:  # a failed update, or a recovery, announces the version it kept
                self.updates += 1
            self.version = version
            source = event.get("source")
            self.last_source = source if isinstance(source, str) else self.last_source
            updated, stale = _ids(event.get("updated")), _ids(event.get("stale"))
            for replica in self.pool.all():
                if replica.id in updated:
                    replica.version, replica.stale = version, False
                elif replica.id in stale:
                    replica.stale = True
            self.pool.notify()
        self.state = "serving"
        self._release()

    async def _announce(self, report: UpdateReport) -> None:
        for callback in self.on_update:
            result = callback(report)
            if result is not None:
                await result

    async def aclose(self) -> None:
        self._enable_gc()
        await stop(self._follow_task, self._heartbeat_task)
        if self._heartbeat_task is not None and self.bus is not None:
            with contextlib.suppress(StoreError):
                await self.bus.leave()  # a `wait` update stops waiting for this process at once
        await stop(*self._background)
