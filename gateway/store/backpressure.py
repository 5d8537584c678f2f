"""The bounds on new sessions: the memory bound (backpressure) and the staleness budget's count.

Backpressure: `rg:pending:sessions` holds the finished sessions delivered to the stream and not yet acknowledged.

A set, not a counter: the store SADDs a session once its entry is the real one, the trainer SREMs it once it
acknowledged that entry. Both are idempotent, so a command the client resends after a lost reply (a Redis failover,
a dropped connection) counts nothing twice, and the gauge is exact, SCARD. `create_session` answers `Overloaded`
(429 + Retry-After) while it is ≥ `max_pending`; existing sessions go on.

The staleness budget's count (`StartedSamples`): `rg:{budget}:started` counts the sessions started, and one script
admits a new session (or a group's n) only while the count, with it, stays within (version + max_staleness + 1) ×
the batch size the trainer's consumers publish in `rg:{budget}:batch` (their sum), counting it in the same step:
processes sharing one Redis never admit past the budget together. The policy (hold or refuse, the cut of stale
turns) is `gateway.weights.budget`'s.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from redis.asyncio.client import Pipeline

from gateway.background import background
from gateway.errors import Overloaded, StoreError
from gateway.store.core import StoreCore
from gateway.store.keys import call, text

__all__ = ["Admitted", "Backpressure", "StartedSamples"]

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


# KEYS: started, batch. ARGV: samples, version, max_staleness. Answers {admitted (1/0), started, limit}: limit 0
# while no consumer published a batch size (the budget is off: counted and admitted all the same).
_ADMIT = """
local batch = 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do batch = batch + (tonumber(size) or 0) end
local n = tonumber(ARGV[1])
if batch <= 0 then return {1, redis.call('INCRBY', KEYS[1], n), 0} end
local limit = (tonumber(ARGV[2]) + tonumber(ARGV[3]) + 1) * batch
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
if started + n > limit then return {0, started, limit} end
return {1, redis.call('INCRBY', KEYS[1], n), limit}
"""


@dataclass(frozen=True, slots=True)
class Admitted:
    """One admission's answer: whether it was admitted (and counted), the sessions started then, and the budget's
    limit (None: no consumer published a batch size, the budget is off)."""

    admitted: bool
    started: int
    limit: int | None


class StartedSamples:
    """`rg:{budget}:started` and `rg:{budget}:batch` (see the module docstring)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self._admit = core.client.register_script(_ADMIT)
        self.counting = False  # sessions are counted (a budget admits them): only then is anything given back
        self._later = 0  # sessions counted by `count_later`, not yet written
        self._writer: asyncio.Task[None] | None = None  # writes them, one INCRBY for all that came meanwhile

    async def admit(self, samples: int, version: int, max_staleness: int) -> Admitted:
        """Count `samples` new sessions as started if the budget has room for them all (or is off)."""
        keys = self._core.keys
        script = self._admit(keys=[keys.budget_started, keys.budget_batch], args=[samples, version, max_staleness])
        admitted, started, limit = await call(script, "admit by the staleness budget")
        return Admitted(bool(int(admitted)), int(started), int(limit) or None)

    def count_later(self, samples: int) -> None:
        """Count `samples` new sessions without waiting (the budget is off: no limit to compare with), in one INCRBY
        with the others counted meanwhile, in the background. A write Redis refuses is logged, not retried."""
        self._later += samples
        if self._writer is None:
            self._writer = background(self._write_later(), "staleness-budget-count")

    async def _write_later(self) -> None:
        try:
            while self._later:
                samples, self._later = self._later, 0
                try:
                    await call(self._core.client.incrby(self._core.keys.budget_started, samples), "count sessions")
                except StoreError as exc:
                    logger.warning("staleness budget: %d sessions not counted (%s)", samples, exc)
        finally:
            self._writer = None

    async def batch_size(self) -> int:
        """The sum of the batch sizes the trainer's consumers published (0: none, the budget is off)."""
        sizes = await call(self._core.client.hvals(self._core.keys.budget_batch), "read the trainer's batch size")
        return sum(int(size) for size in map(text, sizes) if size.isdigit())

    async def give_back(self, samples: int, why: str) -> None:
        """Take `samples` sessions that will never reach the trainer (abandoned, dropped as stale) off the count, so
        that the trainer is not left waiting for samples the budget will not admit. Never raising (logged)."""
        if not self.counting:
            return
        try:
            await call(self._core.client.decrby(self._core.keys.budget_started, samples), "give back budget")
        except StoreError as exc:
            logger.warning("staleness budget: %d %s sessions not given back (%s)", samples, why, exc)
