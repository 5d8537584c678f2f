"""The replica pool: membership, health, circuit breaking, load, placement, and each replica's weight version.

A replica is one engine server (`Engine`) and the routing targets it is (`Replica`): itself, or, with
`data_parallel_size: N`, each of its N data-parallel ranks. Placement, load and circuit breaking work on targets;
membership, health probes and weight versions on engines (one probe, one version for all of an engine's ranks).

Placement goes through a policy (`gateway.routing.policies`); `sticky`, the default, keeps a session on its replica
while that replica serves. A new member of a GRPO group goes with its group (`gateway.routing.groups`) under
`routing.group_placement: together`. The policies that weigh engine load get a background reader of it
(`gateway.routing.load`); `sticky` reads none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from backends.base import EngineBackend
from backends.errors import BackendUnavailable
from common.hashing import mix64, string_key
from gateway.background import stop
from gateway.routing.groups import GroupPlacements
from gateway.routing.load import LoadBound, LoadPoller
from gateway.routing.policies import Ask, CacheAwarePolicy, RoutingPolicyName, make_policy
from gateway.routing.replica import Engine, InFlight, Replica

logger = logging.getLogger(__name__)

PROBES_TO_TAKE_OUT = 2
"""Health probes failed in a row after which a replica's requests in flight are cut (`ReplicaPool.take_out`)."""


@dataclass
class AffinityStats:
    """Turns that reached the same replica as the session's previous turn."""

    same: int = 0
    moved: int = 0

    @property
    def ratio(self) -> float:
        total = self.same + self.moved
        return self.same / total if total else 1.0


class Lease:
    """A request in flight on a replica (`ReplicaPool.lease`); the pool's waiters wake when its last one ends.

    A class rather than a `contextlib` context manager: every engine request enters one, and a generator-based
    async one costs several times more per request.
    """

    __slots__ = ("_pool", "_replica", "_request")

    def __init__(self, pool: ReplicaPool, replica: Replica, request: InFlight | None) -> None:
        self._pool = pool
        self._replica = replica
        self._request = request

    def __enter__(self) -> Replica:
        self._replica.in_flight += 1
        if self._request is not None:
            self._replica.requests.add(self._request)
        return self._replica

    def __exit__(self, *exc_info: object) -> None:
        replica = self._replica
        replica.in_flight -= 1
        if self._request is not None:
            replica.requests.discard(self._request)
        if replica.in_flight == 0:
            self._pool.notify()


