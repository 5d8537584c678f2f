"""Prometheus metrics of one gateway process, and the log fields that go with them (docs/architecture.md §14: no
per-token work).

Names are a contract (a Grafana dashboard is built against them); never rename one:

| metric                                   | type      | labels        | recorded                                  |
|------------------------------------------|-----------|---------------|-------------------------------------------|
| `rollout_gateway_requests_total`         | counter   | route, status | per HTTP request, read at scrape          |
| `rollout_gateway_tokens_total`           | counter   | kind          | read at scrape from `Generator` counters  |
| `rollout_gateway_in_flight`              | gauge     | replica       | read at scrape from the pool              |
| `rollout_gateway_replica_healthy`        | gauge     | replica       | read at scrape from the pool              |
| `rollout_gateway_paced_reads_total`      | counter   | replica       | read at scrape from each replica's pacer  |
| `rollout_gateway_resumes_total`          | counter   |               | read at scrape from `Generator`           |
| `rollout_gateway_preemptions_total`      | counter   |               | read at scrape from `Generator`           |
| `rollout_gateway_segments_cut_total`     | counter   | cause         | read at scrape from `Generator`           |
| `rollout_gateway_resume_latency_seconds` | histogram |               | `Generator.on_resume`, per streamed resume|
| `rollout_gateway_resume_dispatch_seconds`| histogram |               | `Generator.on_dispatch`, per preemption   |
| `rollout_gateway_weight_version`         | gauge     |               | read at scrape from the coordinator       |
| `rollout_gateway_weight_update_seconds`  | histogram |               | `WeightCoordinator.on_update`, per update |
| `rollout_gateway_store_pending`          | gauge     |               | `rg:pending:sessions`, read per scrape    |
| `rollout_gateway_affinity_ratio`         | gauge     |               | read at scrape from the pool              |
| `rollout_gateway_store_pipelines_total`  | counter   |               | read at scrape from the store's batcher   |
| `rollout_gateway_store_calls_total`      | counter   |               | read at scrape from the store's batcher   |
| `rollout_gateway_samples_moved_total`    | counter   |               | read at scrape from the store's stats     |
| `rollout_gateway_chat_turns_total`       | counter   | history       | read at scrape from `SessionManager`      |
| `rollout_gateway_replays_forgiven_total` | counter   | kind          | read at scrape from `SessionManager`      |
| `rollout_gateway_budget_sessions_total`  | counter   | outcome       | read at scrape from `StalenessBudget`     |
| `rollout_gateway_budget_stale_cuts_total`| counter   |               | read at scrape from `StalenessBudget`     |
| `rollout_gateway_delivered_staleness`    | histogram |               | versions behind, per delivered sample     |
| `rollout_gateway_stream_queued_bytes`    | gauge     |               | read at scrape from `StreamBuffers`       |
| `rollout_gateway_slow_clients_cut_total` | counter   | cause         | read at scrape from `StreamBuffers`       |

Most values already live in the objects that own them (in-flight counts, health, the generator's counters, the
version, affinity), so a custom collector reads them when Prometheus scrapes and the request path updates
nothing for them. What is pushed is pushed rarely: one counter increment per HTTP request, one histogram
observation per resumed segment (two after a preemption: dispatch and first token) and per weight update.

`store_calls_total / store_pipelines_total` is the mean number of the turns' Redis round trips that shared one
pipeline (`gateway.fastpath.redis_batching`): 1 at low load, more as concurrent turns queue behind the pipeline in
flight.

`samples_moved_total` counts sample writes that found their index taken by another turn of the same session on
another process (parallel requests of one session across gateways): both samples are kept, the later one at the
session's next free index (`TrajectoryStore.save_sample`).

`paced_reads_total{replica}` counts the stream reads of a replica that were held until the pacer's next tick
(`generation.stream_pacing_s`, only while `stream_pacing_min_streams` streams are open): while it grows, the
gateway takes that replica's one-token events several to a read; `tokens_total` over it bounds tokens per read.

`tokens_total{kind="completion"}` counts tokens handed to callers; `kind="prompt"` counts each generation's
prompt once (n choices of one request count n times; a resume re-sends the prompt but does not recount it).

`chat_turns_total{history}` counts the chat turns that continued a sample, by how their prompt was made (`tokens`:
from the sample's exact ids, `sessions.history: tokens`; `template`: the template's rendering extended the sample),
and those that started a new sample in a session that had one (`rewritten`: an edit, or a template that writes the
new messages elsewhere). `replays_forgiven_total{kind}` counts the tokens-path turns whose replay differed from the
stored conversation in that kind of serialization (`gateway.history.Forgiven`, `sessions.replay_match`).

`budget_sessions_total{outcome}` counts new sessions by what the staleness budget did (docs/architecture.md §5):
`admitted` (a group's n count n), `held` (waited for the trainer's next version; admitted or refused later), and
`refused` (429, at once under `weights.over_budget: refuse`, else after `hold_timeout_s`). `budget_stale_cuts_total`
counts the turns cut for staleness (a resume not made; a later turn on such a sample refused with 410).
`delivered_staleness` is the dashboard's staleness of delivered samples (how many versions each one's oldest
token lags the version serving at delivery); the dashboard shows it per version too.

`stream_queued_bytes` is what streamed answers hold for their clients in this process (queued chunks, and messages
waiting for a socket to drain), bounded by `server.stream_buffer_budget_bytes`; `slow_clients_cut_total{cause}`
counts the streaming clients cut for reading too slowly: `buffer` (`server.stream_buffer_bytes` queued for one),
`stalled` (a send without progress for `server.slow_client_timeout_s`), `budget` (the process's budget passed, the
client holding the most cut; docs/reliability.md).

Store pending is read from Redis (`SCARD rg:pending:sessions`) by `refresh()` before each scrape, bounded by a short
timeout, rather than cached by a background task: a scrape every ~15 s costs one GET per process, the value is
exact when read (no refresh lag to explain), and there is no task to start, stop and keep alive. If Redis does
not answer in time the sample is left out of that scrape (absent means unknown; a stale number would lie). The
counter is shared by every gateway process on one Redis: aggregate it with `max`, not `sum`.

Each `GatewayMetrics` owns its registry, so several gateways can run in one process (the tests do).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.errors import StoreError
from gateway.history import Forgiven

if TYPE_CHECKING:
    from gateway.generation import Generator
    from gateway.routing import ReplicaPool
    from gateway.session.samples import SessionManager
    from gateway.store import TrajectoryStore
    from gateway.weights import BudgetCounts, UpdateReport, WeightCoordinator

logger = logging.getLogger(__name__)

PREFIX = "rollout_gateway"
CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED_ROUTE = "unmatched"  # a path no route matched: one label value, never the raw URL (cardinality)

# Resume latency includes waiting for a weight update, so the buckets reach minutes.
RESUME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Dispatch after a weight update is gateway work only (the budget is 100 ms p99): fine buckets around it.
DISPATCH_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.25),
    *(0.35, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0),
)
UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
LOG_FIELDS = ("session_id", "replica", "version")


class ScoringCounts(Protocol):
    """A policy's teacher scoring (`gateway.teacher.TeacherScoring`): sessions scored, delivered unscored, and the
    teacher's failures (each retried)."""

    scored_total: int
    unscored_total: int
    failures_total: int


