"""`SessionLocks`: one map of a process's per-session locks, a `turn` and a `writes` lock per session."""

from __future__ import annotations

import gc
import weakref

from gateway.store import SessionLocks


async def test_a_session_has_one_turn_lock_and_one_writes_lock_apart_from_it() -> None:
    locks = SessionLocks()
    turn, writes = locks.turn("s"), locks.writes("s")
    assert turn is locks.turn("s") and writes is locks.writes("s")
    assert turn is not writes and locks.turn("other") is not turn
    async with turn:  # a turn saves its samples while it holds its lock: the writes lock stays free
        async with writes:
            assert turn.locked() and writes.locked()


async def test_the_map_keeps_no_lock_alive() -> None:
    locks = SessionLocks()
    held = locks.turn("s")
    assert locks.turn("s") is held  # found again while someone holds it
    gone = weakref.ref(held)
    del held
    gc.collect()
    assert gone() is None  # nobody holds or awaits it: the map let it go
