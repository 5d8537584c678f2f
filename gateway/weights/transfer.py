"""The two-phase in-memory weight update (issue 53 §1): `POST /admin/weights` with a `transfer`, then
`POST /admin/weights/{version}/commit`.

`begin` answers at once with the layout (per engine: its URL, and for `nccl` its own process group: rendezvous port,
rank offset, world size; the trainer is rank 0 of every group), then, in the background, pauses every replica in the
requested mode (the coordinator `PAUSING` → `TRANSFERRING`) and opens each engine's side (`open_transfer`: the
engine joins its group, which blocks until the trainer joins, then opens an update session). The trainer pushes the
tensors straight into the engines, then commits: every engine's transfer is finished with the version label, read
back, and the replicas resume (`UPDATING` → `RESUMING` → `SERVING`), answered as a path update is (200 / 207 / 502).
With a manifest (`TransferSpec.manifest`, group backends) the gateway also makes each engine's receiving call per
chunk once its side is open (`_receive`), so the trainer only broadcasts; the commit waits for that fan-out, bounded
by the deadline, and holds out an engine that did not receive everything declared.

Not committed within `weights.transfer_commit_timeout_s`: the update fails. Every replica may hold some of the new
tensors under the old label, so none is trusted: each is loaded again from the last checkpoint path the gateway knows
(`Plan.reload`), or held out as stale where there is none; nothing is served on mixed weights.

On the bus the transfer holds the update lock as an out-of-band sync does (no version in its `pausing`): the other
processes stop dispatching until its result, and never recover it from its coordinator's death (the trainer may be
writing into the engines). The lock names the transfer's version (`Pausing.transfer`): a commit sent to another
process is relayed to this one (`gateway.weights.relay`), which commits it as if it had come here. Its layout and
state are shown on the bus (`rg:weights:transfer`), so any process answers `GET /admin/weights/{version}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from backends.base import GROUP_BACKENDS, PauseMode, TensorMeta, TransferBackend, TransferGroup
from backends.errors import BackendError
from gateway.background import background, stop
from gateway.errors import (
    Conflict,
    GatewayError,
    InvalidRequest,
    StoreError,
    WeightsNotRecorded,
    WeightsNotUpdated,
)
from gateway.routing import Engine, ReplicaPool
from gateway.store import Commit, Serving
from gateway.weights.leader import Leadership
from gateway.weights.relay import CommitRelay
from gateway.weights.report import UpdateReport
from gateway.weights.sequence import Plan, UpdateSequence
from gateway.weights.state import State, StateMachine

logger = logging.getLogger(__name__)

SideState = Literal["opening", "open", "received", "failed"]
SHOWN_AFTER_END_S = 600.0  # how long every process can read a transfer's layout after its commit deadline
SHOWN_POLL_S = 0.1  # how often a process that does not hold the transfer reads whether its sides are open


Manifest = tuple[tuple[TensorMeta, ...], ...]
"""The chunks a trainer will broadcast, in order: the gateway makes each engine's receiving call per chunk."""


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """What the trainer asked for: the backend, and for `nccl` and `gloo` the rendezvous it hosts (engine i's group at
    `master_port + i`) and, optionally, the manifest of what it will broadcast (the gateway then fans the engines'
    receiving calls out itself: the trainer only broadcasts)."""

    backend: TransferBackend
    master_address: str | None = None
    master_port: int | None = None
    manifest: Manifest | None = None


@dataclass(eq=False)
class EngineSide:
    """One engine's side of the transfer, as the layout shows it."""

    engine: Engine
    group: TransferGroup | None
    state: SideState = "opening"
    rendezvous: bool = False  # the engine forms its group now: the trainer joins it (kept groups are not re-formed)
    error: str | None = None

    def layout(self) -> dict[str, Any]:
        group = self.group
        return {
            "replica": self.engine.id,
            "url": self.engine.backend.url,
            "master_address": group.master_address if group else None,
            "master_port": group.master_port if group else None,
            "rank_offset": group.rank_offset if group else None,
            "world_size": group.world_size if group else None,
            "state": self.state,
            "rendezvous": self.rendezvous,
            "error": self.error,
        }


@dataclass(eq=False)
class HeldTransfer:
    """A transfer under way: the bus lock's `token`, its report, each engine's side, its deadline (monotonic)."""

    spec: TransferSpec
    token: str | None
    report: UpdateReport
    sides: list[EngineSide]
    started: float
    deadline: float
    opened: asyncio.Event = field(default_factory=asyncio.Event)  # every side opened or failed (or it ended)
    status: str = "opening"  # opening | open | committed | failed
    relayed: bool = False  # another process relayed its commit here (`commit_asked`): committed once
    committing: bool = False  # a commit took it (waiting for the manifest's fan-out, then finishing)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, repr=False)
    _receiving: list[asyncio.Task[None]] = field(default_factory=list, repr=False)  # the manifest's fan-out

    @property
    def version(self) -> int:
        return self.report.version

    def layout(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "version": self.version,
            "backend": self.spec.backend,
            "mode": self.report.mode,
            "commit": f"/admin/weights/{self.version}/commit",
            "deadline_s": round(max(0.0, self.deadline - time.monotonic()), 3),
            "engines": [side.layout() for side in self.sides],
        }

    async def aclose(self) -> None:
        await stop(*self._tasks, *self._receiving)


class WeightCoordinator(Protocol):
    """The process's `WeightCoordinator`, as far as a transfer uses it (no import of it here: it holds `Transfers`)."""

    pool: ReplicaPool
    lock: asyncio.Lock
    machine: StateMachine
    sequence: UpdateSequence
    leader: Leadership | None
    version: int
    last_source: str | None
    default_mode: PauseMode
    update_timeout_s: float
    upcoming_version: int | None
    updates: int

    def check_idle(self) -> None: ...
    def check_newer(self, version: int) -> None: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...
    async def announce(self, report: UpdateReport) -> None: ...
    def failed(self, previous: int, report: UpdateReport) -> WeightsNotUpdated: ...
    def not_recorded(self, report: UpdateReport, cause: StoreError) -> WeightsNotRecorded: ...

    heartbeat_s: float

    async def publish_result(self, report: UpdateReport, token: str | None) -> StoreError | None: ...
    async def followers_drained(self, mode: PauseMode, token: str | None, version: int | None) -> None: ...


class Transfers:
    """The coordinator's in-memory transfers (one at a time, like every weight change)."""

    def __init__(self, weights: WeightCoordinator, commit_timeout_s: float) -> None:
        self.weights = weights
        self.commit_timeout_s = commit_timeout_s
        leader = weights.leader
        self.relay = (
            CommitRelay(leader.bus, weights.heartbeat_s, weights.update_timeout_s) if leader is not None else None
        )
        self.held: HeldTransfer | None = None
        self._ended: HeldTransfer | None = None  # the last one that ended (its status for GET, a late commit's 409)

    # -- begin ------------------------------------------------------------------------------------------------

    async def begin(self, version: int, spec: TransferSpec, mode: PauseMode | None) -> HeldTransfer:
        """Take the update, lay the groups out and answer; pause and open the engines in the background."""
        w = self.weights
        mode = mode or w.default_mode
        engines = w.pool.engines()
        unable = [e.id for e in engines if spec.backend not in e.backend.capabilities.transfer_backends]
        if unable:
            raise InvalidRequest(f"replicas {unable} take no {spec.backend!r} weight transfer", param="transfer")
        async with w.lock:
            w.check_idle()
            w.check_newer(version)
            sides = await self._layout(engines, spec)
            token = await w.leader.take(None, mode, transfer=version) if w.leader is not None else None
            report = UpdateReport(version, mode, started_at=time.time())
            started = time.monotonic()
            held = HeldTransfer(spec, token, report, sides, started, started + self.commit_timeout_s)
            self.held, self._ended = held, None
            w.upcoming_version = version
            w.begin()
        await self._show(held)
        held._tasks.append(background(self._open(held), "weights-transfer-open"))
        held._tasks.append(background(self._expire(held), "weights-transfer-deadline"))
        return held

    async def _layout(self, engines: list[Engine], spec: TransferSpec) -> list[EngineSide]:
        """Each engine's side; for a group backend its group, and whether it is formed now (`rendezvous`: the
        trainer joins it) or kept from an earlier transfer, told in the 202 before any engine is asked to open."""
        if spec.backend not in GROUP_BACKENDS:
            return [EngineSide(engine, None) for engine in engines]
        async with asyncio.TaskGroup() as group:
            workers = [group.create_task(engine.backend.transfer_workers()) for engine in engines]
        address, port = spec.master_address or "", spec.master_port or 0
        sides = []
        for i, (engine, count) in enumerate(zip(engines, workers, strict=True)):
            formed = TransferGroup(address, port + i, 1, 1 + count.result())
            sides.append(EngineSide(engine, formed, rendezvous=engine.backend.forms_transfer_group(formed)))
        return sides

    async def _open(self, held: HeldTransfer) -> None:
        w, report = self.weights, held.report
        async with w.lock:
            if self.held is not held:
                return
            try:
                async with asyncio.timeout(w.update_timeout_s):
                    await w.followers_drained(report.mode, held.token, None)
            except TimeoutError:
                logger.warning("weights: other gateway processes did not report their drain; pausing all the same")
            await w.sequence.pause(report.mode, report)
            w.machine.to(State.TRANSFERRING)
        async with asyncio.TaskGroup() as group:
            for side in held.sides:
                if side.engine.id in report.stale:
                    side.state, side.error = "failed", report.errors.get(side.engine.id, "held out")
                else:
                    group.create_task(self._open_one(held, side))
        manifest = held.spec.manifest
        if manifest is not None:
            for side in held.sides:
                if side.state == "open":
                    held._receiving.append(background(self._receive(held, side, manifest), "weights-transfer-receive"))
        held.status = "open"
        await self._show(held)  # before the commit may go on: its end is shown after this
        held.opened.set()

    async def _open_one(self, held: HeldTransfer, side: EngineSide) -> None:
        try:
            # A group forgotten since the layout (a missed health probe) is formed after all: the layout says so now.
            side.rendezvous = await side.engine.backend.open_transfer(held.spec.backend, side.group)
            side.state = "open"
        except BackendError as exc:
            self._fail_side(held, side, f"opening the transfer failed: {exc}")

    async def _receive(self, held: HeldTransfer, side: EngineSide, manifest: Manifest) -> None:
        """The manifest's fan-out to one engine: its receiving call per chunk, in order, each answered once the
        trainer's broadcast of that chunk landed. A failed call fails the side: the engine may hold some of the
        tensors, so it is held out."""
        try:
            for chunk in manifest:
                await side.engine.backend.receive_transfer_chunk(chunk)
        except BackendError as exc:
            self._fail_side(held, side, f"receiving the transfer failed: {exc}")
            return
        side.state = "received"

    async def _received(self, held: HeldTransfer) -> None:
        """Until the manifest's fan-out ended on every engine, bounded by the transfer's deadline: an engine still
        receiving then (the trainer broadcast less than it declared) is held out."""
        if not held._receiving:
            return
        left = max(0.0, held.deadline - time.monotonic())
        _, pending = await asyncio.wait(held._receiving, timeout=left)
        await stop(*pending)
        for side in held.sides:
            if side.state == "open":
                why = "the trainer's broadcast did not complete what its manifest declared before the commit deadline"
                self._fail_side(held, side, why)

    def _fail_side(self, held: HeldTransfer, side: EngineSide, why: str) -> None:
        """One engine's side failed: the engine may hold part of the tensors, so it is held out (stale) until a
        catch-up loads the version it should serve."""
        side.state, side.error = "failed", why
        held.report.note(side.engine.id, why)
        self.weights.sequence.mark_stale(side.engine, held.report, why)

    async def until_open(self, version: int, timeout_s: float) -> HeldTransfer:
        """The transfer of `version` once every engine's side is open or failed (or after `timeout_s`)."""
        held = self.held if self.held is not None and self.held.version == version else None
        if held is None:
            ended = self._ended
            if ended is not None and ended.version == version:
                return ended
            raise self._not_open(version)
        try:
            async with asyncio.timeout(timeout_s):
                await held.opened.wait()
        except TimeoutError:
            pass
        return held

    async def status(self, version: int, wait_s: float) -> dict[str, Any]:
        """The layout and state of the transfer of `version`, this process's own or the one another process holds
        (as it shows it on the bus, `_show`); with `wait_s`, once every engine's side is open or failed."""
        for mine in (self.held, self._ended):
            if mine is not None and mine.version == version:
                return (await self.until_open(version, wait_s)).layout()
        deadline = time.monotonic() + wait_s
        shown = await self._shown(version)
        while shown is not None and shown["status"] == "opening" and time.monotonic() < deadline:
            await asyncio.sleep(SHOWN_POLL_S)  # a poll's period: no event on the bus says the sides are open
            shown = await self._shown(version)
        if shown is None:
            raise self._not_open(version)
        return shown

    async def _show(self, held: HeldTransfer) -> None:
        """Show the transfer's layout to the other processes (`status` there): at its start, once its sides are open,
        at its end. Best effort: the holder answers its own GET and commit without it."""
        leader = self.weights.leader
        if leader is None:
            return
        remaining = max(0.0, held.deadline - time.monotonic())
        layout = held.layout() | {"deadline_at": time.time() + remaining}
        try:
            await leader.bus.show_transfer(layout, remaining + SHOWN_AFTER_END_S)
        except StoreError as exc:
            logger.warning(
                "weights: the transfer of version %d is not shown to the other gateway processes (%s): their GET "
                "/admin/weights/%d answers 409 until it is",
                held.version,
                exc,
                held.version,
            )

    async def _shown(self, version: int) -> dict[str, Any] | None:
        leader = self.weights.leader
        shown = await leader.bus.shown_transfer() if leader is not None else None
        if shown is None or shown.get("version") != version:
            return None
        shown["deadline_s"] = round(max(0.0, shown.pop("deadline_at", 0.0) - time.time()), 3)
        return shown

    # -- commit ------------------------------------------------------------------------------------------------

    async def commit(self, version: int) -> UpdateReport:
        """Finish every engine's transfer with the version label, verify, resume; as a path update answers. A
        transfer another process holds is committed there (`CommitRelay`), answered the same."""
        w = self.weights
        held = self.held
        if held is None or held.version != version:
            relayed = await self.relay.commit(version) if self.relay is not None else None
            if relayed is None:
                raise self._not_open(version)
            return relayed
        await held.opened.wait()  # set by the end at the deadline too, so bounded by it
        if self.held is not held:
            raise self._not_open(version)
        if held.committing:
            raise Conflict(f"the transfer of version {version} is being committed already", param="version")
        held.committing = True  # from here the deadline leaves the end to this commit
        await self._received(held)  # the manifest's fan-out, bounded by the deadline
        self.held = None
        await stop(held._tasks[1])  # the deadline
        report, previous = held.report, w.version
        async with w.lock:
            try:
                await w.sequence.finish(Plan.transfer(version, previous), report)
                if report.updated:
                    # The version came from no path: a replica that restarts is not caught up from an older one.
                    w.version, w.last_source = version, None
            finally:
                unrecorded = await self._close(held, "committed" if report.updated else "failed")
        report.duration_s = time.monotonic() - held.started
        await w.announce(report)
        if not report.updated:
            raise w.failed(previous, report)
        w.updates += 1
        logger.info(
            "weights: version %d transferred (%s) to %s; stale: %s",
            version,
            held.spec.backend,
            report.updated,
            report.stale,
            extra={"version": version},
        )
        if unrecorded is not None:
            raise w.not_recorded(report, unrecorded)
        return report

    def commit_asked(self, event: Commit) -> None:
        """Another process relayed a commit of the transfer this one holds (on the bus): commit it here, once; the
        `serving` event of its end answers that process."""
        held = self.held
        if held is None or (held.version, held.token) != (event.version, event.token) or held.relayed:
            return
        held.relayed = True

        async def commit() -> None:
            try:
                await self.commit(event.version)
            except GatewayError as exc:  # the answer travels in the `serving` event; here, the log
                logger.warning("weights: the relayed commit of version %d: %s", event.version, exc)

        held._tasks.append(background(commit(), "weights-transfer-relayed-commit"))

    def serving_seen(self, event: Serving) -> None:
        """Another process's `serving` event: the answer of a commit relayed from here, where it is one."""
        if self.relay is not None:
            self.relay.serving_seen(event)

    # -- the end, however it ends --------------------------------------------------------------------------------

    async def _expire(self, held: HeldTransfer) -> None:
        await asyncio.sleep(max(0.0, held.deadline - time.monotonic()))  # a deadline, not synchronisation
        w, report = self.weights, held.report
        async with w.lock:
            if self.held is not held or held.committing:
                return  # committed, or being committed (its fan-out bounded by this deadline)
            self.held = None
            await stop(held._tasks[0], *held._receiving)  # an engine still waiting for the trainer's group or tensors
            if w.machine.state is State.PAUSING:
                w.machine.to(State.TRANSFERRING)
            try:
                await w.sequence.finish(Plan.reload(w.version, w.last_source), report)
            finally:
                await self._close(held, "failed")
        report.duration_s = time.monotonic() - held.started
        logger.error(
            "weights: the transfer of version %d was not committed within %g s (weights.transfer_commit_timeout_s): "
            "ended as a failed update; version %d serves on %s (reloaded from %s); stale: %s",
            report.version,
            self.commit_timeout_s,
            w.version,
            report.kept,
            w.last_source,
            report.stale,
            extra={"version": report.version},
        )
        await w.announce(report)

    async def _close(self, held: HeldTransfer, status: str) -> StoreError | None:
        w = self.weights
        held.status = status
        held.opened.set()
        self._ended = held
        await self._show(held)
        w.upcoming_version = None
        unrecorded = await w.publish_result(held.report, held.token)
        if w.leader is not None and held.token is not None:
            await w.leader.give_back(held.token)
        w.end()
        held.report.finished_at = time.time()
        return unrecorded

    def _not_open(self, version: int) -> Conflict:
        ended = self._ended
        if ended is not None and ended.version == version and ended.status == "failed":
            return Conflict(
                f"the transfer of version {version} ended as a failed update (not committed within "
                f"{self.commit_timeout_s:g} s, weights.transfer_commit_timeout_s, or no engine finished it); the "
                f"replicas serve version {self.weights.version} (kept: {ended.report.kept}; stale: "
                f"{ended.report.stale})",
                param="version",
            )
        return Conflict(f"no in-memory transfer of version {version} is under way", param="version")

    async def aclose(self) -> None:
        for held in (self.held, self._ended):
            if held is not None:
                await held.aclose()
