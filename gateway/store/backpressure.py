"""Backpressure: `rg:pending:sessions` holds the finished sessions delivered to the stream and not yet acknowledged.

A set, not a counter: the store SADDs a session once its entry is the real one, the trainer SREMs it once it
acknowledged that entry. Both are idempotent, so a command the client resends after a lost reply (a Redis failover,
a dropped connection) counts nothing twice, and the gauge is exact, SCARD. `create_session` answers `Overloaded`
(429 + Retry-After) while it is ≥ `max_pending`; existing sessions go on.
"""

from __future__ import annotations

import logging

from redis.asyncio.client import Pipeline

from gateway.errors import Overloaded, StoreError
from gateway.store.core import StoreCore

__all__ = ["Backpressure"]

logger = logging.getLogger(__name__)


class Backpressure:
    """Reads and counts `rg:pending:sessions`; refuses new sessions past `max_pending` (Retry-After `retry_after_s`)."""

    def __init__(self, core: StoreCore, *, max_pending: int, retry_after_s: float) -> None:
        self._core = core
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s

    async def pending(self) -> int:
        """Finished sessions delivered to the stream and not yet acknowledged by a trainer."""
        key = self._core.keys.pending

        def build(pipe: Pipeline) -> None:
            pipe.scard(key)

        (value,) = await self._core.batched(build, "read pending")  # every new session asks
        return int(value)

    async def check(self) -> None:
        """`Overloaded` while `max_pending` trajectories or more wait for the trainer."""
        pending = await self.pending()
        if pending >= self.max_pending:
            raise Overloaded(
                f"{pending} finished trajectories wait for the trainer (store.max_pending={self.max_pending}); "
                "no new sessions until it catches up",
                retry_after_s=self.retry_after_s,
            )

    async def count_delivery(self, session_id: str) -> None:
        """Add the delivered session to `rg:pending:sessions`, never raising: the delivery it counts is already
        done. Where Redis stays away past the client's retries, backpressure undercounts by one (logged)."""
        key = self._core.keys.pending

        def build(pipe: Pipeline) -> None:
            pipe.sadd(key, session_id)

        try:
            await self._core.batched(build, "count a delivery")
        except StoreError as exc:
            logger.warning("%s not counted (%s); backpressure undercounts by one", session_id, exc)
