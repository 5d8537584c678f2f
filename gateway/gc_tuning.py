"""Garbage-collector settings for a long-running gateway process, and its heap handed back to the system.

CPython's cyclic collector runs a young-generation pass every 700 net container allocations, and every tenth
of those an older pass that walks everything tracked. A gateway allocates small containers per streamed event
(parsed JSON, deltas, SSE payloads) while holding a large, static heap (FastAPI, pydantic schemas, the
tokenizer, pools): the collector then spends a noticeable share of the CPU re-walking objects that live
forever. After startup, `tune_gc` moves everything alive into the permanent generation (`gc.freeze`, which
the collector never walks) and makes young passes rarer. Reference counting still frees acyclic garbage at
once; cycles are still collected, just in larger batches. `trim_heap` returns the pages a burst of dropped
buffers freed (slow clients cut, `gateway.api.client_writer`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

YOUNG_THRESHOLD = 50_000
"""Net container allocations between two young-generation passes (CPython's default is 700)."""


def tune_gc(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Freeze the startup heap and space out collections; call once the process has finished starting."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; nothing elsewhere). Python's objects
    larger than its own small-object pools (a streamed answer's chunks) come from `malloc`, which returns the memory
    they freed only from the top of its heap: after a burst of them is dropped, the process keeps its peak size."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # no C library found, or not glibc
        return None
    return trim
