"""The idle sweeper: active sessions idle for more than `session_idle_ttl_s` are closed as `abandoned`, recorded
in `rg:abandoned` and never delivered to `rg:trajectories`; and the periodic sweep that runs it with the repair
sweeper (gateway/store/delivery.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container

from gateway.errors import StoreError
from gateway.store.backpressure import StartedSamples
from gateway.store.core import StoreCore, Writes
from gateway.store.delivery import Delivery
from gateway.store.keys import call, text
from gateway.trajectory import SessionMeta

__all__ = ["IdleSweeper", "sweep_forever"]

logger = logging.getLogger(__name__)

_ABANDONED_MAXLEN = 100_000


class IdleSweeper:
    """Closes idle sessions as abandoned. `finishing`: the sessions whose finish runs in this process (left
    alone)."""

    def __init__(self, core: StoreCore, finishing: Container[str], started: StartedSamples | None = None) -> None:
        self._core = core
        self._finishing = finishing
        self._started = started  # an abandoned session never reaches the trainer: its budget is given back

    async def abandon_idle(self, now: float | None = None, limit: int = 1_000) -> list[str]:
        """Close active sessions idle for more than `session_idle_ttl_s` as `abandoned`, recorded in
        `rg:abandoned` and never delivered to `rg:trajectories`. Idempotent; at most `limit` per call.

        The activity index may be stale; the meta's `updated_at` (checked inside the transaction) decides.
        Returns the sessions this call abandoned.
        """
        now = time.time() if now is None else now
        cutoff = now - self._core.session_idle_ttl_s
        found = await call(
            self._core.client.zrangebyscore(self._core.keys.active_sessions, "-inf", cutoff, start=0, num=limit),
            "read idle",
        )
        ids = [text(member) for member in found if isinstance(member, bytes | str)]
        closed = [session_id for session_id in ids if await self._abandon_one(session_id, cutoff, now)]
        self._core.stats.abandoned += len(closed)
        if closed and self._started is not None:
            await self._started.give_back(len(closed), "abandoned")
        return closed

    async def _abandon_one(self, session_id: str, cutoff: float, now: float) -> bool:
        if session_id in self._finishing:
            return False
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
            return False
        abandoned_now = before is not None and before.status == "active"
        # A session abandoned earlier but still indexed: an interrupted sweep; record it if that was not done.
        if before is not None and before.status != "finished" and (abandoned_now or not await self._recorded(before)):
            await self._record_abandoned(before)
        await call(client.zrem(keys.active_sessions, session_id), "unindex session")
        return abandoned_now

    async def _recorded(self, meta: SessionMeta) -> bool:
        return bool(await call(self._core.client.hexists(self._core.keys.meta(meta.id), "abandoned_id"), "read record"))

    async def _record_abandoned(self, meta: SessionMeta) -> None:
        # At least once: a crash between XADD and HSET records the session twice (a log, not a trajectory).
        client, keys = self._core.client, self._core.keys
        entry = {"session_id": meta.id, "group_id": meta.group_id or "", "samples": meta.sample_count}
        entry_id = await call(
            client.xadd(keys.abandoned, entry, maxlen=_ABANDONED_MAXLEN, approximate=True),  # type: ignore[arg-type]
            "record abandoned",
        )
        await call(client.hset(keys.meta(meta.id), "abandoned_id", entry_id), "record abandoned")


async def sweep_forever(delivery: Delivery, idle: IdleSweeper, interval_s: float, repair_grace_s: float) -> None:
    """Every `interval_s`: repair deliveries finished more than `repair_grace_s` ago, then abandon idle sessions."""
    while True:
        await asyncio.sleep(interval_s)  # a period, not synchronisation
        try:
            await delivery.repair_undelivered(older_than_s=repair_grace_s)
            await idle.abandon_idle()
        except StoreError as exc:
            logger.warning("store sweep failed (%s); next in %gs", exc, interval_s)
