"""Backpressure: `rg:pending` counts finished sessions delivered to the stream and not yet acknowledged.

`rg:pending` is a gauge, not a ledger: the store INCRs it at most once per real entry (never resent by the
client's retry policy), so a crash or connection loss around that INCR can undercount by one, never over. The
trainer DECRs it once per acknowledged real entry. `create_session` answers `Overloaded` (429 + Retry-After)
while it is ≥ `max_pending`; existing sessions go on.
"""

from __future__ import annotations

import logging

from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from gateway.errors import Overloaded
from gateway.store.core import StoreCore

__all__ = ["Backpressure"]

logger = logging.getLogger(__name__)


class Backpressure:
    """Reads and counts `rg:pending`; refuses new sessions past `max_pending` (Retry-After `retry_after_s`)."""

    def __init__(self, core: StoreCore, *, max_pending: int, retry_after_s: float) -> None:
        self._core = core
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s

    async def pending(self) -> int:
        """Finished sessions delivered to the stream and not yet acknowledged by a trainer."""
        key = self._core.keys.pending

        def build(pipe: Pipeline) -> None:
            pipe.get(key)

        (value,) = await self._core.batched(build, "read pending")  # every new session asks
        return int(value) if value is not None else 0

    async def check(self) -> None:
        """`Overloaded` while `max_pending` trajectories or more wait for the trainer."""
        pending = await self.pending()
        if pending >= self.max_pending:
            raise Overloaded(
                f"{pending} finished trajectories wait for the trainer (store.max_pending={self.max_pending}); "
                "no new sessions until it catches up",
                retry_after_s=self.retry_after_s,
            )

    async def count_delivery(self) -> None:
        """INCR `rg:pending` at most once, never raising: the delivery it counts is already done.

        Not through the client's retry policy: a resent INCR whose first reply was lost (Redis killed after
        applying it) counts one delivery twice, and an overcount never decays (the trainer DECRs once per real
        entry), so it would hold back new sessions for good. A lost INCR instead undercounts by one, which only
        loosens backpressure; it is logged.
        """
        key = self._core.keys.pending
        pool = self._core.client.connection_pool
        try:
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # untyped in redis-py
        except RedisError as exc:
            logger.warning("%s not incremented (redis unavailable: %s); backpressure undercounts by one", key, exc)
            return
        try:
            await conn.send_command("INCR", key)
            await conn.read_response()
        except RedisError as exc:
            await conn.disconnect()
            logger.warning("%s may not be incremented (%s); backpressure may undercount by one", key, exc)
        except BaseException:
            await conn.disconnect()  # interrupted mid-command: the connection's state is unknown
            raise
        finally:
            await pool.release(conn)