class ReplicaPool:
    """Replicas, their health and load, and where each session lives.

    `placements` remembers the replica of the open sessions of this process (released when a session finishes,
    `forget`; a bounded LRU besides, for the sessions never finished); the session store records it durably so
    other gateway processes follow it too.
    """

    def __init__(
        self,
        policy: RoutingPolicyName = "sticky",
        *,
        balance_factor: float = 0.25,
        failure_threshold: int = 3,
        circuit_open_s: float = 10.0,
        health_interval_s: float = 2.0,
        max_placements: int = 100_000,
        group_placement: Literal["together", "hash"] = "together",
        bound: LoadBound | None = None,
        load_interval_s: float = 1.0,
        prefix_block_tokens: int = 16,
        prefix_max_blocks: int = 65_536,
    ) -> None:
        self.bound = bound if bound is not None else LoadBound()
        self.policy = make_policy(policy, balance_factor, self.bound, prefix_block_tokens, prefix_max_blocks)
        # GRPO groups placed as a whole (`gateway.routing.groups`); None under `group_placement: hash`.
        self.groups = GroupPlacements(self.bound) if group_placement == "together" else None
        # The prefix trees of `cache_aware`, fed by every engine request sent (`sent`); None under other policies.
        self.prefixes = self.policy if isinstance(self.policy, CacheAwarePolicy) else None
        self.loads: LoadPoller | None = None
        if self.policy.reads_load:
            on_read = self.prefixes.on_read if self.prefixes is not None else None
            self.loads = LoadPoller(self.engines, load_interval_s, on_read)
        self.failure_threshold = failure_threshold
        self.circuit_open_s = circuit_open_s
        self.health_interval_s = health_interval_s
        self.replicas: dict[str, Replica] = {}  # the routing targets, by id
        self._engines: dict[str, Engine] = {}
        self.placements: OrderedDict[str, str] = OrderedDict()
        self.max_placements = max_placements
        self.affinity = AffinityStats()
        self._changed = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        # Runs after every successful probe, before an engine that was down serves again: it may have restarted
        # (between two probes, unseen) on other weights than the pool runs; the hook holds such an engine out.
        self.on_probe: Callable[[Engine], Awaitable[None]] | None = None

    # -- membership ----------------------------------------------------------------------------

    def add(self, backend: EngineBackend, *, version: int | None = None, stale: bool = False) -> Engine:
        """Add the engine of `backend` and its routing targets (one per data-parallel rank)."""
        engine = Engine(backend)
        if engine.id in self._engines:
            raise ValueError(f"replica {engine.id!r} is already in the pool")
        taken = [target.id for target in engine.targets if target.id in self.replicas]
        if taken:
            raise ValueError(f"replica {engine.id!r}: the pool has a routing target named {taken[0]!r} already")
        engine._version, engine._stale = version, stale  # the pool owns both (see `Engine`)
        self._engines[engine.id] = engine
        for target in engine.targets:
            self.replicas[target.id] = target
        self.notify()
        return engine

    async def remove(self, replica_id: str) -> Engine:
        """Remove the engine `replica_id` (a configured replica's id) and its routing targets."""
        engine = self._engines.pop(replica_id)
        for target in engine.targets:
            del self.replicas[target.id]
            if self.prefixes is not None:
                self.prefixes.drop(target.id)
        self.notify()
        await engine.backend.aclose()
        return engine

    def get(self, replica_id: str) -> Replica | None:
        """The routing target `replica_id` (a replica's id, or `<id>@dp<rank>` for a rank of one)."""
        return self.replicas.get(replica_id)

    def engine(self, replica_id: str) -> Engine | None:
        """The engine of the configured replica `replica_id`."""
        return self._engines.get(replica_id)

    def all(self) -> list[Replica]:
        """Every routing target."""
        return list(self.replicas.values())

    def engines(self) -> list[Engine]:
        """Every engine: what health probes, load reads and weight updates go to, once each."""
        return list(self._engines.values())

    # -- weight versions -----------------------------------------------------------------------

    def set_version(self, engine: Engine, version: int) -> None:
        """`engine` runs `version`, verified: its targets serve again if it was held out."""
        changed = engine._version != version or engine._stale
        engine._version, engine._stale = version, False
        if changed:
            self.notify()

    def mark_stale(self, engine: Engine, *, runs: int | None = None) -> None:
        """Hold `engine` (every target of it) out: its weights are not the pool's (a failed load, a restart on other
        weights) until a later load succeeds on it (`set_version`). `runs`: the version it reports, where read."""
        changed = not engine._stale or (runs is not None and engine._version != runs)
        engine._stale = True
        if runs is not None:
            engine._version = runs
        if changed:
            self.notify()

    # -- placement -----------------------------------------------------------------------------

    def candidates(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values() if r.serving(now)]

    def pick(
        self,
        session_id: str | None,
        exclude: Iterable[str] = (),
        *,
        prompt: Sequence[int] | None = None,
        group: str | None = None,
    ) -> Replica | None:
        """The replica for this session now, or None if none can serve. Records the placement. `prompt`: the request's
        prompt ids (`cache_aware` looks them up); `group`: the GRPO group the session is a member of (a new member
        goes with its group, `gateway.routing.groups`)."""
        excluded = set(exclude)
        previous = self.placements.get(session_id) if session_id else None
        current = self.replicas.get(previous) if previous is not None else None
        policy = self.policy
        if current is not None and current.id not in excluded and current.serving(time.monotonic()):
            if not policy.rebalances:
                self._place(session_id, current, moved=False)  # sticky: checked before any candidate list is built
                return current
            candidates = [r for r in self.candidates() if r.id not in excluded]
            if policy.stays(current, candidates):
                self._place(session_id, current, moved=False)
                return current
        else:
            candidates = [r for r in self.candidates() if r.id not in excluded]
            if not candidates:
                return None
        key = string_key(session_id) if session_id else mix64(time.monotonic_ns())
        if group is not None and previous is None and self.groups is not None:
            chosen = self.groups.place(group, candidates)
        else:
            chosen = policy.choose(Ask(key, previous is None, prompt), candidates)
        if session_id:
            self._place(session_id, chosen, moved=previous is not None)
        return chosen

    async def agree_group(self, group: str, size: int | None) -> None:
        """Before the first turn of a new member of `group` (`size` members, where known): agree with every gateway
        process on the group's replica (`GroupPlacements.agree`); nothing under `group_placement: hash`."""
        if self.groups is not None:
            await self.groups.agree(group, size, self.candidates)

    def sent(self, replica: Replica, prompt: Sequence[int]) -> None:
        """An engine request with `prompt` goes to `replica` (what `cache_aware` expects its prefix cache to hold)."""
        if self.prefixes is not None:
            self.prefixes.sent(replica, prompt)

    def _place(self, session_id: str | None, replica: Replica, *, moved: bool) -> None:
        if session_id is None:
            return
        if session_id in self.placements:
            if moved or self.placements[session_id] != replica.id:
                self.affinity.moved += 1
            else:
                self.affinity.same += 1
        self.placements[session_id] = replica.id
        self.placements.move_to_end(session_id)
        while len(self.placements) > self.max_placements:
            self.placements.popitem(last=False)

    def remember(self, session_id: str, replica_id: str) -> None:
        """Adopt a placement recorded elsewhere (e.g. another gateway process, via the session store)."""
        self.placements.setdefault(session_id, replica_id)

    def forget(self, session_id: str) -> None:
        """The session finished: release its placement (its Redis meta keeps the record)."""
        self.placements.pop(session_id, None)

    async def wait_for_change(self, timeout: float) -> None:
        """Wait until membership, health or load changes (or `timeout` passes)."""
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)

    async def acquire(
        self,
        session_id: str | None,
        deadline: float,
        exclude: Iterable[str] = (),
        *,
        prompt: Sequence[int] | None = None,
        group: str | None = None,
    ) -> Replica:
        """Pick a replica, waiting (until `deadline`, monotonic) while none can serve; 503 after that."""
        excluded = tuple(exclude)
        while True:
            replica = self.pick(session_id, excluded, prompt=prompt, group=group)
            if replica is None and excluded:
                # Every other replica is out: retrying the same one beats failing.
                replica = self.pick(session_id, prompt=prompt, group=group)
            if replica is not None:
                return replica
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackendUnavailable("no replica can serve: all are down, stale or draining")
            await self.wait_for_change(remaining)

    async def until_idle(self, replica: Replica | Engine) -> None:
        """Return once no request of this process is in flight on `replica` (a target, or every target of an
        engine)."""
        while replica.in_flight:
            await self.wait_for_change(1.0)

    def lease(self, replica: Replica, request: InFlight | None = None) -> Lease:
        """Count a request in flight on `replica` for the duration of a `with` block; `request`, if given, is
        interrupted if the pool takes the replica out meanwhile (`take_out`)."""
        return Lease(self, replica, request)

    # -- health --------------------------------------------------------------------------------

    def report_failure(self, replica: Replica) -> None:
        """Passive failure: count it; open the circuit past the threshold (the request moves elsewhere, and so do
        the others in flight on it: `take_out`)."""
        replica.consecutive_failures += 1
        if replica.consecutive_failures >= self.failure_threshold or not replica.healthy:
            replica.circuit_open_until = time.monotonic() + self.circuit_open_s
            logger.warning(
                "replica %s: circuit open for %.1fs", replica.id, self.circuit_open_s, extra={"replica": replica.id}
            )
            self.take_out(replica, "circuit open")
        self.notify()

    def report_success(self, replica: Replica) -> None:
        if replica.consecutive_failures or replica.circuit_open_until:
            replica.consecutive_failures = 0
            replica.circuit_open_until = 0.0
            self.notify()

    def mark_unreachable(self, replica: Replica) -> None:
        """A connection-level failure: take its engine out at once, every rank of it (one server); the health loop
        brings it back."""
        engine = replica.engine
        engine.healthy = False
        self.report_failure(replica)
        for target in engine.targets:
            if target is not replica:
                self.take_out(target, "its engine is unreachable")

    async def check_health(self) -> None:
        """Probe every engine once, concurrently."""
        async with asyncio.TaskGroup() as group:
            for engine in self.engines():
                group.create_task(self._probe(engine))

    async def check_weights(self, engine: Engine) -> None:
        """Run a probe's weights check (`on_probe`) on `engine` now: its answer was labelled with other weights than
        the pool thinks it runs."""
        if self.on_probe is not None:
            await self.on_probe(engine)

    async def _probe(self, engine: Engine) -> None:
        """One failed probe stops new requests going to the engine; the second in a row also cuts its requests in
        flight (`take_out`): an engine that is busy for a moment (a pause, a weight load, a long prefill) misses
        one probe, and its requests are not redone for that; a hung one misses every probe."""
        ok = await engine.backend.health()
        if ok and self.on_probe is not None:
            await self.on_probe(engine)
        engine.failed_probes = 0 if ok else engine.failed_probes + 1
        if ok != engine.healthy:
            state = "healthy" if ok else "unhealthy"
            logger.warning("replica %s is now %s", engine.id, state, extra={"replica": engine.id})
            engine.healthy = ok
            if ok:
                for target in engine.targets:
                    target.consecutive_failures = 0
                    target.circuit_open_until = 0.0
            self.notify()
        if engine.failed_probes == PROBES_TO_TAKE_OUT:
            for target in engine.targets:
                self.take_out(target, f"{PROBES_TO_TAKE_OUT} health probes failed in a row")

    def take_out(self, replica: Replica, reason: str) -> None:
        """The replica stopped serving (health probe, circuit): interrupt every request in flight on it, which
        resumes on another replica with its tokens so far, instead of waiting on a replica that may never answer
        (a hung engine keeps its sockets open)."""
        requests = list(replica.requests)
        if not requests:
            return
        logger.warning(
            "replica %s taken out (%s): %d requests in flight resume elsewhere",
            replica.id,
            reason,
            len(requests),
            extra={"replica": replica.id},
        )
        for request in requests:
            request.interrupt(reason)

    def start_health_checks(self) -> None:
        """Probe every engine's health in the background, and read its load where the policy weighs it."""
        if self._health_task is None:
            # Hard reference: the loop keeps only weak references to tasks.
            self._health_task = asyncio.create_task(self._health_loop(), name="replica-health")
        if self.loads is not None:
            self.loads.start()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a probe bug must not kill health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(self.health_interval_s)

    async def aclose(self) -> None:
        if self.loads is not None:
            await self.loads.aclose()
        if self._health_task is not None:
            await stop(self._health_task)
            self._health_task = None
        async with asyncio.TaskGroup() as group:
            for engine in self.engines():
                group.create_task(engine.backend.aclose())

    def notify(self) -> None:
        """Wake waiters: membership, health, load or draining changed."""
        # Wake everyone waiting on the current event and give later waiters a fresh one.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
