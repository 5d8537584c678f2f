"""THE update sequence, over every replica at once: pause → load → settle → resume.

It works on engines (`ReplicaPool.engines`): a replica with several data-parallel ranks is paused, loaded, verified
and resumed once, and its ranks share its version and stale mark.

Every way the replicas change weights runs it: an update (`POST /admin/weights`) from end to end; the out-of-band
sync (`POST /admin/pause` … `/admin/resume`) in two halves, the sync between them, its load a relabel; the recovery
from an update whose coordinator died, its load a restore. What the load step does is a `Plan`.

A replica that fails a step is held out as stale (`ReplicaPool.mark_stale`): it serves nothing until a later load
succeeds on it, so no request ever mixes weights silently. A replica whose engine refused the load
(`WeightsNotLoaded`) kept its weights: where no replica loaded the new version, each such one that still reports the
previous version's label resumes on it (`kept`, the rollback); otherwise it is stale too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Literal

from backends.base import PauseMode
from backends.errors import BackendError, WeightsNotLoaded
from gateway.routing import Engine, ReplicaPool
from gateway.weights.labels import version_label, version_labels
from gateway.weights.report import SLOW_DRAIN_S, UpdateReport
from gateway.weights.state import State, StateMachine

logger = logging.getLogger(__name__)

LoadKind = Literal["load", "restore", "none", "transfer", "reload"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What the load step does to each paused replica, and how a refusal settles.

    `load`: load `version` from `source` (None: relabel the weights the engines hold already). `restore`: keep a
    replica that reports `version` as it is; load the others from `source`, or hold them out where there is none.
    `none`: load nothing; every replica counts as having refused, so the rollback settles each one. `transfer`: the
    trainer pushed `version` into the engines; finish each one's transfer with the label. `reload`: an in-memory
    transfer was never committed: each replica may hold mixed weights whatever its label says, so it is loaded again
    from `source` (the last checkpoint path) on `version`, or held out where there is none."""

    kind: LoadKind
    version: int
    previous: int  # the version the replicas ran before: one that refused the load kept it
    source: str | None = None
    rollback: bool = True  # where no replica loaded `version`, the refusers reporting `previous` resume on it

    @classmethod
    def update(cls, version: int, source: str | None, previous: int) -> Plan:
        """`POST /admin/weights`: load from `source`, or relabel; rolled back if it loads nowhere."""
        return cls("load", version, previous, source)

    @classmethod
    def relabel_synced(cls, version: int, previous: int) -> Plan:
        """The end of an out-of-band sync: the weights are in the engines; a replica that refuses is stale."""
        return cls("load", version, previous, None, rollback=False)

    @classmethod
    def restore(cls, version: int, source: str | None) -> Plan:
        """The recovery: every replica back to the recorded `version` (from its `source` where needed)."""
        return cls("restore", version, version, source, rollback=False)

    @classmethod
    def transfer(cls, version: int, previous: int) -> Plan:
        """A committed in-memory transfer: the weights are in the engines; a replica that fails to finish is stale."""
        return cls("transfer", version, previous, None, rollback=False)

    @classmethod
    def reload(cls, previous: int, source: str | None) -> Plan:
        """An in-memory transfer not committed in time: back to `previous` from `source`, or held out."""
        return cls("reload", previous, previous, source, rollback=False)

    @classmethod
    def abandon(cls, previous: int) -> Plan:
        """A failed out-of-band sync: nothing loaded; each replica resumes on `previous` where its label shows it."""
        return cls("none", previous, previous)


