"""Request ids that are unique without a system call per request.

`secrets.token_hex(16)` reads the kernel's random source on every call: a system call per id, on every short
request. An id here is a random prefix drawn once per process (again in a forked worker) and a counter: unique
across the gateway's processes and their restarts as long as 64 random bits do not collide, and as long as
`token_hex(16)`'s (32 hex digits). They are names, not secrets: nothing is granted to whoever knows one (session
ids that may stand for a session are drawn with `secrets`).
"""

from __future__ import annotations

import itertools
import os
import secrets

__all__ = ["new_name", "new_request_id"]

_prefix = secrets.token_hex(8)
_counter = itertools.count()


def new_request_id(kind: str) -> str:
    """`kind-` and 32 hex digits, unique in this process and, with overwhelming odds, across processes."""
    return f"{kind}-{_prefix}{next(_counter):016x}"


def new_name() -> str:
    """32 hex digits, unique as `new_request_id`'s are: a name with no kind (a turn's writer id, a suffix)."""
    return f"{_prefix}{next(_counter):016x}"


def _reseed() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(8)
    _counter = itertools.count()


os.register_at_fork(after_in_child=_reseed)  # a forked worker must not repeat its parent's ids