class StreamCounts(Protocol):
    """What streamed answers hold for their clients, and the clients cut (`gateway.api.client_writer.StreamBuffers`:
    the domain imports no HTTP layer)."""

    @property
    def queued_bytes(self) -> int: ...

    @property
    def cuts(self) -> Mapping[str, int]: ...


class _Sources:
    """The live objects the scrape-time collector reads."""

    def __init__(
        self,
        pool: ReplicaPool,
        weights: WeightCoordinator,
        generator: Generator,
        store: TrajectoryStore,
        sessions: SessionManager,
    ) -> None:
        self.pool = pool
        self.weights = weights
        self.generator = generator
        self.store = store
        self.sessions = sessions
        self.budget: BudgetCounts | None = None
        self.streams: StreamCounts | None = None
        self.scoring: ScoringCounts | None = None


class _LiveCollector:
    """Reads in-flight, health, counters, version, affinity and the last pending count when scraped."""

    def __init__(self, sources: _Sources) -> None:
        self.sources = sources
        self.pending: int | None = None

    def collect(self) -> Iterable[Metric]:
        src = self.sources
        replicas = src.pool.all()
        in_flight = GaugeMetricFamily(f"{PREFIX}_in_flight", "Requests in flight per replica.", labels=["replica"])
        healthy = GaugeMetricFamily(
            f"{PREFIX}_replica_healthy",
            "1 if the replica passes health checks (stale ones included).",
            labels=["replica"],
        )
        paced = CounterMetricFamily(
            f"{PREFIX}_paced_reads",
            "Stream reads held back to take several engine events at once (generation.stream_pacing_s).",
            labels=["replica"],
        )
        for replica in replicas:
            in_flight.add_metric([replica.id], replica.in_flight)
            healthy.add_metric([replica.id], 1.0 if replica.healthy else 0.0)
        for engine in src.pool.engines():  # one client per engine, whatever its data-parallel ranks
            paced.add_metric([engine.id], engine.backend.paced_reads)
        tokens = CounterMetricFamily(f"{PREFIX}_tokens", "Tokens by kind (prompt, completion).", labels=["kind"])
        tokens.add_metric(["prompt"], src.generator.prompt_tokens_total)
        tokens.add_metric(["completion"], src.generator.completion_tokens_total)
        yield in_flight
        yield healthy
        yield paced
        yield tokens
        yield CounterMetricFamily(
            f"{PREFIX}_resumes", "Segments re-issued after an abort or a replica failure.", src.generator.resumes_total
        )
        yield CounterMetricFamily(
            f"{PREFIX}_preemptions", "Segments aborted by a weight update.", src.generator.preemptions_total
        )
        cut = CounterMetricFamily(
            f"{PREFIX}_segments_cut",
            "Segments the gateway cut: replica taken out (probe, circuit), stalled (generation.stall_timeout_s), or "
            "begun under newer weights than this process knew of (engine_ahead).",
            labels=["cause"],
        )
        cut.add_metric(["replica_out"], src.generator.interrupted_total)
        cut.add_metric(["stalled"], src.generator.stalled_total)
        cut.add_metric(["engine_ahead"], src.generator.engine_ahead_total)
        yield cut
        yield GaugeMetricFamily(f"{PREFIX}_weight_version", "Weight version the pool serves.", src.weights.version)
        yield GaugeMetricFamily(
            f"{PREFIX}_affinity_ratio", "Turns that reached their previous turn's replica.", src.pool.affinity.ratio
        )
        batcher = src.store.batcher
        yield CounterMetricFamily(f"{PREFIX}_store_pipelines", "Pipelines the store sent to Redis.", batcher.pipelines)
        yield CounterMetricFamily(
            f"{PREFIX}_store_calls", "Round trips the store asked for, several per pipeline under load.", batcher.calls
        )
        yield CounterMetricFamily(
            f"{PREFIX}_samples_moved",
            "Sample writes that found their index taken by another process's turn, and moved to a free one.",
            src.store.stats.samples_moved,
        )
        chat_turns = CounterMetricFamily(
            f"{PREFIX}_chat_turns",
            "Chat turns by how their prompt was made: tokens, template, or rewritten (a new sample).",
            labels=["history"],
        )
        for path in ("tokens", "template", "rewritten"):
            chat_turns.add_metric([path], src.sessions.turns_by_history[path])
        yield chat_turns
        forgiven = CounterMetricFamily(
            f"{PREFIX}_replays_forgiven",
            "Replays that continued their sample despite a difference in serialization, by kind.",
            labels=["kind"],
        )
        for kind in Forgiven:
            forgiven.add_metric([kind.value], src.sessions.replays_forgiven[kind])
        yield forgiven
        if src.budget is not None:
            budget = CounterMetricFamily(
                f"{PREFIX}_budget_sessions", "New sessions by the staleness budget's outcome.", labels=["outcome"]
            )
            for outcome in ("admitted", "held", "refused"):
                budget.add_metric([outcome], getattr(src.budget, outcome))
            yield budget
            yield CounterMetricFamily(
                f"{PREFIX}_budget_stale_cuts", "Turns cut for staleness by the staleness budget.", src.budget.cut
            )
        if src.streams is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_stream_queued_bytes",
                "Bytes of streamed answers held for their clients (server.stream_buffer_budget_bytes).",
                src.streams.queued_bytes,
            )
            slow = CounterMetricFamily(
                f"{PREFIX}_slow_clients_cut", "Streaming clients cut for reading slowly, by cause.", labels=["cause"]
            )
            for cause, count in src.streams.cuts.items():
                slow.add_metric([cause], count)
            yield slow
        if src.scoring is not None:
            scored = CounterMetricFamily(
                f"{PREFIX}_teacher_sessions",
                "Sessions delivered after their teacher: scored, or unscored.",
                labels=["outcome"],
            )
            scored.add_metric(["scored"], src.scoring.scored_total)
            scored.add_metric(["unscored"], src.scoring.unscored_total)
            yield scored
            yield CounterMetricFamily(
                f"{PREFIX}_teacher_failures",
                "Scorings of a session the teacher failed (each tried again).",
                src.scoring.failures_total,
            )
        if self.pending is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_store_pending", "Finished trajectories not yet consumed by a trainer.", self.pending
            )