class UpdateSequence:
    """Runs the steps over the pool, moving `machine` through `UPDATING` and `RESUMING` (the caller moves it into
    `PAUSING` before and back to `SERVING` after: it knows what comes around the sequence)."""

    def __init__(
        self, pool: ReplicaPool, machine: StateMachine, tasks: set[asyncio.Task[None]], *, flush_caches: bool = True
    ) -> None:
        self.pool = pool
        self.machine = machine
        self._tasks = tasks  # hard references to the cache flushes, stopped by the coordinator's `aclose`
        # Flush each engine's prefix cache with its load. A `keep` update does not where every request salts the
        # cache with its version (`weights.cache_salt`) and kept requests keep their KV
        # (`weights.kv_after_update: keep`): nothing is preempted, no replica drains for a flush. `abort` and `wait`
        # updates flush anyway: nothing holds KV then, the old version's entries are dead weight under the new
        # salt, and a request that reached a paused engine with the old salt must not find them.
        self.flush_caches = flush_caches

    async def run(self, mode: PauseMode, plan: Plan, report: UpdateReport) -> None:
        """The whole sequence."""
        await self.pause(mode, report)
        await self.finish(plan, report)

    async def pause(self, mode: PauseMode, report: UpdateReport) -> None:
        """Pause every replica concurrently."""
        async with asyncio.TaskGroup() as group:
            for replica in self.pool.engines():
                group.create_task(self._pause_one(replica, mode, report))
        report.paused_at = time.time()

    async def finish(self, plan: Plan, report: UpdateReport) -> None:
        """Load every paused replica as `plan` says, settle the refusals, resume every replica."""
        self.machine.to(State.UPDATING)
        if plan.kind == "none":
            report.refused.extend(r.id for r in self.pool.engines() if r.id not in report.stale)
        else:
            async with asyncio.TaskGroup() as group:
                for replica in self.pool.engines():
                    if replica.id not in report.stale:
                        group.create_task(self._load_one(replica, plan, report))
        await self._settle_refusals(plan, report)
        report.loaded_at = time.time()
        self.machine.to(State.RESUMING)
        async with asyncio.TaskGroup() as group:
            for replica in self.pool.engines():
                group.create_task(self._resume_one(replica, report))

    # -- one replica --------------------------------------------------------------------------------------------

    async def until_idle(self, replica: Engine) -> None:
        """Until this process has no request on `replica` (a `wait` update on an engine without a native `wait`);
        said in the log past `SLOW_DRAIN_S`."""
        try:
            async with asyncio.timeout(SLOW_DRAIN_S):
                await self.pool.until_idle(replica)
        except TimeoutError:
            logger.warning(
                "weights: a wait update has waited %g s for %d requests of this process on replica %s to end",
                SLOW_DRAIN_S,
                replica.in_flight,
                replica.id,
                extra={"replica": replica.id},
            )
            await self.pool.until_idle(replica)

    async def _pause_one(self, replica: Engine, mode: PauseMode, report: UpdateReport) -> None:
        try:
            if mode == "wait" and "wait" not in replica.backend.capabilities.pause_modes:
                await self.until_idle(replica)  # no native wait: our own in-flight finish, then nothing to abort
                await replica.backend.pause("abort")
            else:
                await replica.backend.pause(mode)
        except BackendError as exc:
            report.note(replica.id, f"pause failed: {exc}")
            self.mark_stale(replica, report, f"pause failed: {exc}")

    async def _load_one(self, replica: Engine, plan: Plan, report: UpdateReport) -> None:
        if plan.kind in ("load", "transfer"):
            await self.update_one(replica, plan.version, plan.source, report, transferred=plan.kind == "transfer")
            return
        if plan.kind == "reload":
            await self._reload_one(replica, plan, report)
            return
        # restore: as it is where it reports the version, loaded from the path where it reports another, stale
        # where there is no path to load it from.
        label = await self.label_of(replica)
        if label in version_labels(plan.version):
            self.pool.set_version(replica, plan.version)
            report.updated.append(replica.id)
        elif plan.source is not None:
            await self.update_one(replica, plan.version, plan.source, report)
        else:
            why = f"reports version {label!r} after an interrupted update, and version {plan.version} has no path"
            report.note(replica.id, why)
            self.mark_stale(replica, report, why)

    async def update_one(
        self, replica: Engine, version: int, source: str | None, report: UpdateReport, *, transferred: bool = False
    ) -> None:
        """Load (or relabel, or finish the transfer into) one paused replica and read its label back."""
        label = version_label(version)
        try:
            flush = self.flush_caches or report.mode != "keep"
            if transferred:
                cache_clean = await replica.backend.finish_transfer(label, flush=flush)
            else:
                cache_clean = await replica.backend.update_weights(label, source, flush=flush)
            reported = await replica.backend.weight_version()
        except WeightsNotLoaded as exc:
            # Not stale yet: if no replica loads `version`, this one may serve on (`_settle_refusals`).
            logger.error("replica %s: %s", replica.id, exc, extra={"replica": replica.id, "version": version})
            report.note(replica.id, str(exc))
            report.refused.append(replica.id)
            return
        except BackendError as exc:
            report.note(replica.id, f"update failed: {exc}")
            self.mark_stale(replica, report, f"update failed: {exc}")
            return
        if reported != label:
            why = f"reports version {reported!r} after the update, not {label!r}"
            report.note(replica.id, why)
            self.mark_stale(replica, report, why)
            return
        self.pool.set_version(replica, version)
        report.updated.append(replica.id)
        if not cache_clean:
            report.flush_pending.append(replica.id)
            self.flush_when_idle(replica)

    async def _reload_one(self, replica: Engine, plan: Plan, report: UpdateReport) -> None:
        """After an uncommitted transfer: its update session closed, the replica loaded again from the last
        checkpoint path on the previous version (`kept`), or held out (no path, or the load failed)."""
        try:
            await replica.backend.abort_transfer()
        except BackendError as exc:
            report.note(replica.id, f"closing the transfer failed: {exc}")
        if plan.source is None:
            why = "may hold mixed weights from an uncommitted transfer, and no checkpoint path is known to reload"
            self.mark_stale(replica, report, why)
            return
        label = version_label(plan.version)
        try:
            await replica.backend.update_weights(label, plan.source, flush=True)
            reported = await replica.backend.weight_version()
        except BackendError as exc:
            report.note(replica.id, f"reload after the uncommitted transfer failed: {exc}")
            self.mark_stale(replica, report, f"reload after the uncommitted transfer failed: {exc}")
            return
        if reported != label:
            self.mark_stale(replica, report, f"reports version {reported!r} after the reload, not {label!r}")
            return
        self.pool.set_version(replica, plan.version)
        report.kept.append(replica.id)

    async def _settle_refusals(self, plan: Plan, report: UpdateReport) -> None:
        """The replicas whose engine refused the load kept the previous weights. If another replica loaded the new
        version, they are stale (no request may mix versions). If none did, the update is rolled back: each one
        that still reports the previous version's label serves on as before (its stale flag, too, is as before);
        one that reports anything else is stale, since nobody can tell which weights it runs. Without a rollback
        (weights synced out of band are in the engines already), they are stale."""
        previous = plan.previous
        replicas = [r for r in self.pool.engines() if r.id in report.refused]
        if report.updated or not plan.rollback:
            for replica in replicas:
                self.mark_stale(replica, report, f"did not load version {report.version}; runs {previous} still")
            return
        labels = version_labels(previous)
        async with asyncio.TaskGroup() as group:
            readings = {replica.id: group.create_task(self.label_of(replica)) for replica in replicas}
        for replica in replicas:
            label = readings[replica.id].result()
            if label not in labels:
                why = f"reports version {label!r} after the failed update, not {version_label(previous)!r}"
                report.note(replica.id, why)
                self.mark_stale(replica, report, why)
            elif replica.stale:
                report.stale.append(replica.id)  # held out before the update; nothing changed that
            else:
                report.kept.append(replica.id)

    async def label_of(self, replica: Engine) -> str | None:
        """The replica's version label; None where it cannot be read."""
        try:
            return await replica.backend.weight_version()
        except BackendError as exc:
            logger.error(
                "replica %s: cannot read its weight version: %s", replica.id, exc, extra={"replica": replica.id}
            )
            return None

    async def _resume_one(self, replica: Engine, report: UpdateReport) -> None:
        try:
            if replica.id in report.stale:
                # Never let a stale replica continue frozen requests under old weights: end them; the gateway
                # resumes each one on a replica that has the new weights.
                await replica.backend.pause("abort")
            await replica.backend.resume()
        except BackendError as exc:
            report.note(replica.id, f"resume failed: {exc}")
            self.mark_stale(replica, report, f"resume failed: {exc}")
            if replica.id in report.kept:
                report.kept.remove(replica.id)

    def mark_stale(self, replica: Engine, report: UpdateReport, why: str) -> None:
        """Hold `replica` out, and say so in `report`."""
        logger.error(
            "replica %s marked stale: %s", replica.id, why, extra={"replica": replica.id, "version": report.version}
        )
        self.pool.mark_stale(replica)
        if replica.id not in report.stale:
            report.stale.append(replica.id)
        if replica.id in report.updated:
            report.updated.remove(replica.id)

    def flush_when_idle(self, replica: Engine) -> None:
        """The engine switched weights but kept old KV for requests still running (SGLang in_place): take the
        replica out of rotation until they finish, flush its prefix cache, then let new work in."""
        replica.draining = True

        async def flush() -> None:
            try:
                while True:
                    await self.pool.until_idle(replica)
                    if await replica.backend.flush_cache():
                        return
                    await self.pool.wait_for_change(0.5)
            except BackendError as exc:
                logger.error("replica %s: cache flush failed: %s", replica.id, exc, extra={"replica": replica.id})
                self.pool.mark_stale(replica)
            finally:
                replica.draining = False
                self.pool.notify()

        task = asyncio.create_task(flush(), name=f"flush-{replica.id}")
        self._tasks.add(task)  # hard reference until done
        task.add_done_callback(self._tasks.discard)
