"""Weight versions: one coordinator per gateway pauses the pool, updates every replica, verifies and resumes.

Generation awaits `until_serving()`, which returns at once unless an update (or an out-of-band pause) is under
way, so requests interrupted by an update wait on an event rather than polling. Updates are serialized; a
version older than or equal to the current one is a 409. A replica that fails to update is drained and marked
stale (it serves nothing until a later update succeeds on it), so no request ever mixes weights silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from backends.base import PauseMode
from backends.errors import BackendError
from gateway.errors import Conflict, InvalidRequest, StoreError
from gateway.routing import Replica, ReplicaPool
from gateway.store import WeightsBus

logger = logging.getLogger(__name__)

CoordinatorState = Literal["serving", "pausing", "paused", "updating", "resuming", "following"]
INITIAL_LABELS = frozenset({"default", ""})


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


def _ids(value: object) -> set[str]:
    return {str(v) for v in value} if isinstance(value, list) else set()


@dataclass
class UpdateReport:
    """What one update did, for the admin API and metrics."""

    version: int
    mode: PauseMode
    updated: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    flush_pending: list[str] = field(default_factory=list)
    duration_s: float = 0.0


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
    ) -> None:
        self.pool = pool
        self.bus = bus
        self._follow_task: asyncio.Task[None] | None = None
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
            # triggers them: a full one takes hundreds of ms with 1,000 streams' state on the heap. Collect once
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
        """Pause every replica, load `version` (from `source`, or already synced out of band), verify, resume."""
        mode = mode or self.default_mode
        async with self._lock, self._leadership(version) as token:
            started = time.monotonic()
            report = UpdateReport(version, mode)
            self._serving.clear()
            try:
                async with asyncio.timeout(self.update_timeout_s):
                    await self._pause_all(mode, report)
                    self.state = "updating"
                    await self._update_all(version, source, report)
                    self.state = "resuming"
                    await self._resume_all(report)
            finally:
                self.version = version if report.updated else self.version
                self.last_source = source if report.updated else self.last_source
                await self._publish_result(token, report)
                self.state = "serving"
                self._release()
            report.duration_s = time.monotonic() - started
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
        except BackendError as exc:
            self._mark_stale(replica, report, f"update failed: {exc}")
            return
        if reported != label:
            self._mark_stale(replica, report, f"reports version {reported!r} after the update, not {label!r}")
            return
        replica.version = version
        replica.stale = False
        report.updated.append(replica.id)
        if not cache_clean:
            report.flush_pending.append(replica.id)
            self._flush_when_idle(replica)

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
            self._mark_stale(replica, report, f"resume failed: {exc}")

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
        the replica now serves the current version; False when the weights did not come from a path."""
        async with self._lock:
            if self.last_source is None:
                return False
            label = version_label(self.version)
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
        leadership = self._leadership(None)
        try:
            self._paused_token = await leadership.__aenter__()
            self._paused_leadership = leadership
            self._serving.clear()
            report = UpdateReport(self.version, mode or self.default_mode)
            await self._pause_all(mode or self.default_mode, report)
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
        report.duration_s = time.monotonic() - self._paused_at  # pause → resume: the whole out-of-band sync
        self.updates += 1
        await self._announce(report)
        return report

    # -- several gateway processes on one Redis ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def _leadership(self, version: int | None) -> AsyncIterator[str | None]:
        """Become the one process that updates the shared replicas: take the Redis lock, check that `version`
        is still new cluster-wide, tell the others to stop dispatching. Yields the lock token (None alone)."""
        if version is not None:
            self._check_newer(version)
        if self.bus is None:
            yield None
            return
        token = uuid.uuid4().hex
        if not await self.bus.acquire(token, self.update_timeout_s + 30):
            raise Conflict("another gateway process is applying a weight update", param="version")
        try:
            record = await self.bus.read()
            if version is not None and record is not None and record.version >= version:
                raise Conflict(f"weight version {version} is not newer than {record.version}", param="version")
            await self.bus.announce({"event": "pausing", "version": version})
            yield token
        finally:
            with contextlib.suppress(StoreError):
                await self.bus.release(token)

    async def _publish_result(self, token: str | None, report: UpdateReport) -> None:
        if self.bus is None or token is None:
            return
        event = {
            "event": "serving",
            "version": self.version,
            "source": self.last_source,
            "updated": report.updated,
            "stale": report.stale,
        }
        try:
            await self.bus.record(self.version, "serving", self.last_source)
            await self.bus.announce(event)
        except StoreError as exc:  # the engines are updated; the followers time out and re-read
            logger.error(
                "weights: could not announce version %d: %s", self.version, exc, extra={"version": self.version}
            )

    def start_following(self) -> None:
        """Follow updates that other gateway processes coordinate."""
        if self.bus is not None and self._follow_task is None:
            # Hard reference: the loop keeps only weak references to tasks.
            self._follow_task = asyncio.create_task(self._follow(), name="weights-follow")

    async def _follow(self) -> None:
        assert self.bus is not None
        async for event in self.bus.events():
            if event.get("event") == "pausing" and not self._lock.locked():
                self._serving.clear()
                self.state = "following"
                self._watchdog(event.get("version"))
            elif event.get("event") == "serving":
                self._adopt(event)

    def _watchdog(self, version: object) -> None:
        """If the coordinating process dies mid-update, stop waiting for it after the update timeout."""

        async def expire() -> None:
            await asyncio.sleep(self.update_timeout_s)
            if self.state == "following" and self.bus is not None:
                logger.error(
                    "weights: no result for version %s from the coordinating process",
                    version,
                    extra={"version": version},
                )
                record = await self.bus.read()
                self._adopt({"version": record.version if record else self.version, "updated": [], "stale": []})

        task = asyncio.create_task(expire(), name="weights-watchdog")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _adopt(self, event: dict[str, object]) -> None:
        version = event.get("version")
        if isinstance(version, int) and version >= self.version:
            self.version = version
            source = event.get("source")
            self.last_source = source if isinstance(source, str) else self.last_source
            updated, stale = _ids(event.get("updated")), _ids(event.get("stale"))
            for replica in self.pool.all():
                if replica.id in updated:
                    replica.version, replica.stale = version, False
                elif replica.id in stale:
                    replica.stale = True
            self.updates += 1
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
        if self._follow_task is not None:
            self._follow_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follow_task
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background)
