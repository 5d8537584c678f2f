"""The running event loop, found without a system call (`running_loop`), and one object per running loop and key
(`loop_local`): the helpers that run one timer for many requests (the late disconnect watches, the idle keep-alive
sweep) keep theirs there, so that each event loop (a server, a test) has its own."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["loop_local", "running_loop"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

if sys.version_info >= (3, 12):
    running_loop = asyncio.get_running_loop
else:

    class _ThreadsLoop(threading.local):
        loop: asyncio.AbstractEventLoop | None = None

    _cached = _ThreadsLoop()

    def running_loop() -> asyncio.AbstractEventLoop:
        """`asyncio.get_running_loop()`, without the `getpid()` system call that Python 3.11's makes on every call
        (to tell a forked child's inherited loop from its own; 3.12 dropped it): this thread's loop found last is
        returned again while it runs. A loop runs in one thread at a time and a thread runs one loop at a time, so a
        running loop found by this thread is the one it runs in, unless that loop stopped here and runs on in
        another thread while this one runs a new loop (never, in the gateway: each server's loop lives in one
        thread). After a fork, the child looks the loop up again."""
        loop = _cached.loop
        if loop is None or not loop.is_running():
            loop = _cached.loop = asyncio.get_running_loop()
        return loop

    def _forget_loops() -> None:
        global _cached
        _cached = _ThreadsLoop()

    os.register_at_fork(after_in_child=_forget_loops)

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
_last: tuple[asyncio.AbstractEventLoop | None, dict[Hashable, Any]] = (None, {})


def loop_local(make: Callable[[K], T], arg: K, loop: asyncio.AbstractEventLoop | None = None) -> T:
    """The running loop's `make(arg)`, made at the first call for this loop, `make` and `arg`. The last loop's
    objects are kept at hand (a server runs one loop): a call costs no weak-reference lookup. `loop`: the running
    loop, where the caller has it at hand already."""
    global _last
    if loop is None:
        loop = running_loop()
    if _last[0] is not loop:
        _last = (loop, _by_loop.setdefault(loop, {}))
    objects = _last[1]
    key = (make, arg)
    found: T | None = objects.get(key)  # typed here, not by `cast` (a function call per request, at run time)
    if found is None:
        found = objects[key] = make(arg)
    return found