class _RequestCounts:
    """`rollout_gateway_requests_total` from plain integers: one dict update per request, where a prometheus child
    takes a lock and checks its state at every `inc`; exposed when scraped (one event loop counts and scrapes)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            f"{PREFIX}_requests", "HTTP requests by route template and status.", labels=["route", "status"]
        )
        for (route, status), count in list(self.counts.items()):
            family.add_metric([route, str(status)], count)
        yield family


class GatewayMetrics:
    """The metrics of one gateway: its own registry, the pushed metrics, and the scrape-time collector."""

    def __init__(self, *, pending_timeout_s: float = 0.25) -> None:
        self.registry = CollectorRegistry()
        self.pending_timeout_s = pending_timeout_s
        self._requests = _RequestCounts()
        self.registry.register(self._requests)
        self.resume_latency = Histogram(
            f"{PREFIX}_resume_latency_seconds",
            "From a segment's abort or failure to the first token of its continuation (streamed continuations).",
            buckets=RESUME_BUCKETS,
            registry=self.registry,
        )
        self.resume_dispatch = Histogram(
            f"{PREFIX}_resume_dispatch_seconds",
            "From the release of requests held by a weight update to their continuation being sent to an engine.",
            buckets=DISPATCH_BUCKETS,
            registry=self.registry,
        )
        self.weight_update = Histogram(
            f"{PREFIX}_weight_update_seconds",
            "Duration of a weight update (pause, update, verify, resume).",
            buckets=UPDATE_BUCKETS,
            registry=self.registry,
        )
        self.delivered_staleness = Histogram(
            f"{PREFIX}_delivered_staleness",
            "Versions a delivered sample's oldest token lags the version serving at delivery.",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self._live: _LiveCollector | None = None
        self._pending_failing = False

    def bind(
        self,
        pool: ReplicaPool,
        weights: WeightCoordinator,
        generator: Generator,
        store: TrajectoryStore,
        sessions: SessionManager,
        budget: BudgetCounts | None = None,
        streams: StreamCounts | None = None,
    ) -> None:
        """Read these objects at scrape time and subscribe to their events (once, at startup)."""
        if self._live is not None:
            raise RuntimeError("GatewayMetrics is already bound")
        self._live = _LiveCollector(_Sources(pool, weights, generator, store, sessions))
        self._live.sources.budget = budget
        self._live.sources.streams = streams
        self.registry.register(self._live)
        generator.on_resume = self.observe_resume
        generator.on_dispatch = self.observe_dispatch
        weights.on_update.append(self.observe_update)

    def bind_scoring(self, scoring: ScoringCounts) -> None:
        """Expose a policy's teacher scoring (bound after `bind`, once its teachers' pools are open)."""
        if self._live is None:
            raise RuntimeError("GatewayMetrics is not bound")
        self._live.sources.scoring = scoring

    def observe_request(self, route: str, status: int) -> None:
        key = (route, status)
        counts = self._requests.counts
        counts[key] = counts.get(key, 0) + 1

    def observe_resume(self, seconds: float) -> None:
        self.resume_latency.observe(seconds)

    def observe_dispatch(self, seconds: float) -> None:
        self.resume_dispatch.observe(seconds)

    def observe_update(self, report: UpdateReport) -> None:
        # An out-of-band pause/resume reports no duration (the sync ran outside the gateway): nothing to observe.
        # A failed update (announced too, for the dashboard's timeline) is not an update's duration either.
        if report.duration_s > 0 and report.status != "failed":
            self.weight_update.observe(report.duration_s)

    @property
    def store_pending(self) -> int | None:
        """The pending count read by the last `refresh()`; None if Redis did not answer in time."""
        return self._live.pending if self._live is not None else None

    async def refresh(self) -> None:
        """Read what lives outside this process (`rg:pending:sessions`), bounded by `pending_timeout_s`."""
        live = self._live
        if live is None:
            return
        try:
            async with asyncio.timeout(self.pending_timeout_s):
                live.pending = await live.sources.store.pending()
        except (StoreError, TimeoutError) as exc:
            live.pending = None
            if not self._pending_failing:  # log the transition, not every scrape of an outage
                logger.warning("metrics: cannot read the pending count from Redis: %s", exc or "timed out")
            self._pending_failing = True
            return
        self._pending_failing = False

    def render(self) -> bytes:
        """The Prometheus text exposition of this gateway's registry."""
        return generate_latest(self.registry)


