"""One engine replica as the gateway sees it (`Replica`), and a request in flight on one (`InFlight`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from backends.base import EngineBackend
from common.hashing import string_key


class InFlight(Protocol):
    """A request in flight on a replica (`ReplicaPool.lease`) that can be told its replica was taken out."""

    def interrupt(self, reason: str) -> None: ...


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

    def serving(self, now: float) -> bool:
        return self.healthy and not self._stale and not self.draining and now >= self.circuit_open_until
