"""One engine replica as the gateway sees it: its engine server (`Engine`: health, weights) and the routing targets
it is (`Replica`: the engine, or each of its data-parallel ranks), the last read of a target's load (`EngineLoad`),
and a request in flight on one (`InFlight`)."""

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
    """One read of a target's engine load (`gateway.routing.load.LoadPoller`; its rank's, for a rank): its requests
    running and waiting, the share of its KV cache in use (None: not reported), and this process's in-flight count at
    the read."""

    requests: int
    kv_usage: float | None
    in_flight: int


def rank_id(replica_id: str, rank: int) -> str:
    """The routing target id of data-parallel rank `rank` of replica `replica_id`: `<id>@dp<rank>`."""
    return f"{replica_id}@dp{rank}"


@dataclass(eq=False)
class Engine:
    """One engine server (a configured replica): what it has once whatever its data-parallel ranks. Its backend
    (health, weight version, pause, load, flush: one call each for the whole engine), its health, draining, weight
    version and stale mark, and its routing targets (`targets`): one `Replica`, or one per rank, each pinning its
    requests to that rank.

    Its weight version and stale mark are read-only here: the pool owns them (`ReplicaPool.set_version`,
    `ReplicaPool.mark_stale`), so that one place decides when an engine may serve under which weights."""

    backend: EngineBackend
    healthy: bool = True
    draining: bool = False  # finishing in-flight work before a cache flush; takes no new requests
    failed_probes: int = 0  # health probes failed in a row
    id: str = field(init=False)
    targets: tuple[Replica, ...] = field(init=False, repr=False)
    # Written by the pool alone (see the class docstring).
    _version: int | None = field(default=None, init=False, repr=False)
    _stale: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.id = self.backend.id
        size = self.backend.data_parallel_size
        if size == 1:
            self.targets = (Replica(self),)
        else:
            self.targets = tuple(Replica(self, rank) for rank in range(size))

    @property
    def version(self) -> int | None:
        """The weight version the engine is known to run (None: it could not be read when it joined)."""
        return self._version

    @property
    def stale(self) -> bool:
        """Held out after a failed weight update or a restart on other weights: serves nothing until it is loaded
        with the pool's version."""
        return self._stale

    @property
    def in_flight(self) -> int:
        """This process's requests in flight on any of its targets."""
        return sum(target.in_flight for target in self.targets)


@dataclass(eq=False)
class Replica:
    """A routing target: an engine (`engine`) as a whole, or one of its data-parallel ranks (`rank`), whose requests
    all go to that rank. Placement, load, circuit breaking and the requests in flight are per target; health, weights
    and draining are the engine's (read here through it)."""

    engine: Engine
    rank: int | None = None  # the data-parallel rank its requests are pinned to; None: the engine's own choice
    in_flight: int = 0
    tokens_total: int = 0  # tokens it generated that were handed to callers (the dashboard's tokens/s)
    progressed_at: float = 0.0  # monotonic time it last sent tokens for any request (first-token timeouts)
    consecutive_failures: int = 0
    circuit_open_until: float = 0.0
    # The last read of its engine's load; None where no policy reads it (`load` is then the in-flight count).
    engine_load: EngineLoad | None = field(default=None, repr=False)
    # Requests in flight that the pool interrupts when it takes the replica out (`ReplicaPool.lease`).
    requests: set[InFlight] = field(default_factory=set, repr=False)
    backend: EngineBackend = field(init=False, repr=False)  # the engine's, kept here: read at every request
    id: str = field(init=False)
    key: int = field(init=False)

    def __post_init__(self) -> None:
        self.backend = self.engine.backend
        self.id = self.engine.id if self.rank is None else rank_id(self.engine.id, self.rank)
        self.key = string_key(self.id)

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    @property
    def draining(self) -> bool:
        return self.engine.draining

    @property
    def version(self) -> int | None:
        """The weight version its engine is known to run (`Engine.version`)."""
        return self.engine.version

    @property
    def stale(self) -> bool:
        """Its engine is held out (`Engine.stale`)."""
        return self.engine.stale

    @property
    def load(self) -> int:
        """Requests on the target: what its engine (or rank) ran and queued at the last read (every gateway
        process's), plus the requests this process began since, less those it ended; this process's in-flight count
        where the engine's load is not read."""
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
        engine = self.engine
        return engine.healthy and not engine.stale and not engine.draining and now >= self.circuit_open_until
