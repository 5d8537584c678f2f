"""One engine replica as the gateway sees it (`Replica`), the last read of its engine's load (`EngineLoad`), and a
request in flight on one (`InFlight`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from backends.base import EngineBackend
from common.hashing import string_key


class InFlight(Protocol):
    """A request in flight on a replica (`ReplicaPool.lease`) that can be told its replica was taken out."""

    def interrupt(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One read of a replica's engine load (`gateway.routing.load.LoadPoller`): its requests running and waiting, the
    share of its KV cache in use (None: not reported), and this process's in-flight count at the read."""

    requests: int
    kv_usage: float | None
    in_flight: int


@dataclass(eq=False)
class Replica:
    """One engine replica as the gateway sees it.

    Its weight version and stale mark are read-only here: the pool owns them (`ReplicaPool.set_version`,
    `ReplicaPool.mark_stale`), so that one place decides when a replica may serve under which weights."""

    backend: EngineBackend
    healthy: bool = True
    draining: bool = False  # finishing in-flight work before a cache flush; takes no new requests
    in_flight: int = 0
    tokens_total: int = 0  # tokens it generated that were handed to callers (the dashboard's tokens/s)
    progressed_at: float = 0.0  # monotonic time it last sent tokens for any request (first-token timeouts)
    consecutive_failures: int = 0
    failed_probes: int = 0  # health probes failed in a row
    circuit_open_until: float = 0.0
    # The last read of its engine's load; None where no policy reads it (`load` is then the in-flight count).
    engine_load: EngineLoad | None = field(default=None, repr=False)
    # Requests in flight that the pool interrupts when it takes the replica out (`ReplicaPool.lease`).
    requests: set[InFlight] = field(default_factory=set, repr=False)
    id: str = field(init=False)  # the backend's, kept here: read several times a request
    key: int = field(init=False)
    # Written by the pool alone (see the class docstring).
    _version: int | None = field(default=None, init=False, repr=False)
    _stale: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.id = self.backend.id
        self.key = string_key(self.backend.id)

    @property
    def version(self) -> int | None:
        """The weight version the replica is known to run (None: it could not be read when it joined)."""
        return self._version

    @property
    def stale(self) -> bool:
        """Held out after a failed weight update or a restart on other weights: serves nothing until it is loaded
        with the pool's version."""
        return self._stale

    @property
    def load(self) -> int:
        """Requests on the replica: what its engine ran and queued at the last read (every gateway process's), plus
        the requests this process began since, less those it ended; this process's in-flight count where the
        engine's load is not read."""
        read = self.engine_load
        if read is None:
            return self.in_flight
        return max(0, read.requests + self.in_flight - read.in_flight)

    @property
    def kv_usage(self) -> float | None:
        """The share of its KV cache in use at the last read (None: not read, or not reported)."""
        read = self.engine_load
        return None if read is None else read.kv_usage

    def serving(self, now: float) -> bool:
        return self.healthy and not self._stale and not self.draining and now >= self.circuit_open_until
