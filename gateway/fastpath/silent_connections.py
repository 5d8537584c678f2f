"""The connections of one server that have sent nothing since they connected, and the sweep that closes those
silent for `server.silent_timeout_near_cap_s` near the connection cap (`gateway.fastpath.server_protocol`).

A connection is judged only after the event loop has read its socket at least once. Under load one pass of the
loop can outlast the timeout: a request that arrived with its connection then sits unread while the pass runs, and
judged by the clock alone the connection would look silent. So no connection is closed for silence as another one
connects (that runs early in a pass, before the pass's reads); sweeps run from a timer, at most one per pass (one
timer pending at a time), and a connection is judged only from the second sweep after it came: the first may run
in the very pass that registered its socket for reading, the second runs in a later pass, whose reads came first.
A sweep is asked for by a connection made near the cap or one cut there; there is no clock of its own.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Protocol

__all__ = ["Droppable", "SilentConnections"]


class Droppable(Protocol):
    """A connection the sweep can close without a word."""

    def drop(self) -> None: ...


class SilentConnections:
    """One server's silent connections, oldest first, each with when it came (loop time) and the sweeps run by
    then; `sweep_soon` closes those silent for `timeout_s` (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: OrderedDict[Droppable, tuple[float, int]] = OrderedDict()
        self._sweeps = 0
        self._pending: asyncio.TimerHandle | None = None

    def add(self, connection: Droppable, now: float) -> None:
        self._since[connection] = (now, self._sweeps)

    def discard(self, connection: Droppable) -> None:
        """It spoke, or it is gone."""
        self._since.pop(connection, None)

    def sweep_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep in the next pass of the loop (once, however many ask; the caller is near the cap now), and again in
        the pass after while a connection silent long enough may be unread yet."""
        if self._pending is None:
            self._pending = loop.call_at(loop.time(), self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pending = None
        self._sweeps += 1
        connected_by, judged_by = loop.time() - self.timeout_s, self._sweeps - 2
        while self._since:
            oldest, (since, sweeps) = next(iter(self._since.items()))
            if since > connected_by:  # the oldest is not due yet: the next connection, or cut, sweeps again
                return
            if sweeps > judged_by:  # due, but its socket may be unread yet: again in the next pass
                self._pending = loop.call_at(loop.time(), self._sweep, loop)
                return
            del self._since[oldest]
            oldest.drop()
