"""The client connection cap: how many connections one gateway process takes, and the limits' values.

The limits themselves (431 past `server.max_header_bytes`, 408 past `server.header_timeout_s` or a body slower than
`server.body_timeout_s` and `server.min_body_rate_bytes_s` allow, silent connections closed after
`server.silent_timeout_near_cap_s` near the cap, the longest-idle connection closed past `server.max_connections`)
are enforced where bytes arrive, in the fast path's server protocol (`gateway.fastpath.server_protocol`); with it
off, uvicorn's `limit_concurrency` holds the cap alone.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

__all__ = [
    "MIN_DERIVED_CONNECTIONS",
    "NEAR_CAP_SHARE",
    "RESERVED_FDS",
    "ConnectionLimits",
    "derived_max_connections",
]

RESERVED_FDS = 64
"""File descriptors kept out of the derived connection cap: listeners, log files, the tokenizer's files, pipes."""

MIN_DERIVED_CONNECTIONS = 16


NEAR_CAP_SHARE = 0.5
"""The share of the connection cap open from which a connection that has sent nothing gets only
`silent_timeout_near_cap_s`."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    max_connections: int
    body_timeout_s: float
    min_body_rate_bytes_s: int
    silent_timeout_near_cap_s: float

    @property
    def near_cap(self) -> int:
        """How many open connections count as near the cap."""
        return max(1, int(self.max_connections * NEAR_CAP_SHARE))


def derived_max_connections(redis_connections: int, open_files: int | None = None) -> int:
    """The connection cap for an open-file limit (default: this process's soft RLIMIT_NOFILE): half of what is
    left after the Redis pool and `RESERVED_FDS`, since a connection with a request in flight also holds one to
    a replica; at least `MIN_DERIVED_CONNECTIONS`."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if open_files == resource.RLIM_INFINITY:
            open_files = 1 << 20
    return max(MIN_DERIVED_CONNECTIONS, (open_files - redis_connections - RESERVED_FDS) // 2)
