"""`ServingGate`: what generation waits on while an update (or an out-of-band pause) holds the replicas."""

from __future__ import annotations

import asyncio
import time

from gateway.weights.gc_deferral import GcDeferral


class ServingGate:
    """Open while requests may dispatch. Closed by an update, a pause, or another process's update being followed;
    opening it releases every held request at once."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._gc = GcDeferral()
        # Monotonic time waiters were last released (an update, a resume or a followed update ended): the origin
        # of each continuation's dispatch latency.
        self.released_at = 0.0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def release(self) -> None:
        """Let the held requests go. Each one wakes in the next pass of the event loop and hands its continuation
        to the engine's HTTP client before it first suspends (a pooled connection is at hand); the client writes
        it from a task of its own, in the pass after. So the burst is two passes of the loop, whatever its size,
        with the cyclic GC off for them (`GcDeferral`)."""
        self.released_at = time.monotonic()
        self._gc.around(self._open.set)

    def reopen(self) -> None:
        """Open again after a pause that failed before any request was held long: no release burst to shield."""
        self._open.set()

    async def wait(self, timeout: float | None = None) -> None:
        """Return once open (at once in the common case)."""
        if self._open.is_set():
            return
        # Not `wait_for`, which wraps each waiter in a task of its own: with 1,000 requests held, that is 1,000
        # more tasks to create, and two more loop passes before each one runs after the release.
        async with asyncio.timeout(timeout):
            await self._open.wait()

    def aclose(self) -> None:
        self._gc.end()
