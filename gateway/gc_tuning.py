"""Garbage-collector settings for a long-running gateway process.

CPython's cyclic collector runs a young-generation pass every 700 net container allocations, and every tenth
of those an older pass that walks everything tracked. A gateway allocates small containers per streamed event
(parsed JSON, deltas, SSE payloads) while holding a large, static heap (FastAPI, pydantic schemas, the
tokenizer, pools): the collector then spends a noticeable share of the CPU re-walking objects that live
forever. After startup, `tune_gc` moves everything alive into the permanent generation (`gc.freeze`, which
the collector never walks) and makes young passes rarer. Reference counting still frees acyclic garbage at
once; cycles are still collected, just in larger batches.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
"""Net container allocations between two young-generation passes (CPython's default is 700)."""


def tune_gc(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Freeze the startup heap and space out collections; call once the process has finished starting."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
