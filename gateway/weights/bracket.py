"""The out-of-band weight sync (`POST /admin/pause` … `POST /admin/resume`) as an object the coordinator holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.background import background, stop
from gateway.weights.report import UpdateReport


@dataclass(eq=False)
class OutOfBandSync:
    """A held out-of-band sync: every replica paused (the coordinator `PAUSED`), the update lock on the bus held
    (`token`), the trainer writing weights into the engines. `WeightCoordinator.resume` closes it; past `deadline`
    (monotonic) the coordinator ends it as a failed update instead.

    Nothing is locked across the two HTTP requests: the coordinator's `PAUSED` state is what turns other updates
    away (409) meanwhile."""

    token: str | None  # the bus lock's (None: no bus)
    report: UpdateReport
    started: float  # monotonic, when the pause was asked for
    paused_at: float  # monotonic, when every replica was paused
    deadline: float  # monotonic
    _timer: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def timeout_s(self) -> float:
        return self.deadline - self.started

    def arm(self, on_deadline: Callable[[OutOfBandSync], Awaitable[None]]) -> None:
        """Call `on_deadline` with this sync at its deadline (unless `disarm`ed first)."""

        async def expire() -> None:
            await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))  # a deadline, not synchronisation
            await on_deadline(self)

        self._timer = background(expire(), "weights-pause-deadline")  # hard reference; a crash is logged

    def disarm(self) -> None:
        """The sync ended before its deadline: the timer will not fire."""
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()

    async def aclose(self) -> None:
        await stop(self._timer)
