"""The dashboard's data: a once-a-second sampler that turns the gateway's counters into per-second points
(`gateway.dashboard.timeseries`), shares them with the other gateway processes through Redis, and shapes the feed of
`GET /dashboard/state`.

Several processes (`serve --workers N`, or several hosts on one Redis): every process appends its own point of
each second to the `rg:dashboard` stream (trimmed by MINID to the window) and reads the stream from where it last
stopped, merging the others' points into its ring by their second. So any process answers the feed for the whole
cluster from memory, a process started later backfills the window from the stream, and no process is special.
Its own point it merges directly (it does not wait for Redis to see itself): with Redis down, a process shows
what it alone sees. The newest second may lack another process's point for up to a second (it arrives at that
process's next tick). See docs/architecture.md, "The dashboard".

What is counted where: turns, latencies and tokens in `Generator.on_finished` and its counters; deliveries in
`TrajectoryStore.on_delivered` (the session's reward and its samples' versions are read from Redis at the next
tick, a few fields per session); weight updates in `WeightCoordinator.on_update` (only the coordinating process
sees one, so each appears once); backlog and session counts are read from Redis by every process (merged by
max: the same values).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import orjson
import redis.asyncio as aioredis

from backends.base import Load
from backends.errors import BackendError
from gateway.background import stop
from gateway.dashboard.timeseries import LatencyHistogram, Point, Ring, empty_point
from gateway.errors import StoreError
from gateway.generation import GenerationRequest, Generator
from gateway.routing import Engine, ReplicaPool
from gateway.store import Keys
from gateway.store.keys import call, text
from gateway.weights import BudgetCounts, UpdateReport, WeightCoordinator

__all__ = ["WINDOW_S", "DashboardSampler"]

logger = logging.getLogger(__name__)

WINDOW_S = 900  # 15 minutes of seconds
MAX_DELIVERED_PER_TICK = 500  # sessions whose reward and versions one tick reads; the rest wait for the next
MAX_STALENESS_BUCKET = 8  # versions behind, the last bucket holds this many and more
TOP_SESSIONS = 20  # sessions by turns kept per point (and listed by the feed): bounds a point's size
# The busiest sessions are those of the last minute: who is busy now, and cheap to count (a 15-minute count over
# thousands of sessions took ~18 ms a tick).
TOP_SESSIONS_WINDOW_S = 60
CACHE_INTERVAL_S = 5.0  # how often each replica's /metrics is read for its prefix cache counters


class DashboardSampler:
    """Samples this process once a second into a ring it shares with the other processes (see the module doc)."""

    def __init__(
        self,
        pool: ReplicaPool,
        weights: WeightCoordinator,
        generator: Generator,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        window_s: int = WINDOW_S,
        interval_s: float = 1.0,
        cache_interval_s: float = CACHE_INTERVAL_S,
    ) -> None:
        self.pool = pool
        self.weights = weights
        self.generator = generator
        self.redis = redis
        self.keys = keys
        self.window_s = window_s
        self.interval_s = interval_s
        self.cache_interval_s = cache_interval_s
        self.worker = uuid.uuid4().hex[:12]
        self.ring = Ring(window_s)
        # Since the start of this process (and the window it backfilled): the run's learning curve and staleness.
        self.rewards: dict[str, list[float]] = {}  # version -> [sum, count]
        self.staleness: dict[str, int] = {}  # versions behind -> samples
        self.staleness_by_version: dict[str, list[int]] = {}  # version serving -> [versions behind summed, samples]
        self.budget: BudgetCounts | None = None  # the staleness budget's counts (set where the gateway is assembled)
        self.on_staleness: Callable[[int], None] | None = None  # told each delivered sample's versions behind
        self._latency = LatencyHistogram()
        self._ttft = LatencyHistogram()
        self._turns = 0
        self._delivered_count = 0
        self._sessions: Counter[str] = Counter()
        self._events: list[dict[str, Any]] = []
        self._delivered: deque[str] = deque()
        self._last: dict[str, int] = {}
        self._replica_tokens: dict[str, int] = {}
        self._read_from = f"{int((time.time() - window_s) * 1000)}-0"
        self._cache_seen: dict[str, tuple[float, float]] = {}  # replica -> its last (queries, hits)
        self._cache_delta: dict[str, list[float]] = {}  # replica -> [queries, hits] since the last tick
        self._summary: dict[str, Any] = {}
        self._summary_key: tuple[int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self._cache_task: asyncio.Task[None] | None = None
        self._failing = False
        generator.on_finished = self.observe_turn
        weights.on_update.append(self.observe_update)

    # -- what the gateway tells it -------------------------------------------------------------------------------

    def observe_turn(self, request: GenerationRequest, first_token_s: float | None, duration_s: float) -> None:
        self._turns += 1
        if request.session_id is not None:
            self._sessions[request.session_id] += 1
        self._latency.observe(duration_s)
        if first_token_s is not None:
            self._ttft.observe(first_token_s)

    def observe_update(self, report: UpdateReport) -> None:
        self._events.append(
            {
                "version": report.version,
                "mode": report.mode,
                "status": report.status,
                "started_at": report.started_at,
                "paused_at": report.paused_at,
                "loaded_at": report.loaded_at,
                "finished_at": report.finished_at,
                "duration_s": report.duration_s,
                "stale": list(report.stale),
                "errors": len(report.errors),
                "by": self.worker,
            }
        )

    def observe_delivered(self, session_id: str) -> None:
        self._delivered_count += 1
        self._delivered.append(session_id)

    # -- the loop ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            # Hard references: the event loop keeps only weak references to tasks.
            self._task = asyncio.create_task(self._run(), name="dashboard-sampler")
            self._cache_task = asyncio.create_task(self._scrape_caches_forever(), name="dashboard-caches")

    async def aclose(self) -> None:
        await stop(self._task, self._cache_task)
        self._task = self._cache_task = None

    async def _scrape_caches_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cache_interval_s)  # a period, not synchronisation
            try:
                await self.scrape_caches()
            except Exception:  # as in `_run`: logged, and the next period tries again
                logger.exception("dashboard: reading the replicas' cache counters failed")

    async def scrape_caches(self) -> None:
        """Read each replica's prefix cache counters (its /metrics) and add what they grew by since the last read;
        a replica that does not answer in its probe timeout is left out this time."""
        replicas = self.pool.engines()  # one read per engine, whatever its data-parallel ranks
        async with asyncio.TaskGroup() as group:
            reads = [group.create_task(_load(replica)) for replica in replicas]
        for replica, read in zip(replicas, reads, strict=True):
            load = read.result()
            if load is None or load.prefix_cache_queries is None or load.prefix_cache_hits is None:
                continue
            now = (load.prefix_cache_queries, load.prefix_cache_hits)
            before = self._cache_seen.get(replica.id)
            self._cache_seen[replica.id] = now
            if before is None or now[0] < before[0]:  # the first reading, or the engine restarted: no interval
                continue
            delta = self._cache_delta.setdefault(replica.id, [0.0, 0.0])
            delta[0] += now[0] - before[0]
            delta[1] += now[1] - before[1]

    async def _run(self) -> None:
        while True:
            # Ticks on the wall clock's second boundaries, so every process's points share their seconds.
            now = time.time()
            await asyncio.sleep(self.interval_s - now % self.interval_s)
            try:
                await self.tick(int(time.time()) - 1)
            except Exception:  # a bug here must not stop the dashboard for good (nor reach anything else)
                logger.exception("dashboard: a tick failed")

    async def tick(self, second: int) -> None:
        """Take this process's point for `second`, merge it, publish it, and merge what the others published."""
        point = self._own_point(second)
        shared = await self._guarded(self._shared_gauges(), "read the backlog")
        if shared is not None:
            point["x"].update(shared)
        delivered = await self._guarded(self._delivered_details(), "read delivered sessions")
        if delivered is not None:
            point["rw"], point["st"], point["sv"] = delivered
        self._merge(point)
        await self._guarded(self._exchange(point), "exchange points with the other processes")

    async def _guarded(self, work: Any, what: str) -> Any:
        try:
            result = await work
        except StoreError as exc:
            if not self._failing:  # the transition, not every second of an outage
                logger.warning("dashboard: cannot %s: %s", what, exc)
            self._failing = True
            return None
        self._failing = False
        return result

    def _delta(self, name: str, total: int) -> int:
        before = self._last.get(name, 0)  # every counter starts at 0 with the process
        self._last[name] = total
        return total - before

    def _own_point(self, second: int) -> Point:
        point = empty_point(second)
        point["w"] = self.worker
        g = self.generator
        point["n"] = {
            "turns": self._turns,
            "tokens": self._delta("tokens", g.completion_tokens_total),
            "prompt_tokens": self._delta("prompt_tokens", g.prompt_tokens_total),
            "resumes": self._delta("resumes", g.resumes_total),
            "preemptions": self._delta("preemptions", g.preemptions_total),
            "delivered": self._delivered_count,
        }
        if self.budget is not None:
            b = self.budget
            for name, total in (("admitted", b.admitted), ("held", b.held), ("refused", b.refused), ("cut", b.cut)):
                point["n"][f"budget_{name}"] = self._delta(f"budget_{name}", total)
        point["lat"] = {str(k): v for k, v in self._latency.counts.items()}
        point["ttft"] = {str(k): v for k, v in self._ttft.counts.items()}
        self._turns, self._latency, self._ttft = 0, LatencyHistogram(), LatencyHistogram()
        self._delivered_count = 0
        point["ss"] = dict(self._sessions.most_common(TOP_SESSIONS))
        self._sessions = Counter()
        now = time.monotonic()
        replicas: dict[str, dict[str, Any]] = {}
        for r in self.pool.all():
            replicas[r.id] = {
                "healthy": int(r.healthy),
                "serving": int(r.serving(now)),
                "stale": int(r.stale),
                "draining": int(r.draining),
                "open": int(now < r.circuit_open_until),
                "version": r.version,
                "in_flight": r.in_flight,
                "tokens": self._delta(f"replica:{r.id}", r.tokens_total),
            }
            cache = self._cache_delta.pop(r.id, None)
            if cache is not None:
                replicas[r.id]["cache_queries"], replicas[r.id]["cache_hits"] = cache
        point["r"] = replicas
        point["g"] = {"in_flight": sum(r.in_flight for r in self.pool.all())}
        point["x"] = {"version": self.weights.version}
        point["ev"], self._events = self._events, []
        return point

    async def _shared_gauges(self) -> dict[str, int]:
        """Backlog and sessions, read from Redis: the same for every process."""
        keys, client = self.keys, self.redis

        async def read() -> dict[str, int]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.scard(keys.pending)
                pipe.get(keys.reclaimed)
                pipe.get(keys.acked)
                pipe.zcard(keys.active_sessions)
                pipe.xlen(keys.abandoned)
                for stream in keys.streams:
                    pipe.exists(stream)
                pending, reclaimed, acked, active, abandoned, *present = await pipe.execute()
            unacked = consumers = 0
            for stream, exists in zip(keys.streams, present, strict=True):
                if exists:
                    groups = await client.xinfo_groups(stream)
                    unacked += sum(int(group["pending"]) for group in groups)
                    # A consumer reads every partition: the same names in each.
                    consumers = max(consumers, sum(int(group["consumers"]) for group in groups))
            return {
                "pending": int(pending or 0),
                "unacked": unacked,
                "reclaimed_total": int(reclaimed or 0),
                "acked_total": int(acked or 0),
                "consumers": consumers,
                "active_sessions": int(active),
                "abandoned_total": int(abandoned),
            }

        return await call(read(), "read the dashboard's backlog")

    async def _delivered_details(self) -> tuple[dict[str, list[float]], dict[str, int], dict[str, list[int]]]:
        """Rewards by weight version and staleness of the sessions delivered since the last tick. A session's
        version is its samples' newest (the policy that acted last); staleness, per sample, how many versions
        its oldest token lags the version serving when it was delivered (the trainer sees it at least that stale),
        as a histogram and, summed with the samples' count, under the version serving then."""
        # Taken off the queue only once read: after a Redis error the next tick reads them again.
        batch = list(itertools.islice(self._delivered, MAX_DELIVERED_PER_TICK))
        rewards: dict[str, list[float]] = {}
        staleness: dict[str, int] = {}
        if not batch:
            return rewards, staleness, {}
        current = self.weights.version
        by_version = [0, 0]
        client, keys = self.redis, self.keys

        async def read() -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                for session_id in batch:
                    pipe.hmget(keys.meta(session_id), ["reward", "sample_count"])
                return list(await pipe.execute())

        metas = await call(read(), "read delivered sessions")

        async def read_samples() -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                for session_id, (_, count) in zip(batch, metas, strict=True):
                    for index in range(int(count or 0)):
                        pipe.hmget(keys.sample(session_id, index), ["min_version", "max_version"])
                return list(await pipe.execute())

        versions = await call(read_samples(), "read delivered samples")
        for _ in batch:
            self._delivered.popleft()
        at = 0
        for reward, count in metas:
            newest: int | None = None
            for min_v, max_v in versions[at : at + int(count or 0)]:
                if min_v:
                    self._count_staleness(max(0, current - int(min_v)), staleness, by_version)
                if max_v:
                    newest = int(max_v) if newest is None else max(newest, int(max_v))
            at += int(count or 0)
            if reward and newest is not None:
                total = rewards.setdefault(str(newest), [0.0, 0])
                total[0] += float(reward)
                total[1] += 1
        return rewards, staleness, ({str(current): by_version} if by_version[1] else {})

    def _count_staleness(self, behind: int, histogram: dict[str, int], by_version: list[int]) -> None:
        bucket = str(min(MAX_STALENESS_BUCKET, behind))
        histogram[bucket] = histogram.get(bucket, 0) + 1
        by_version[0] += behind
        by_version[1] += 1
        if self.on_staleness is not None:
            self.on_staleness(behind)

    def _merge(self, point: Point) -> None:
        self.ring.merge(point)
        for version, (total, count) in point.get("rw", {}).items():
            into = self.rewards.setdefault(version, [0.0, 0])
            into[0] += total
            into[1] += count
        for behind, count in point.get("st", {}).items():
            self.staleness[behind] = self.staleness.get(behind, 0) + count
        for version, (behind_sum, samples) in point.get("sv", {}).items():
            into_version = self.staleness_by_version.setdefault(version, [0, 0])
            into_version[0] += behind_sum
            into_version[1] += samples

    async def _exchange(self, point: Point) -> None:
        """Append our point to the stream and merge the points the others appended since our last read."""
        client, stream = self.redis, self.keys.dashboard
        oldest = int((time.time() - self.window_s) * 1000)

        async def exchange() -> list[Any]:
            await client.xadd(stream, {"p": orjson.dumps(point)}, minid=oldest, approximate=True)
            return list(await client.xread({stream: self._read_from}, count=10_000) or [])

        for _, entries in await call(exchange(), "exchange dashboard points"):
            for entry_id, fields in entries:
                self._read_from = text(entry_id)
                try:
                    other = orjson.loads(fields[b"p"])
                    if other.get("w") != self.worker:
                        self._merge(other)
                except (KeyError, TypeError, ValueError, AttributeError):  # another version's point: skip it
                    logger.warning("dashboard: skipped an unreadable point %s", text(entry_id))

    # -- the feed ------------------------------------------------------------------------------------------------

    def feed(self, window_s: int | None = None, since: int | None = None) -> dict[str, Any]:
        """The series of the last `window_s` seconds (from second `since` on, if given: a page that has the
        earlier ones asks for the newest only), and over the whole window the weight-update timeline, the
        learning curve, the staleness histogram and the busiest sessions, shaped for the page (columns, one value
        per second). The whole-window part is computed once per change of the ring, however many pages poll."""
        window_s = window_s or self.window_s
        start = int(time.time()) - window_s
        points = list(self.ring.points(start if since is None else max(start, since)))
        key = (self.ring.changes, start)
        if self._summary_key != key:
            self._summary = self._summarize(list(self.ring.points(start)))
            self._summary_key = key
        return {
            "worker": self.worker,
            "series": _series(points),
            "replica_series": _replica_series(points),
        } | self._summary

    def _summarize(self, points: list[Point]) -> dict[str, Any]:
        return {
            "timeline": _timeline(points),
            "reward": [
                {"version": int(v), "mean": total / count, "sessions": count}
                for v, (total, count) in sorted(self.rewards.items(), key=lambda kv: int(kv[0]))
                if count
            ],
            "staleness": dict(sorted(self.staleness.items(), key=lambda kv: int(kv[0]))),
            "staleness_by_version": [
                {"version": int(v), "mean_behind": total / samples, "samples": samples}
                for v, (total, samples) in sorted(self.staleness_by_version.items(), key=lambda kv: int(kv[0]))
                if samples
            ],
            "top_sessions": _top_sessions(points[-TOP_SESSIONS_WINDOW_S:]),
        }


