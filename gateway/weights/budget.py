"""The staleness budget (docs/architecture.md §5, AReaL's rule): the gateway starts no more samples than the trainer
can take while they are fresh, and cuts what fell behind anyway.

- Admission: a new session (a GRPO group's n together) is admitted while the sessions started so far, with it, are
  ≤ (version + `max_staleness` + 1) × the batch size the trainer's consumers publish (`StartedSamples`, one script
  on Redis shared by every gateway process). Beyond it the session waits for the trainer's next version
  (`over_budget: hold`, at most `hold_timeout_s`) or is refused at once (`refuse`); a refusal is a 429 with
  Retry-After, the shape of backpressure's.
- The cut: a completion broken off (a weight update) whose sample's first token is older than version −
  `max_staleness` is not resumed (`Generator`, finish reason "stale"); one that a `keep` update let run on is ended
  once the new version serves (`cut_on_updates`, `Generator.cut_behind`); a later turn that would extend such a
  sample is a 410 `sample_stale` (`SessionLifecycle.check_fresh`). Every way, the sample is kept, marked `stale`.

Until a consumer has published its batch size the budget is off (sessions are still counted), said once in the log.
While it is known to be off (read at most `OFF_RECHECK_S` ago, under the current version) a new session is counted
without being waited for (`StartedSamples.count_later`): no round trip to Redis on its way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from gateway.config.weights import OverBudget
from gateway.errors import Overloaded, StoreError
from gateway.store.backpressure import Admitted, StartedSamples

__all__ = ["BudgetCounts", "StalenessBudget", "VersionSource"]

logger = logging.getLogger(__name__)

OFF_RECHECK_S = 1.0
"""How long the budget counts on having no published batch size before it asks Redis again."""

UPDATE_WAIT_S = 3600.0
"""How long `cut_on_updates` waits for a version change at a time (it waits again)."""


class VersionSource(Protocol):
    """The weight version this process knows, a wait for its next change, and one for the end of an update
    (`WeightCoordinator` is one)."""

    @property
    def version(self) -> int: ...

    async def version_after(self, version: int, timeout: float) -> int: ...

    async def until_serving(self, timeout: float | None = None) -> None: ...


class BudgetCounts:
    """What the budget did in this process (metrics read them at scrape time)."""

    __slots__ = ("admitted", "cut", "held", "refused")

    def __init__(self) -> None:
        self.admitted = 0  # new sessions admitted (a group's n count n), whether the budget was on or off
        self.held = 0  # new sessions that had to wait for the trainer (admitted later or refused)
        self.refused = 0  # new sessions refused with 429 (at once, or after waiting hold_timeout_s)
        self.cut = 0  # turns cut for staleness: resumes not made, and later turns refused with 410


class StalenessBudget:
    """Admits new sessions by the budget and tells generation how old a sample's first token may be (module doc)."""

    def __init__(
        self,
        started: StartedSamples,
        weights: VersionSource,
        *,
        max_staleness: int,
        over_budget: OverBudget = "hold",
        hold_timeout_s: float = 30.0,
        retry_after_s: float = 5.0,
    ) -> None:
        self.started = started
        self.weights = weights
        self.max_staleness = max_staleness
        self.over_budget = over_budget
        self.hold_timeout_s = hold_timeout_s
        self.retry_after_s = retry_after_s
        self.counts = BudgetCounts()
        self.limit: int | None = None  # the budget's limit at the last admission (None: off)
        self._on: bool | None = None  # whether a consumer's batch size was found, as last read (None: not yet)
        self._read_at_version: int | None = None  # the version `_on` was last read under
        self._read_at = 0.0  # when (monotonic)

    async def admit(self, samples: int) -> None:
        """Count `samples` new sessions as started once the budget has room for them; `Overloaded` (429) where
        it has none now (`refuse`) or got none within `hold_timeout_s` (`hold`)."""
        if self._known_off():
            self.started.count_later(samples)
            self.counts.admitted += samples
            return
        try:
            answer = await self._try(samples)
        except StoreError as exc:
            # Redis away (a restart, a failover): the sessions are made once it is back (the store retries), so they
            # are admitted and counted then; the budget may let a few more in than its limit meanwhile.
            logger.warning("staleness budget: Redis did not answer (%s): %d sessions admitted unchecked", exc, samples)
            self.started.count_later(samples)
            self.counts.admitted += samples
            return
        if answer.admitted:
            return
        self.counts.held += samples if self.over_budget == "hold" else 0
        deadline = time.monotonic() + self.hold_timeout_s
        while self.over_budget == "hold" and (left := deadline - time.monotonic()) > 0:
            # Room comes with the trainer's next version (its ack of a batch, then the admin update publishing it).
            await self.weights.version_after(self.weights.version, left)
            answer = await self._try(samples)
            if answer.admitted:
                return
        self.counts.refused += samples
        waited = f" after waiting {self.hold_timeout_s:g} s" if self.over_budget == "hold" else ""
        raise Overloaded(
            f"staleness budget spent{waited}: {answer.started} sessions started, the trainer takes "
            f"{answer.limit} by version {self.weights.version} + weights.max_staleness {self.max_staleness} + 1; "
            "new sessions wait for its next version",
            retry_after_s=self.retry_after_s,
            code="staleness_budget",
        )

    async def _try(self, samples: int) -> Admitted:
        version = self.weights.version
        answer = await self.started.admit(samples, version, self.max_staleness)
        self.limit = answer.limit
        self._turned(answer.limit is not None, version)
        if answer.admitted:
            self.counts.admitted += samples
        return answer

    async def stale_before(self) -> int | None:
        """The oldest version a sample's first token may have now; None while the budget is off. Whether it is on is
        read from Redis once per version (an admission reads it too). Where Redis does not answer (a restart, a
        failover) it is as last read (off where never read), and read again at the next call: a completion in
        flight is not failed for it."""
        version = self.weights.version
        if self._read_at_version != version:
            try:
                on = await self.started.batch_size() > 0
            except StoreError as exc:
                logger.warning("staleness budget: whether it is on not read (%s); as last read: %s", exc, self._on)
            else:
                self._turned(on, version)
        return version - self.max_staleness if self._on else None

    def count_cut(self) -> None:
        self.counts.cut += 1

    async def cut_on_updates(self, cut_behind: Callable[[int], int]) -> None:
        """Run for the gateway's life: once each new weight version serves, `cut_behind(oldest)` ends the completions
        in flight whose sample fell behind the budget (`Generator.cut_behind`): those a `keep` update let run on.
        Nothing while the budget is off."""
        version = self.weights.version
        while True:
            moved = await self.weights.version_after(version, UPDATE_WAIT_S)
            if moved == version:
                continue
            version = moved
            await self.weights.until_serving()  # the engines run again: an abort now ends a request that runs
            oldest = await self.stale_before()
            if oldest is not None and (cut := cut_behind(oldest)):
                logger.info("staleness budget: %d completions in flight cut at version %d", cut, version)

    def _known_off(self) -> bool:
        """Whether no consumer had published a batch size when last read, under this version, lately."""
        return (
            self._on is False
            and self._read_at_version == self.weights.version
            and time.monotonic() - self._read_at < OFF_RECHECK_S
        )

    def _turned(self, on: bool, version: int) -> None:
        """Record whether the budget is on; say so in the log when that changes."""
        self._read_at_version = version
        self._read_at = time.monotonic()
        if on == self._on:
            return
        if on:
            logger.info("staleness budget on: a trainer consumer published its batch size in Redis")
        else:
            logger.info(
                "staleness budget off: no trainer consumer has published its batch size in Redis (sessions are "
                "counted, none is held)"
            )
        self._on = on
