"""The idle sweeper: active sessions idle for more than `session_idle_ttl_s` are closed as `abandoned`, recorded
in `rg:abandoned` and never delivered to `rg:trajectories`; and the periodic sweep that runs it with the repair
sweeper (gateway/store/delivery.py).

Each sweep closes every session idle by then, however many (a batch at a time), so sessions are abandoned as fast
as agents can leave them; several processes sweep the one index at once, and each session's close is a WATCHed
transaction on its meta: exactly one of them closes it, and that one records it."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Container
from typing import Literal

from gateway.errors import StoreError
from gateway.store.backpressure import StartedSamples
from gateway.store.core import StoreCore, Writes
from gateway.store.delivery import Delivery
from gateway.store.keys import call, text
from gateway.trajectory import SessionMeta

__all__ = ["IdleSweeper", "sweep_forever", "sweep_period_s"]

logger = logging.getLogger(__name__)

_ABANDONED_MAXLEN = 100_000
_BATCH = 500  # idle sessions read at a time
_CONCURRENCY = 16  # idle sessions closed at once (a transaction each)
# A session found abandoned but not recorded this recently is another sweeper's, between its close and its record.
_RECORD_GRACE_S = 30.0

_Outcome = Literal["closed", "gone", "left"]


class IdleSweeper:
    """Closes idle sessions as abandoned. `finishing`: the sessions whose finish runs in this process (left
    alone)."""

    def __init__(self, core: StoreCore, finishing: Container[str], started: StartedSamples | None = None) -> None:
        self._core = core
        self._finishing = finishing
        self._started = started  # an abandoned session never reaches the trainer: its budget is given back

    @property
    def session_idle_ttl_s(self) -> float:
        return self._core.session_idle_ttl_s

    async def abandon_idle(self, now: float | None = None, batch: int = _BATCH) -> list[str]:
        """Close every active session idle for more than `session_idle_ttl_s` as `abandoned`, recorded in
        `rg:abandoned` and never delivered to `rg:trajectories`. Idempotent, and safe while other processes sweep.

        Reads the idle ones `batch` at a time (each process in its own order, so that processes sweeping at once
        mostly close different sessions), closes `_CONCURRENCY` at once and yields between batches, until none idle
        before `now` is left (those that went idle since wait for the next sweep; one this sweep leaves alone, for a
        finish or another sweeper, is not tried again). The activity index may be stale; the meta's `updated_at`
        (checked inside the transaction) decides. Returns the sessions this call abandoned.
        """
        now = time.time() if now is None else now
        cutoff = now - self._core.session_idle_ttl_s
        closed: list[str] = []
        left: set[str] = set()  # in the index still, left alone by this sweep
        while True:
            wanted = batch + len(left)
            found = await call(
                self._core.client.zrangebyscore(self._core.keys.active_sessions, "-inf", cutoff, start=0, num=wanted),
                "read idle",
            )
            read = [text(member) for member in found if isinstance(member, bytes | str)]
            left.intersection_update(read)  # the others left the index meanwhile
            ids = [session_id for session_id in read if session_id not in left]
            random.shuffle(ids)
            outcomes: list[_Outcome] = []
            for start in range(0, len(ids), _CONCURRENCY):
                chunk = ids[start : start + _CONCURRENCY]
                outcomes += await asyncio.gather(*(self._abandon_one(i, cutoff, now) for i in chunk))
            now_closed = [session_id for session_id, outcome in zip(ids, outcomes, strict=True) if outcome == "closed"]
            left.update(session_id for session_id, outcome in zip(ids, outcomes, strict=True) if outcome == "left")
            closed += now_closed
            self._core.stats.abandoned += len(now_closed)
            if now_closed and self._started is not None:
                await self._started.give_back(len(now_closed), "abandoned")
            if not ids or len(read) < wanted:
                return closed
            await asyncio.sleep(0)  # a batch at a time: the turns of this process go on meanwhile

    async def _abandon_one(self, session_id: str, cutoff: float, now: float) -> _Outcome:
        """Close one idle session. "closed": by this call; "gone": out of the index (active after all, rescored;
        closed before; no such session); "left": in the index still, for its own finish or another sweeper."""
        if session_id in self._finishing:
            return "left"
        client, keys = self._core.client, self._core.keys
        outcome: list[SessionMeta | None] = []

        def plan(before: SessionMeta | None) -> Writes | None:
            outcome.append(before)
            if before is None or before.status != "active" or before.updated_at > cutoff:
                return None
            return self._core.writes_closing(before, {"status": "abandoned", "abandoned_at": now})

        await self._core.transact(session_id, plan, "abandon session")
        before = outcome[-1]
        if before is not None and before.status == "active" and before.updated_at > cutoff:  # active after all
            await call(client.zadd(keys.active_sessions, {session_id: before.updated_at}), "rescore")
            return "gone"
        abandoned_now = before is not None and before.status == "active"
        if before is not None and before.status == "abandoned":
            # Abandoned earlier and still indexed: another sweeper is recording it now (left to it), or a sweep
            # was interrupted before its record (recorded here, once the other would have finished).
            recorded, abandoned_at = await call(
                client.hmget(keys.meta(session_id), ["abandoned_id", "abandoned_at"]), "read record"
            )
            if not recorded and now - float(abandoned_at or 0) < _RECORD_GRACE_S:
                return "left"
            if not recorded:
                await self._record_abandoned(before)
        elif before is not None and abandoned_now:
            await self._record_abandoned(before)
        await call(client.zrem(keys.active_sessions, session_id), "unindex session")
        return "closed" if abandoned_now else "gone"

    async def _record_abandoned(self, meta: SessionMeta) -> None:
        # At least once: a crash between XADD and HSET records the session twice (a log, not a trajectory).
        client, keys = self._core.client, self._core.keys
        entry = {"session_id": meta.id, "group_id": meta.group_id or "", "samples": meta.sample_count}
        entry_id = await call(
            client.xadd(keys.abandoned, entry, maxlen=_ABANDONED_MAXLEN, approximate=True),  # type: ignore[arg-type]
            "record abandoned",
        )
        await call(client.hset(keys.meta(meta.id), "abandoned_id", entry_id), "record abandoned")


def sweep_period_s(interval_s: float, session_idle_ttl_s: float) -> float:
    """How often idle sessions are looked for: every `interval_s`, or half the idle TTL where that is shorter, so
    a session is abandoned at most half its TTL late."""
    return min(interval_s, session_idle_ttl_s / 2)


async def sweep_forever(delivery: Delivery, idle: IdleSweeper, interval_s: float, repair_grace_s: float) -> None:
    """Abandon idle sessions every `sweep_period_s`, all of them each time (`IdleSweeper.abandon_idle`); every
    `interval_s`, first repair deliveries finished more than `repair_grace_s` ago."""
    period_s = sweep_period_s(interval_s, idle.session_idle_ttl_s)
    next_repair = time.monotonic()
    while True:
        await asyncio.sleep(period_s)  # a period, not synchronisation
        try:
            if time.monotonic() >= next_repair:
                next_repair = time.monotonic() + interval_s
                await delivery.repair_undelivered(older_than_s=repair_grace_s)
            await idle.abandon_idle()
        except StoreError as exc:
            logger.warning("store sweep failed (%s); next in %gs", exc, period_s)
