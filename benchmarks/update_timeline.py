"""The fleet's counters over time, for `benchmarks.updates`: summed over the fleet and sampled every few hundred
milliseconds from a `CounterSource` (the simulator replicas' `/sim/state` here, `SimCounters`; a real engine's
`/metrics` in `benchmarks.update_engine`), and the arithmetic of a dip (tokens in a window, the area a weight update
cost).

Every value is a cumulative counter, so a window's amount is the difference of the counter, linearly interpolated,
at its two ends: sampling jitter moves a window's edges by a fraction of the interval, never drops tokens. A counter
a source cannot read is NaN throughout, and so is every figure made from it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

COUNTERS = ("generation_tokens", "prefix_cache_hits", "prefix_cache_queries", "retractions", "aborted")
"""The `/sim/state` counters the timeline keeps: decoded tokens, prefix-cache hits and queries (in prompt tokens),
preemptions (vLLM's `vllm:num_preemptions` is this counter) and aborted requests; and `recomputed_tokens` (the KV
that preempted requests recomputed at the prefill rate)."""
ALL_COUNTERS = (*COUNTERS, "recomputed_tokens")


@dataclass
class Timeline:
    """Monotonic times and, per counter, the fleet's sum at each time (ascending times)."""

    times: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in ALL_COUNTERS})

    def add(self, at: float, counters: dict[str, float]) -> None:
        self.times.append(at)
        for name, series in self.values.items():
            series.append(counters.get(name, math.nan))

    def at(self, name: str, when: float) -> float:
        """The counter at `when`, linearly interpolated between samples (clamped to the first and last)."""
        times, series = self.times, self.values[name]
        if not times:
            return 0.0
        index = bisect.bisect_right(times, when)
        if index == 0:
            return series[0]
        if index == len(times):
            return series[-1]
        t0, t1 = times[index - 1], times[index]
        v0, v1 = series[index - 1], series[index]
        return v0 + (v1 - v0) * (when - t0) / (t1 - t0) if t1 > t0 else v1

    def delta(self, name: str, start: float, end: float) -> float:
        """How much the counter grew over [start, end)."""
        return self.at(name, end) - self.at(name, start)

    def rate(self, name: str, start: float, end: float) -> float:
        """Its mean rate over [start, end), per second."""
        return self.delta(name, start, end) / (end - start) if end > start else float("nan")

    def first_sample_after(self, when: float) -> float:
        """The time of the first sample at or after `when` (the last sample's where none is)."""
        index = bisect.bisect_left(self.times, when)
        return self.times[min(index, len(self.times) - 1)] if self.times else when

    def hit_ratio(self, windows: Sequence[tuple[float, float]]) -> float:
        """Prefix-cache hits ÷ queries (prompt tokens) over the windows together, each taken from its first sample
        on: a ratio of two counters interpolated across an update would mix prompts from before it in (a fleet that
        stalls after an update admits few new prompts, so a few from before would dominate)."""
        windows = [(self.first_sample_after(a), b) for a, b in windows]
        hits = sum(self.delta("prefix_cache_hits", a, b) for a, b in windows if b > a)
        queries = sum(self.delta("prefix_cache_queries", a, b) for a, b in windows if b > a)
        return hits / queries if queries else float("nan")

    def tokens_lost(self, steady_rate: float, start: float, end: float) -> float:
        """The area of the dip over [start, end): ∫ (steady rate − rate(t)) dt, i.e. the tokens the steady rate would
        have decoded less those decoded. Net: a catch-up above the steady rate later in the window counts against
        the shortfall, and noise averages out rather than adding up."""
        return steady_rate * (end - start) - self.delta("generation_tokens", start, end)

    def lowest_rate(self, start: float, end: float, width: float) -> float:
        """The lowest mean token rate over any `width`-second window starting in [start, end - width] (the trough),
        stepped at the sampling times."""
        starts = [start] + [t for t in self.times if start < t <= end - width]
        return min((self.rate("generation_tokens", t, t + width) for t in starts), default=float("nan"))


class CounterSource(Protocol):
    """Where the fleet's counters come from."""

    async def counters(self, client: httpx.AsyncClient) -> dict[str, float]:
        """`ALL_COUNTERS` summed over the fleet (NaN for one the source cannot read)."""
        ...

    async def busy(self, client: httpx.AsyncClient) -> bool:
        """Whether any replica runs or queues a request."""
        ...


@dataclass(frozen=True)
class SimCounters:
    """The simulator replicas' `/sim/state`: every counter of `ALL_COUNTERS`, and their running and waiting
    requests."""

    urls: tuple[str, ...]

    async def _states(self, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        async with asyncio.TaskGroup() as group:
            answers = [group.create_task(client.get(f"{url}/sim/state")) for url in self.urls]
        states = []
        for answer in answers:
            response = answer.result()
            response.raise_for_status()
            states.append(response.json())
        return states

    async def counters(self, client: httpx.AsyncClient) -> dict[str, float]:
        total = dict.fromkeys(ALL_COUNTERS, 0.0)
        for state in await self._states(client):
            for name in ALL_COUNTERS:
                total[name] += float(state["counters"].get(name, 0))
        return total

    async def busy(self, client: httpx.AsyncClient) -> bool:
        return any(state["running"] or state["waiting"] for state in await self._states(client))


@contextlib.asynccontextmanager
async def sampled(source: CounterSource, interval_s: float) -> AsyncIterator[Timeline]:
    """Sample the fleet's counters (`source`) every `interval_s` into a `Timeline` while the block runs (and once more
    at its end). Each sample is stamped with the middle of its requests' round trip."""
    timeline = Timeline()
    stop = asyncio.Event()

    async def sample(client: httpx.AsyncClient) -> None:
        sent = time.monotonic()
        counters = await source.counters(client)
        timeline.add((sent + time.monotonic()) / 2, counters)

    async def loop(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await sample(client)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    async with httpx.AsyncClient(timeout=30.0) as client:
        task = asyncio.create_task(loop(client), name="timeline-sampler")
        try:
            yield timeline
        finally:
            stop.set()
            await task
        await sample(client)
