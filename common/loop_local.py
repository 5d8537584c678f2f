"""One object per running loop and key (`loop_local`): the helpers that run one timer for many requests (the late
disconnect watches, the idle keep-alive sweep) keep theirs there, so that each event loop (a server, a test) has its
own."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["loop_local"]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
_last: tuple[asyncio.AbstractEventLoop | None, dict[Hashable, Any]] = (None, {})


def loop_local(make: Callable[[K], T], arg: K, loop: asyncio.AbstractEventLoop | None = None) -> T:
    """The running loop's `make(arg)`, made at the first call for this loop, `make` and `arg`. The last loop's
    objects are kept at hand (a server runs one loop): a call costs no weak-reference lookup. `loop`: the running
    loop, where the caller has it at hand already."""
    global _last
    if loop is None:
        loop = asyncio.get_running_loop()
    last = _last  # read once: another thread's loop may replace it meanwhile
    if last[0] is not loop:
        last = _last = (loop, _by_loop.setdefault(loop, {}))
    objects = last[1]
    key = (make, arg)
    found: T | None = objects.get(key)  # typed here, not by `cast` (a function call per request, at run time)
    if found is None:
        found = objects[key] = make(arg)
    return found
