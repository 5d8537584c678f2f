"""Token-id lists checked against the vocabulary, at C speed for the long prompts of RL turns.

pydantic checks a per-item constraint such as `ge=0` id by id, and Python's `max` walks the list again: for a prompt
of thousands of ids (an RL turn) that was the largest cost of a `/generate` request (docs/benchmarks.md). The
request models therefore parse token ids as plain integers (`TokenId`, whose schema still says `minimum: 0`), and
the route checks the whole list at once: a short one with Python's `min` and `max`, a long one copied into an int64
buffer (one C pass) whose bounds numpy reads in place.
"""

from __future__ import annotations

import array
from typing import Annotated

import numpy as np
from pydantic import WithJsonSchema

__all__ = ["TokenId", "first_outside"]

TokenId = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0})]
"""A token id as request models parse it: any integer (the route checks the range with `first_outside`)."""

_BUFFER_FROM = 256
"""Lists this long or longer are checked in an int64 buffer (shorter ones: numpy's per-call cost is more)."""


def first_outside(ids: list[int], vocab_size: int) -> int | None:
    """The index of the first id outside `[0, vocab_size)`, or None when every id is inside (or `ids` is empty)."""
    if not ids:
        return None
    if len(ids) < _BUFFER_FROM:
        inside = min(ids) >= 0 and max(ids) < vocab_size
    else:
        try:
            values = np.frombuffer(array.array("q", ids), dtype=np.int64)
        except OverflowError:  # an id beyond 64 bits: outside, found below
            inside = False
        else:
            inside = bool(values.min() >= 0 and values.max() < vocab_size)
    if inside:
        return None
    return next(i for i, token in enumerate(ids) if not 0 <= token < vocab_size)
