"""Delivery of finished sessions to `rg:trajectories` (steps (3)-(5) of a finish, see gateway/store/finish.py), and
the repair sweeper that completes a delivery a crash or an outage interrupted.

The stream and a session's keys live in different Redis Cluster slots, so delivery is not atomic; every step is
idempotent instead: (3) XADD the session's summary (a crash may leave a duplicate); (4) the `stream_id` claim, a
script on the session's slot, stores the first entry id it is given and answers the one stored: the writer
whose entry won SADDs its session to `rg:pending:sessions`, a loser XDELs its duplicate; (5) SREM
`rg:sessions:undelivered`.

A policy with a teacher (`gateway.teacher`) holds a session with samples at the gate until it is scored: `deliver`
queues it for its teacher (`gate`) and answers `AWAITING_SCORES`; the teacher's scorer delivers it once its meta
says `scoring` (scored, or unscored past the deadline). A finish retried and the repair sweeper reach the gate again,
which queues nothing twice.

A session holding a sample cut for staleness (its hash's `stale`) is, under `weights.stale_samples: drop`, not
delivered: it is recorded in `rg:abandoned` (with `reason` stale) once (the meta's `dropped`, set first, says it
was), and its count in the staleness budget given back. A GRPO group's member is delivered all the same (its group
is complete only with it), its stale sample marked.

Consumers (the trainer): an entry is real iff its id equals its session meta's `stream_id`; skip (ack) any
other; an entry whose meta has no `stream_id` yet is not arbitrated yet: leave it pending and look again.

With `redis.durable_replicas` > 0 (gateway/store/slot_clients.py), (3) and (4) each wait for the replicas of the
master that took them: the entry before it is claimed (a claimed entry a failover lost would be a delivered
trajectory no consumer ever reads), the claim before the finish answers (it covers the session's finish and its
samples, written to the same master before it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Container
from typing import Protocol

from redis.asyncio.client import Pipeline

from gateway.errors import SessionNotFound, StoreError
from gateway.store.backpressure import Backpressure, StartedSamples
from gateway.store.core import StoreCore
from gateway.store.keys import call, optional_text, text
from gateway.store.scripts import CLAIM_STREAM_ID, queue, rerun_unknown
from gateway.trajectory import SessionMeta

__all__ = ["AWAITING_SCORES", "Delivery", "ScoringGate"]

AWAITING_SCORES = "scoring"
"""What `Delivery.deliver` answers for a session held until its teacher scored it (no stream entry id looks so)."""


class ScoringGate(Protocol):
    """Where a policy with a teacher queues its finished sessions (`gateway.teacher.TeacherScoring`)."""

    async def enqueue(self, session_id: str) -> None: ...


logger = logging.getLogger(__name__)


class Delivery:
    """Delivers finished sessions to the stream exactly once after arbitration; repairs interrupted deliveries.

    `finishing`: the sessions whose finish runs in this process (the repair sweeper leaves them to it).
    """

    def __init__(
        self,
        core: StoreCore,
        backpressure: Backpressure,
        finishing: Container[str],
        started: StartedSamples | None = None,
    ) -> None:
        self._core = core
        self._backpressure = backpressure
        self._finishing = finishing
        self._started = started
        self.drop_stale = False  # `weights.stale_samples: drop` (see the module docstring)
        self.gate: ScoringGate | None = None  # a policy with a teacher (see the module docstring)
        # Told the id of each session this process delivered (its real entry, once): the dashboard's feed.
        self.on_delivered: list[Callable[[str], None]] = []
        self._announced = False  # `rg:trajectories:partitions` written by this process

    async def deliver(self, meta: SessionMeta) -> str:
        """Steps (3)-(5) for a finished session; its real entry's id. Safe to run any number of times,
        concurrently. A session with no sample and no group is not delivered (nothing to train on, and anyone could
        fill the trainer's backlog with them): "" and out of the repair set. A group's empty member is delivered:
        its group is complete only with it. A session held for its teacher: `AWAITING_SCORES`."""
        if meta.sample_count == 0 and meta.group_id is None:
            undelivered = self._core.keys.undelivered

            def confirm(pipe: Pipeline) -> None:
                pipe.srem(undelivered, meta.id)

            await self._core.batched(confirm, "confirm an empty session")
            return ""
        if self.gate is not None and meta.scoring is None and meta.sample_count:
            await self.gate.enqueue(meta.id)
            return AWAITING_SCORES
        if self.drop_stale and meta.group_id is None and await self.holds_stale(meta):
            await self._drop_stale(meta)
            return ""
        entry_id = await self.append_entry(meta)
        return await self.claim_entry(meta, entry_id)

    async def holds_stale(self, meta: SessionMeta) -> bool:
        """Whether one of the session's samples was cut for staleness (`Sample.stale`)."""
        keys = self._core.keys

        def build(pipe: Pipeline) -> None:
            for index in range(meta.sample_count):
                pipe.hget(keys.sample(meta.id, index), "stale")

        flags = await self._core.batched(build, "read stale flags")
        return any(flag is not None and text(flag) == "1" for flag in flags)

    async def _drop_stale(self, meta: SessionMeta) -> None:
        """Record the session as dropped for staleness, once, and forget it as undelivered."""
        keys, client = self._core.keys, self._core.client
        first = await call(client.hsetnx(keys.meta(meta.id), "dropped", "stale"), "mark dropped")
        if first:
            entry = {"session_id": meta.id, "group_id": "", "samples": meta.sample_count, "reason": "stale"}
            await call(client.xadd(keys.abandoned, entry, maxlen=100_000, approximate=True), "record dropped")  # type: ignore[arg-type]
            self._core.stats.dropped_stale += 1
            if self._started is not None:
                await self._started.give_back(1, "dropped as stale")
        logger.info("session=%s: dropped, a sample was cut for staleness (weights.stale_samples: drop)", meta.id)
        await call(client.srem(keys.undelivered, meta.id), "forget undelivered")

    def stream_of(self, meta: SessionMeta) -> str:
        """The partition of the trajectory stream that takes the session's entry."""
        keys = self._core.keys
        return keys.stream(keys.partition_of(meta.group_id or meta.id))

    async def append_entry(self, meta: SessionMeta) -> str:
        """Step (3): XADD the session's summary. May leave a duplicate; `claim_entry` arbitrates."""
        entry = {
            "session_id": meta.id,
            "group_id": meta.group_id or "",
            "reward": "" if meta.reward is None else repr(meta.reward),
            "samples": meta.sample_count,
        }
        keys = self._core.keys
        stream = self.stream_of(meta)
        announce = not self._announced

        durability = self._core.durability

        def announcing(pipe: Pipeline) -> None:
            if announce:  # consumers read this many partitions (idempotent, once per process)
                pipe.set(keys.stream_partitions, keys.partitions)

        def append(pipe: Pipeline) -> None:
            pipe.xadd(stream, entry)  # type: ignore[arg-type]

        def build(pipe: Pipeline) -> None:
            announcing(pipe)
            append(pipe)

        if durability.replicas:
            if announce:
                await self._core.batched(announcing, "announce partitions")
            (entry_id,) = await durability.write(stream, append, "append trajectory")
        else:
            *_, entry_id = await self._core.batched(build, "append trajectory")  # with the other callers' commands
        self._announced = True
        return text(entry_id)

    async def claim_entry(self, meta: SessionMeta, entry_id: str) -> str:
        """Steps (4) and (5): the first entry id recorded as `stream_id` is the real one; it alone is counted."""
        session_id = meta.id
        keys = self._core.keys
        winner = await self._claim(meta, entry_id)
        if winner == entry_id:
            await self._backpressure.count_delivery(session_id)
            self._core.stats.delivered += 1
            for callback in self.on_delivered:
                callback(session_id)
        else:
            self._core.stats.duplicate_entries += 1
            with contextlib.suppress(StoreError):  # best effort: consumers skip entries other than `stream_id`
                await call(self._core.client.xdel(self.stream_of(meta), entry_id), "delete duplicate entry")

        def confirm(pipe: Pipeline) -> None:
            pipe.srem(keys.undelivered, session_id)

        await self._core.batched(confirm, "confirm delivery")
        return winner

    async def _claim(self, meta: SessionMeta, entry_id: str) -> str:
        """The `stream_id` claim script: the id stored now (the first one given)."""
        script_keys = [self._core.keys.meta(meta.id)]
        claim, durability = self._core.scripts.claim_stream_id, self._core.durability
        if durability.replicas:

            def claiming(pipe: Pipeline) -> None:
                # By its source: the master the claim goes to may not know the script's SHA.
                pipe.eval(CLAIM_STREAM_ID, 1, *script_keys, entry_id)

            (stored,) = await durability.write(script_keys[0], claiming, "claim stream entry")
        else:

            def build(pipe: Pipeline) -> None:
                queue(pipe, claim, script_keys, [entry_id])

            (reply,) = await call(self._core.batcher.execute(build), "claim stream entry")
            stored = await call(rerun_unknown(reply, claim, script_keys, [entry_id]), "claim stream entry")
        if isinstance(stored, Exception):
            raise StoreError(f"redis: claim stream entry failed: {stored}") from stored
        winner = optional_text(stored)
        if winner is None:
            raise SessionNotFound(f"session {meta.id} expired while being finished", param="session_id")
        return winner

    async def confirm_durable(self, meta: SessionMeta) -> None:
        """A session found delivered (its `stream_id` set, by an earlier attempt or another process) is answered
        only once its master's replicas hold it, where `redis.durable_replicas` asks for any: the claim again."""
        if meta.stream_id is not None and self._core.durability.replicas:
            await self._claim(meta, meta.stream_id)

    async def repair_undelivered(self, older_than_s: float = 0.0) -> int:
        """Deliver sessions finished but not confirmed in the stream (a finish that crashed or gave up midway).

        Sessions finished less than `older_than_s` ago, and those finishing in this process, are left to their
        own finish. Ids whose session is gone or abandoned leave the set; active ones (a finish that has not
        marked them yet) stay. Returns how many sessions this call confirmed in the stream.
        """
        members = await call(self._core.client.smembers(self._core.keys.undelivered), "read undelivered")
        cutoff = time.time() - older_than_s
        delivered = 0
        for session_id in sorted(text(m) for m in members):
            if session_id not in self._finishing and await self._repair_one(session_id, cutoff):
                delivered += 1
        self._core.stats.repaired += delivered
        return delivered

    async def _repair_one(self, session_id: str, cutoff: float) -> bool:
        client, keys = self._core.client, self._core.keys
        meta = await self._core.get_session(session_id)
        if meta is None or meta.status == "abandoned":
            await call(client.srem(keys.undelivered, session_id), "forget undelivered")
            return False
        if meta.status != "finished" or (meta.finished_at or 0.0) > cutoff:
            return False
        await call(client.zrem(keys.active_sessions, session_id), "unindex session")
        if meta.stream_id is not None:
            await call(client.srem(keys.undelivered, session_id), "confirm delivery")
        elif await self.deliver(meta) == AWAITING_SCORES:
            return False  # its teacher's scorer delivers it
        logger.info("session=%s: repaired an interrupted finish", session_id)
        return True
