"""What the routers see of the running gateway: a protocol, so that the HTTP layer sits below the composition root
(`gateway.services.Services`, made by the app's lifespan, is the one implementation) and imports none of it."""

from __future__ import annotations

from typing import Protocol

from gateway.api.client_writer import StreamBuffers
from gateway.config import ReplicaConfig, Settings
from gateway.config.pools import PoolRole
from gateway.dashboard.sampler import DashboardSampler
from gateway.generation import Generator
from gateway.metrics import GatewayMetrics
from gateway.routing import Engine, ReplicaPool
from gateway.session.quotas import SessionQuota
from gateway.session.response_records import ResponseCache
from gateway.store import OpenSessions, TrajectoryStore
from gateway.teacher import TeacherScoring
from gateway.tokenization import VocabInfo
from gateway.turns.runner import TurnRunner
from gateway.weights import WeightCoordinator


class ApiServices(Protocol):
    """The gateway's long-lived parts a route uses, read-only, and the two replica changes the admin routes make."""

    @property
    def settings(self) -> Settings: ...

    @property
    def pool(self) -> ReplicaPool: ...

    @property
    def weights(self) -> WeightCoordinator: ...

    @property
    def generator(self) -> Generator: ...

    @property
    def turns(self) -> TurnRunner: ...

    @property
    def store(self) -> TrajectoryStore: ...

    @property
    def vocab(self) -> VocabInfo: ...

    @property
    def redis_url(self) -> str: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def quota(self) -> SessionQuota: ...

    @property
    def open_sessions(self) -> OpenSessions | None: ...

    @property
    def dashboard(self) -> DashboardSampler | None: ...

    @property
    def role(self) -> PoolRole: ...

    @property
    def scoring(self) -> TeacherScoring | None: ...

    def for_model(self, model: str | None, key: str | None = None) -> ApiServices:
        """The pool serving `model` for the API key id `key` (None: an admin's request)."""
        ...

    def served_models(self) -> list[str]:
        """Every pool's model, in the configuration's order."""
        ...

    def agent_models(self) -> list[str]:
        """The models agents may call (the policy pools'), in the configuration's order."""
        ...

    @property
    def response_cache(self) -> ResponseCache: ...

    @property
    def stream_buffers(self) -> StreamBuffers:
        """What streamed answers hold for their clients in this process (`server.stream_buffer_budget_bytes`)."""
        ...

    async def add_replica(self, config: ReplicaConfig) -> Engine:
        """Admit a replica at run time; it serves only once it runs the current weight version."""
        ...

    async def remove_replica(self, replica_id: str) -> Engine: ...
