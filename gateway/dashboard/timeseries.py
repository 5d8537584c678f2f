"""Per-second time series for the dashboard: mergeable points, a bounded ring of them, and latency histograms.

A *point* is what one gateway process saw during one wall-clock second, as a plain dict that travels as JSON
(between processes, through Redis: `gateway.dashboard.sampler`):

| key  | what                                                     | merged over processes by |
|------|----------------------------------------------------------|--------------------------|
| `n`  | counts during the second (turns, tokens, deliveries, …)  | sum                      |
| `lat`, `ttft` | latency histograms (`LatencyHistogram` buckets) | sum, bucket by bucket    |
| `g`  | this process's gauges (requests in flight)               | sum                      |
| `x`  | shared values every process reads from Redis (backlog)   | max (the same value)     |
| `r`  | per replica: health, version, in flight, tokens, circuit, prefix cache counts | see `_merge_replica` |
| `rw` | rewards of delivered sessions by weight version: [sum, n] | sum                     |
| `st` | delivered samples by versions behind: count              | sum                      |
| `sv` | delivered samples' staleness by the version serving then: [versions behind summed, samples] | sum |
| `ev` | weight updates this process coordinated                  | union                    |
| `ss` | turns by session (the busiest few of the second)         | sum                      |

Everything merges by sum or max, so percentiles come from merged histograms rather than from averaging each
process's percentiles (which would be wrong), and a point that arrives late simply joins its second.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

__all__ = ["LatencyHistogram", "Point", "Ring", "empty_point", "merge_point"]

Point = dict[str, Any]

# Buckets 2^(1/4) apart from 1 ms: 19% resolution; index 84 is about 2,000 s, past any request deadline.
_BASE_S = 0.001
_STEPS_PER_DOUBLING = 4
_BUCKETS = 85


class LatencyHistogram:
    """Counts of latencies in fixed log-spaced buckets; mergeable by adding counts. Kept sparse (most seconds see
    a handful of buckets)."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[int, int] | None = None) -> None:
        self.counts: dict[int, int] = counts if counts is not None else {}

    @staticmethod
    def bucket(seconds: float) -> int:
        if seconds <= _BASE_S:
            return 0
        return min(_BUCKETS - 1, math.ceil(_STEPS_PER_DOUBLING * math.log2(seconds / _BASE_S)))

    @staticmethod
    def upper_bound(bucket: int) -> float:
        """The largest latency bucket `bucket` holds."""
        return float(_BASE_S * 2 ** (bucket / _STEPS_PER_DOUBLING))

    def observe(self, seconds: float) -> None:
        index = self.bucket(seconds)
        self.counts[index] = self.counts.get(index, 0) + 1

    def add(self, other: dict[int, int]) -> None:
        for index, count in other.items():
            self.counts[index] = self.counts.get(index, 0) + count

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q`; None when empty."""
        total = self.total
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return self.upper_bound(index)
        return self.upper_bound(max(self.counts))


def empty_point(second: int) -> Point:
    point: Point = {"t": second, "ev": []}
    for key in ("n", "lat", "ttft", "g", "x", "r", "rw", "st", "sv", "ss"):
        point[key] = {}
    return point


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        into[key] = into.get(key, 0) + value


def _max(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if value is not None:
            into[key] = value if into.get(key) is None else max(into[key], value)


def _merge_replica(into: dict[str, Any], other: dict[str, Any]) -> None:
    """One replica as several processes saw it: down or open if any saw it so (each has its own health checks
    and circuit), the newest version, in-flight and tokens summed."""
    if not into:
        into.update(other)
        return
    for key, value in other.items():
        if value is None:
            continue
        if into.get(key) is None:
            into[key] = value
        elif key in ("in_flight", "tokens", "cache_queries", "cache_hits"):
            into[key] += value
        elif key in ("healthy", "serving"):
            into[key] = min(into[key], value)
        else:  # stale, draining, open (any process), version (the newest)
            into[key] = max(into[key], value)


def merge_point(into: Point, other: Point) -> None:
    """Add `other` (one process's point of the same second) into `into`."""
    _add(into["n"], other.get("n", {}))
    _add(into["lat"], other.get("lat", {}))
    _add(into["ttft"], other.get("ttft", {}))
    _add(into["g"], other.get("g", {}))
    _max(into["x"], other.get("x", {}))
    for replica, seen in other.get("r", {}).items():
        _merge_replica(into["r"].setdefault(replica, {}), seen)
    for version, (total, count) in other.get("rw", {}).items():
        before = into["rw"].get(version, (0.0, 0))
        into["rw"][version] = [before[0] + total, before[1] + count]
    _add(into["st"], other.get("st", {}))
    for version, (behind, samples) in other.get("sv", {}).items():
        before = into["sv"].get(version, (0, 0))
        into["sv"][version] = [before[0] + behind, before[1] + samples]
    _add(into["ss"], other.get("ss", {}))
    into["ev"].extend(other.get("ev", []))


class Ring:
    """The merged points of the last `window_s` seconds, one per second, oldest dropped first."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._points: dict[int, Point] = {}
        self.changes = 0  # counts merges: what was computed from the ring holds while it is unchanged

    def merge(self, point: Point) -> None:
        """Merge one process's point into its second; a point older than the window is dropped."""
        second = int(point["t"])
        newest = max(self._points, default=second)
        if second <= newest - self.window_s:
            return
        merge_point(self._points.setdefault(second, empty_point(second)), point)
        self.changes += 1
        for old in [s for s in self._points if s <= max(newest, second) - self.window_s]:
            del self._points[old]

    def points(self, since: int | None = None) -> Iterator[Point]:
        """The points in time order (seconds with no point are absent), from `since` if given."""
        for second in sorted(self._points):
            if since is None or second >= since:
                yield self._points[second]

    def __len__(self) -> int:
        return len(self._points)
