"""What a follower and a recovery see of their process's coordinator: a protocol, so that neither imports the
coordinator that makes them (the package has no import cycle)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from gateway.routing import ReplicaPool
from gateway.store import Commit, Serving, WeightsRecord
from gateway.weights.gate import ServingGate
from gateway.weights.sequence import UpdateSequence
from gateway.weights.state import StateMachine


class TransferTarget(Protocol):
    """The process's in-memory transfers, as far as the bus's events reach them (`Transfers`)."""

    def commit_asked(self, event: Commit) -> None: ...

    def serving_seen(self, event: Serving) -> None: ...


class Coordinator(Protocol):
    """The process's `WeightCoordinator`, as far as following and recovering use it."""

    pool: ReplicaPool
    machine: StateMachine
    gate: ServingGate
    sequence: UpdateSequence
    lock: asyncio.Lock
    version: int
    last_source: str | None
    update_timeout_s: float
    member_ttl_s: float
    heartbeat_s: float

    @property
    def transfers(self) -> TransferTarget: ...

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    def end(self) -> None: ...

    def adopt(self, event: Serving) -> None: ...

    def adopt_record(self, record: WeightsRecord | None) -> None: ...