async def _load(replica: Engine) -> Load | None:
    try:
        return await replica.backend.load()
    except BackendError:
        return None


def _top_sessions(points: list[Point]) -> list[dict[str, Any]]:
    """The sessions with the most turns in `points` (each point kept its second's busiest: an approximation for
    a session that was never among them)."""
    turns: Counter[str] = Counter()
    for p in points:
        turns.update(p.get("ss", {}))
    top = heapq.nlargest(TOP_SESSIONS, turns.items(), key=lambda kv: (kv[1], kv[0]))
    return [{"session_id": session, "turns": count} for session, count in top]


def _quantile(counts: dict[str, int], q: float) -> float | None:
    return LatencyHistogram({int(k): v for k, v in counts.items()}).quantile(q)


def _series(points: list[Point]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {
        name: []
        for name in (
            "t",
            "turns",
            "tokens",
            "delivered",
            "resumes",
            "preemptions",
            "budget_admitted",
            "budget_held",
            "budget_refused",
            "budget_cut",
            "latency_p50",
            "latency_p99",
            "ttft_p50",
            "ttft_p99",
            "in_flight",
            "pending",
            "unacked",
            "reclaimed_total",
            "consumed",
            "active_sessions",
            "abandoned_total",
            "version",
        )
    }
    previous: dict[str, Any] = {}
    previous_t = 0
    for p in points:
        n, x = p["n"], p["x"]
        out["t"].append(p["t"])
        for name in ("turns", "tokens", "delivered", "resumes", "preemptions", *_BUDGET_SERIES):
            out[name].append(n.get(name, 0))
        out["latency_p50"].append(_quantile(p["lat"], 0.5))
        out["latency_p99"].append(_quantile(p["lat"], 0.99))
        out["ttft_p50"].append(_quantile(p["ttft"], 0.5))
        out["ttft_p99"].append(_quantile(p["ttft"], 0.99))
        out["in_flight"].append(p["g"].get("in_flight", 0))
        for name in ("pending", "unacked", "reclaimed_total", "active_sessions", "abandoned_total", "version"):
            out[name].append(x.get(name))
        # Acknowledged by trainers during the second: the growth of their shared counter since the second before.
        acked, before = x.get("acked_total"), previous.get("acked_total")
        out["consumed"].append(None if acked is None or before is None or p["t"] - previous_t != 1 else acked - before)
        previous, previous_t = x, p["t"]
    return out


_BUDGET_SERIES = ("budget_admitted", "budget_held", "budget_refused", "budget_cut")

_REPLICA_COLUMNS = ("healthy", "serving", "open", "version", "in_flight", "tokens")


def _replica_series(points: list[Point]) -> dict[str, dict[str, list[Any]]]:
    """Per replica, its own time column: a replica that joined or left midway has the seconds it was seen."""
    out: dict[str, dict[str, list[Any]]] = {}
    for p in points:
        for replica, seen in p["r"].items():
            columns = out.setdefault(replica, {name: [] for name in ("t", *_REPLICA_COLUMNS, "cache_hit_rate")})
            columns["t"].append(p["t"])
            for name in _REPLICA_COLUMNS:
                columns[name].append(seen.get(name))
            queries = seen.get("cache_queries")
            columns["cache_hit_rate"].append(seen.get("cache_hits", 0) / queries if queries else None)
    return out


def _timeline(points: Iterable[Point]) -> list[dict[str, Any]]:
    """Each weight update once, with the resumes it caused: preempted segments from its pause to 2 s after it
    served again (a preempted request re-issues when released)."""
    points = list(points)
    events: dict[tuple[int, float], dict[str, Any]] = {}
    for p in points:
        for event in p["ev"]:
            events.setdefault((event["version"], event["started_at"]), dict(event))
    for event in events.values():
        end = (event["finished_at"] or event["started_at"]) + 2
        event["preemptions"] = sum(
            p["n"].get("preemptions", 0) for p in points if event["started_at"] - 1 <= p["t"] <= end
        )
    return sorted(events.values(), key=lambda e: e["started_at"])