class ContextFormatter(logging.Formatter):
    """Appends the structured fields a record carries (`extra={"session_id", "replica", "version"}`) as
    `key=value`, so plain-text logs can be filtered by session, replica or weight version."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [f"{name}={record.__dict__[name]}" for name in LOG_FIELDS if record.__dict__.get(name) is not None]
        return f"{text} {' '.join(fields)}" if fields else text


__all__ = ["CONTENT_TYPE", "UNMATCHED_ROUTE", "ContextFormatter", "GatewayMetrics", "StreamCounts"]


def render_pools(pools: Mapping[str, GatewayMetrics]) -> bytes:
    """One exposition of every pool's metrics (`pools:`): each series gets its pool's model as the label `pool`, but
    `requests_total`, which the process counts once (on its first pool's metrics), stays as it is. One pool: its
    own exposition, unchanged."""
    if len(pools) == 1:
        return next(iter(pools.values())).render()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PoolsCollector(pools))
    return generate_latest(registry)


class _PoolsCollector:
    def __init__(self, pools: Mapping[str, GatewayMetrics]) -> None:
        self.pools = pools

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for index, (pool, metrics) in enumerate(self.pools.items()):
            for family in metrics.registry.collect():
                if family.name == f"{PREFIX}_requests":
                    if index == 0:
                        yield family
                    continue
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples += [s._replace(labels={**s.labels, "pool": pool}) for s in family.samples]
        yield from merged.values()
