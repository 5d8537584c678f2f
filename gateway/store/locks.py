"""`SessionLocks`: this process's per-session locks, in one map (one per process, owned by the `TrajectoryStore`
and shared with the session lifecycle, `gateway.session.lifecycle`).

A session has two locks of different reach, always taken in this order (a writer never waits for a turn):

- `turn`: its turns run one at a time; a turn holds it from loading the session until its samples are saved.
- `writes`: its sample writes reach Redis one at a time, direct and flushed from the write buffer alike
  (`gateway.store.buffer`), so an older version of a sample never lands after a newer one; held for one write.

One lock cannot do both: the buffer's flusher writes outside every turn and must not wait for one (a generation
takes seconds to minutes, and the flusher writes the sessions in order), and a one-turn session's turn finishes
it, flushing its writes, while it holds its `turn` lock. A lock lives while someone holds or awaits it.
"""

from __future__ import annotations

import asyncio
import weakref

__all__ = ["SessionLocks"]

_TURN, _WRITES = 0, 1


class SessionLocks:
    """The `turn` and `writes` locks of each session (see the module docstring)."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        # Weak values: a lock lives only while someone holds or awaits it (they keep the reference).
        self._locks: weakref.WeakValueDictionary[tuple[int, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def turn(self, session_id: str) -> asyncio.Lock:
        """The session's turns run one at a time in this process (a turn keeps the lock until it is recorded)."""
        return self._lock((_TURN, session_id))

    def writes(self, session_id: str) -> asyncio.Lock:
        """The session's sample writes, direct and flushed, reach Redis one at a time."""
        return self._lock((_WRITES, session_id))

    def _lock(self, key: tuple[int, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock
