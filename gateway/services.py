"""The gateway's long-lived parts, made and closed in one place (the app lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial

from redis.asyncio import Redis

from backends.base import EngineBackend, ReplicaSpec, StreamPacing, Timeouts
from backends.factory import LoraPolicy, create_backend
from backends.generation_transport import TransportFactory
from gateway import store
from gateway.api.client_writer import StreamBuffers
from gateway.background import background, stop
from gateway.config import FastPathConfig, ReplicaConfig, ServerConfig, Settings
from gateway.config.pools import PoolConfig, PoolRole, TeacherConfig
from gateway.dashboard.sampler import DashboardSampler
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import Conflict, Forbidden, InvalidRequest, NotFound
from gateway.fastpath.engine_client import KeepAlivePool
from gateway.fastpath.redis_batching import PipelineBatcher
from gateway.generation import GenerationSettings, Generator
from gateway.generation.stale_cut import cut_behind
from gateway.history import family_of, token_history_for
from gateway.metrics import GatewayMetrics
from gateway.parsers import resolve_reasoning_parser, resolve_tool_parser
from gateway.routing import Engine, LoadBound, ReplicaPool
from gateway.routing.discovery import Discovery, make_source
from gateway.routing.groups import GROUP_TTL_S
from gateway.session.lifecycle import SessionLifecycle
from gateway.session.quotas import SessionQuota
from gateway.session.response_records import ResponseCache
from gateway.session.samples import SessionManager
from gateway.store import Durability, Keys, OpenSessions, TrajectoryStore, WeightsBus
from gateway.teacher import ScoringQueue, TeacherPool, TeacherScoring
from gateway.tokenization import ChatTokenizer, VocabInfo
from gateway.turns.runner import TurnRunner
from gateway.weights import ReplicaAdmission, StalenessBudget, WeightCoordinator, reported_version

logger = logging.getLogger(__name__)

BackendFactory = Callable[[ReplicaConfig, Settings], EngineBackend]

#: At shutdown, how long turns cut by the server may take to record what they generated (one Redis write each).
SHUTDOWN_RECORD_TIMEOUT_S = 10.0


def generation_transport(fastpath: FastPathConfig) -> TransportFactory | None:
    """The transport replicas' generation requests take: the fast path's pool, or aiohttp's (None) with it off."""
    return KeepAlivePool if fastpath.on("engine_client") else None


def replica_spec(replica: ReplicaConfig, settings: Settings) -> ReplicaSpec:
    g = settings.generation
    return ReplicaSpec(
        id=replica.id,
        url=replica.url,
        model=settings.model.base_model or settings.model.name,  # a LoRA policy's engines serve its base model
        routed_experts=replica.routed_experts,
        routed_experts_shape=replica.routed_experts_shape,
        routed_experts_input=replica.routed_experts_input,
        scale_out=replica.scale_out,
        keep_mode=replica.keep_mode,
        new_requests_while_paused=replica.new_requests_while_paused,
        data_parallel_size=replica.data_parallel_size,
        weight_transfer=replica.weight_transfer,
        timeouts=Timeouts(
            connect=g.connect_timeout_s,
            read=g.read_timeout_s,
            write=g.write_timeout_s,
            pool=g.pool_timeout_s,
            control=settings.weights.control_timeout_s,
            health=settings.routing.health_timeout_s,
            whole_answer=max(g.read_timeout_s, g.request_timeout_s),
            keepalive=g.keepalive_expiry_s,
        ),
        max_connections=g.max_connections_per_replica,
        stream_pacing=StreamPacing(g.stream_pacing_s, g.stream_pacing_min_streams),
        generation_transport=generation_transport(settings.fastpath),
    )


def default_backend_factory(replica: ReplicaConfig, settings: Settings) -> EngineBackend:
    return create_backend(replica.backend, replica_spec(replica, settings), replica.dialect, lora_policy(settings))


def lora_policy(settings: Settings) -> LoraPolicy | None:
    """The LoRA policy a pool's replicas serve (`model.base_model`): the newest `weights.max_staleness` + 1 of its
    versions stay loaded (2 without a staleness budget), so a sample within the budget finishes under its own."""
    if settings.model.base_model is None:
        return None
    staleness = settings.weights.max_staleness
    return LoraPolicy(settings.model.name, 2 if staleness is None else staleness + 1)


@dataclass
class Services:
    """Everything a request handler may need."""

    settings: Settings
    pool: ReplicaPool
    weights: WeightCoordinator
    generator: Generator
    vocab: VocabInfo
    redis_url: str
    store: TrajectoryStore
    turns: TurnRunner
    backend_factory: BackendFactory = default_backend_factory
    replica_configs: dict[str, ReplicaConfig] = field(default_factory=dict)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    quota: SessionQuota = field(default_factory=lambda: SessionQuota(0))
    open_sessions: OpenSessions | None = None  # `server.max_open_sessions_per_key`, across processes
    dashboard: DashboardSampler | None = None
    response_cache: ResponseCache = field(default_factory=lambda: ResponseCache(0, 0.0))  # the Responses API's
    stream_buffers: StreamBuffers = field(
        default_factory=lambda: StreamBuffers(ServerConfig().stream_buffer_budget_bytes)
    )
    fleet: Fleet = field(default_factory=lambda: Fleet())  # every pool of this process, this one among them
    keys: frozenset[str] = frozenset()  # the key ids that may use this pool (`pools[i].keys`); empty: any key
    role: PoolRole = "policy"  # a teacher pool scores the samples of the policies that name it, serves no agent
    teacher: TeacherConfig | None = None  # a policy's teacher (`pools[i].teacher`)
    scoring: TeacherScoring | None = None  # its scorer, where it has a teacher
    admission: ReplicaAdmission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = ReplicaAdmission(self.pool, self.weights)
        if not self.fleet.pools:
            self.fleet.pools[self.settings.model.name] = self

    def served_models(self) -> list[str]:
        """Every pool's model, teachers too (the admin's view)."""
        return self.fleet.models()

    def agent_models(self) -> list[str]:
        """The models agents may call: the policy pools'."""
        return self.fleet.models("policy")

    def for_model(self, model: str | None, key: str | None = None) -> Services:
        """The pool serving `model` (None: the only pool; with several, a 400 asking for one), for the API key id
        `key` (None: an admin): 404 for a model no pool serves, 403 for a pool the key is not bound to."""
        services = self.fleet.serving(model)
        if key is not None and services.keys and key not in services.keys:
            raise Forbidden(f"this API key may not use the model `{services.settings.model.name}`", param="model")
        return services

    async def add_replica(self, config: ReplicaConfig) -> Engine:
        """Admit a replica at run time; it serves only once it runs the current weight version."""
        if self.pool.engine(config.id) is not None:
            raise Conflict(f"replica {config.id!r} is already in the pool", param="id")
        return await self._admit(config, self.backend_factory(config, self.settings))

    async def admit_discovered(self, config: ReplicaConfig) -> bool:
        """Admit a replica that discovery found, once it answers its health probe (False: not now; discovery tries
        again next round)."""
        backend = self.backend_factory(config, self.settings)
        if self.pool.engine(config.id) is not None or not await backend.health():
            await backend.aclose()
            return False
        await self._admit(config, backend)
        return True

    async def _admit(self, config: ReplicaConfig, backend: EngineBackend) -> Engine:
        replica = await self.admission.admit(backend)
        self.replica_configs[config.id] = config
        return replica

    async def remove_replica(self, replica_id: str) -> Engine:
        self.replica_configs.pop(replica_id, None)
        return await self.pool.remove(replica_id)

    async def remove_discovered(self, replica_id: str) -> None:
        """Remove a replica its discovery source no longer lists: its streams go on elsewhere, tokens kept."""
        if self.pool.engine(replica_id) is not None:
            await self.remove_replica(replica_id)

    def follow_discovery(self) -> Discovery | None:
        """Start following `replicas_from` (None when it is not set); the caller closes what this returns."""
        if self.settings.replicas_from is None:
            return None
        source = make_source(self.settings.replicas_from, self.settings.discovery)
        discovery = Discovery(
            source,
            self.settings.discovery.interval_s,
            admit=self.admit_discovered,
            remove=self.remove_discovered,
            is_known=lambda replica_id: self.pool.engine(replica_id) is not None,
        )
        discovery.start()
        return discovery


@dataclass
class Fleet:
    """The pools of one gateway process by model name, in the configuration's order (`pools:`)."""

    pools: dict[str, Services] = field(default_factory=dict)

    @property
    def default(self) -> Services:
        """The first pool: the app's own services (what takes no model: health, the dashboard)."""
        return next(iter(self.pools.values()))

    def models(self, role: PoolRole | None = None) -> list[str]:
        """The pools' models (`role`: of that role only)."""
        return [name for name, services in self.pools.items() if role is None or services.role == role]

    def serving(self, model: str | None) -> Services:
        if model is None:
            policies = self.models("policy")
            if len(policies) > 1:
                raise InvalidRequest(f"this gateway serves several models ({self._served()}): name one", param="model")
            return self.pools[policies[0]] if policies else self.default
        found = self.pools.get(model)
        if found is None:
            raise NotFound(f"The model `{model}` does not exist; this gateway serves {self._served()}", param="model")
        return found

    def _served(self) -> str:
        return ", ".join(f"`{name}`" for name in self.pools)


@contextlib.asynccontextmanager
async def open_services(
    settings: Settings, backend_factory: BackendFactory = default_backend_factory
) -> AsyncIterator[Services]:
    """Start everything the gateway needs and close it all on exit, in reverse order: one Redis client, and a
    `Services` per pool (`pools:`; the one model without), which share it. Yields the first pool's; the others are
    its `fleet`'s."""
    if (open_to_anyone := settings.server.open_to_anyone()) is not None:
        logger.warning(open_to_anyone)
    async with contextlib.AsyncExitStack() as stack:
        redis_url = settings.redis.url
        if not redis_url:
            embedded = EmbeddedRedis(data_dir=settings.redis.data_dir)
            await stack.enter_async_context(embedded)
            redis_url = embedded.local_url
        redis = store.connect(redis_url, settings.redis.socket_timeout_s, settings.redis.max_connections)
        stack.push_async_callback(redis.aclose)
        fleet = Fleet()
        for pool_settings, config in zip(settings.pool_settings(), settings.pools or (None,), strict=True):
            services = await stack.enter_async_context(_open_pool(pool_settings, redis, redis_url, backend_factory))
            services.fleet = fleet
            if config is not None:
                _take_pool_config(services, config)
            fleet.pools[pool_settings.model.name] = services
        for services in fleet.pools.values():
            if services.teacher is not None:  # once every pool, its teachers among them, is open
                services.scoring = _scoring(services, services.teacher, fleet, redis)
                services.store.hold_for_scores(services.scoring)
                services.metrics.bind_scoring(services.scoring)
                services.scoring.start()
                stack.push_async_callback(services.scoring.aclose)  # stopped before the pools
        yield fleet.default


def _scoring(policy: Services, config: TeacherConfig, fleet: Fleet, redis: Redis) -> TeacherScoring:
    """The scorer of a policy with a teacher (`config`): its queue under the policy's keys, its teacher pools."""
    teachers = {}
    for name in config.teachers():
        teacher = fleet.pools[name]
        model = teacher.settings.model
        adapter = model.name if model.base_model is not None else None
        teachers[name] = TeacherPool(name, teacher.pool, teacher.weights, adapter)
    queue = ScoringQueue(redis, policy.store.keys, config.deadline_s)
    return TeacherScoring(policy.store, queue, config, teachers)


def _take_pool_config(services: Services, config: PoolConfig) -> None:
    """What a pool's services take of its `pools:` entry: the key ids bound to it (empty: any key), its role and
    teacher."""
    services.keys, services.role, services.teacher = frozenset(config.keys), config.role, config.teacher


@contextlib.asynccontextmanager
async def _open_pool(
    settings: Settings, redis: Redis, redis_url: str, backend_factory: BackendFactory
) -> AsyncIterator[Services]:
    """Start one pool's parts on the shared Redis client and close them on exit, in reverse order."""
    async with contextlib.AsyncExitStack() as stack:
        fastpath = settings.fastpath
        bus = WeightsBus(
            redis,
            Keys(settings.store.prefix),
            origin=uuid.uuid4().hex,
            durability=Durability(redis, settings.redis.durable_replicas, settings.redis.wait_timeout_effective_ms),
            retry_budget_s=settings.redis.retry_budget_s,
        )
        stack.push_async_callback(bus.aclose)
        r = settings.routing
        pool = ReplicaPool(
            r.policy,
            balance_factor=r.balance_factor,
            failure_threshold=r.failure_threshold,
            circuit_open_s=r.circuit_open_s,
            health_interval_s=r.health_interval_s,
            group_placement=r.group_placement,
            bound=LoadBound(r.load_bound, r.kv_usage_limit),
            load_interval_s=r.load_interval_s,
            prefix_block_tokens=r.prefix_block_tokens,
            prefix_max_blocks=r.prefix_max_blocks,
        )
        stack.push_async_callback(pool.aclose)
        backends = [backend_factory(replica, settings) for replica in settings.replicas]
        versions = await asyncio.gather(*(reported_version(b) for b in backends))
        known = [v for v in versions if v is not None]
        current = max(known, default=0)
        for backend, version in zip(backends, versions, strict=True):
            replica = pool.add(backend, version=version, stale=version is not None and version != current)
            if replica.stale:
                logger.error(
                    "replica %s runs version %s, the pool runs %s: held out",
                    backend.id,
                    version,
                    current,
                    extra={"replica": backend.id, "version": version},
                )
        await pool.check_health()
        pool.start_health_checks()
        weights = WeightCoordinator(
            pool,
            initial_version=current,
            default_mode=settings.weights.pause_mode,
            update_timeout_s=settings.weights.update_timeout_s,
            transfer_commit_timeout_s=settings.weights.transfer_deadline_s,
            bus=bus,
            member_ttl_s=settings.weights.member_ttl_s,
            flush_caches=settings.weights.flushes_caches,
        )
        stack.push_async_callback(weights.aclose)
        await weights.start_following()
        g = settings.generation
        generator = Generator(
            pool,
            weights,
            settings=GenerationSettings(
                max_resumes=g.max_resumes,
                request_timeout_s=g.request_timeout_s,
                max_wait_s=g.max_wait_s,
                routed_experts=g.routed_experts,
                stall_timeout_s=g.stall_timeout_s,
                first_token_timeout_s=g.first_token_timeout_s,
                cache_salt=settings.weights.cache_salt,
                adapter=settings.model.name if settings.model.base_model is not None else None,
            ),
        )
        stack.push_async_callback(generator.aclose)
        vocab = await asyncio.to_thread(VocabInfo.from_tokenizer_dir, settings.model.tokenizer)
        tokenizer = await asyncio.to_thread(
            ChatTokenizer.load,
            settings.model.tokenizer,
            encode_threads=settings.model.encode_threads,
            encode_thread_min_chars=settings.model.encode_thread_min_chars,
        )
        stack.callback(tokenizer.close)
        s = settings.store
        trajectories = TrajectoryStore(
            redis,
            Keys(s.prefix, s.stream_partitions),
            ttl_s=s.ttl_s,
            max_pending=s.max_pending,
            session_idle_ttl_s=s.session_idle_ttl_s,
            retry_budget_s=settings.redis.retry_budget_s,
            pipelines=PipelineBatcher(redis) if fastpath.on("redis_batching") else None,
            max_session_metadata_bytes=s.max_session_metadata_bytes,
            durable_replicas=settings.redis.durable_replicas,
            wait_timeout_ms=settings.redis.wait_timeout_effective_ms,
        )
        trajectories.start()
        stack.push_async_callback(trajectories.aclose)
        # One map of session locks in the process: the store's (its writes), shared with the turns of sessions.
        sessions = SessionManager(
            tokenizer,
            trajectories,
            cache_size=s.session_cache_size,
            cache_bytes=s.session_cache_bytes,
            locks=trajectories.locks,
            token_history=token_history_for(
                tokenizer,
                family_of(tokenizer.chat_template, settings.model.tool_parser, settings.model.reasoning_parser),
                settings.sessions.history,
                explicit="history" in settings.sessions.model_fields_set,
                template_kwargs=settings.model.chat_template_kwargs or None,
            ),
            replay_match=settings.sessions.replay_match,
        )
        open_sessions = OpenSessions(
            redis, Keys(s.prefix), settings.server.max_open_sessions_per_key or 0, s.session_idle_ttl_s
        )
        quota = SessionQuota(settings.server.max_sessions_per_key)
        lifecycle = SessionLifecycle(sessions, trajectories, pool, open_sessions, quota)
        if pool.groups is not None:  # a GRPO group meets on one replica whichever process its members reach
            groups = trajectories.groups
            pool.groups.share = lambda group, replica: groups.claim(group, replica, GROUP_TTL_S)
        w = settings.weights
        budget: StalenessBudget | None = None
        if w.max_staleness is not None:  # null: no budget (nothing counted, held or cut)
            budget = StalenessBudget(
                trajectories.started,
                weights,
                max_staleness=w.max_staleness,
                over_budget=w.over_budget,
                hold_timeout_s=w.hold_timeout_s,
                retry_after_s=trajectories.retry_after_s,
            )
            trajectories.admission = lifecycle.staleness = generator.staleness = budget
            trajectories.drop_stale = w.stale_samples == "drop"
            cutting = background(budget.cut_on_updates(partial(cut_behind, pool)), "staleness-cuts")
            stack.push_async_callback(stop, cutting)
        turns = TurnRunner(
            generator,
            lifecycle,
            tokenizer,
            resolve_tool_parser(settings.model.tool_parser, tokenizer.chat_template),
            resolve_reasoning_parser(settings.model.reasoning_parser, tokenizer.chat_template),
            model_name=settings.model.name,
            max_model_len=settings.model.max_model_len,
            want_routed_experts=any(r.routed_experts for r in settings.replicas)
            or (settings.replicas_from is not None and settings.discovery.replica.routed_experts),
            chat_template_kwargs=settings.model.chat_template_kwargs,
        )
        stack.push_async_callback(lifecycle.drain, SHUTDOWN_RECORD_TIMEOUT_S)  # before the store and Redis close
        metrics = GatewayMetrics()
        stream_buffers = StreamBuffers(settings.server.stream_buffer_budget_bytes)
        metrics.bind(
            pool, weights, generator, trajectories, sessions, budget.counts if budget else None, stream_buffers
        )
        dashboard = DashboardSampler(pool, weights, generator, redis, Keys(s.prefix, s.stream_partitions))
        dashboard.budget = budget.counts if budget else None
        dashboard.on_staleness = metrics.delivered_staleness.observe
        trajectories.on_delivered.append(dashboard.observe_delivered)
        dashboard.start()
        stack.push_async_callback(dashboard.aclose)  # before Redis closes
        services = Services(
            settings=settings,
            pool=pool,
            weights=weights,
            generator=generator,
            vocab=vocab,
            redis_url=redis_url,
            store=trajectories,
            turns=turns,
            backend_factory=backend_factory,
            replica_configs={replica.id: replica for replica in settings.replicas},
            metrics=metrics,
            quota=quota,
            open_sessions=open_sessions,
            dashboard=dashboard,
            response_cache=ResponseCache(s.response_cache_size, trajectories.responses.ttl_s),
            stream_buffers=stream_buffers,
        )
        pool.on_probe = services.admission.verify
        stack.push_async_callback(services.admission.aclose)  # catch-ups end before the pool and Redis close
        discovery = services.follow_discovery()
        if discovery is not None:
            stack.push_async_callback(discovery.aclose)  # closes first: no replica is added while the rest close
        logger.info(
            "gateway ready: model %s, %d replicas, weight version %d",
            settings.model.name,
            len(backends),
            current,
            extra={"version": current},
        )
        yield services
