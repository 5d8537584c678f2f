"""Keep the cyclic garbage collector out of the burst of requests an update releases."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable


class GcDeferral:
    """Turns the cyclic GC off for the loop passes that hand the released requests to the engines, and back on
    after them.

    A cyclic collection inside those passes stalls every request behind it, and the burst of new objects triggers
    them: a full one walks every held stream's state on the heap. Collect once the requests are out instead:
    `gc.enable` is queued behind the waiters' wake-ups, then (one hop later) behind the write tasks they started.
    """

    def __init__(self) -> None:
        self._deferred = False

    def around(self, wake: Callable[[], None]) -> None:
        """Call `wake` (which wakes the held requests) with the GC off until the pass of the loop after the one that
        runs the wake-ups (where it is on: otherwise, just `wake`)."""
        if not gc.isenabled():
            wake()
            return
        gc.disable()
        self._deferred = True
        wake()
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self.end)  # queued behind the wake-ups `wake` scheduled

    def end(self) -> None:
        """Undo `defer` (once; at close too, should the loop stop before the callback runs)."""
        if self._deferred:
            self._deferred = False
            gc.enable()
