"""The simulator's SGLang load reports: `/metrics` (SGLang's scheduler gauges and counters) and `GET /v1/loads`
(one `LoadSnapshot` per data-parallel rank), read from the ranks at request time."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.sim.engine import SimEngine
from backends.sim.scheduler import Rank
from backends.sim.sglang_models import ContractError


class SglangMetrics:
    """Prometheus collector reading the engine's counters at scrape time (no per-token metric calls).

    One label set per data-parallel rank; like SGLang, a `dp_rank` label only when the server runs several."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> list[Metric]:
        e = self.engine
        names = ["model_name"] if len(e.ranks) == 1 else ["model_name", "dp_rank"]
        gauges = [GaugeMetricFamily(name, doc, labels=names) for name, doc in _SGLANG_GAUGES]
        counters = [CounterMetricFamily(name, doc, labels=names) for name, doc, _ in _SGLANG_COUNTERS]
        requests = CounterMetricFamily("sglang:num_requests", "Number of requests processed.", labels=names)
        for rank in e.ranks:
            values = [e.settings.model_name, str(rank.index)][: len(names)]
            for gauge, value in zip(gauges, _gauge_values(rank), strict=True):
                gauge.add_metric(values, value)
            for counter, (_, _, key) in zip(counters, _SGLANG_COUNTERS, strict=True):
                counter.add_metric(values, float(rank.counters[key]))  # exposed with the `_total` suffix
            finished = sum(rank.counters[f"finished_{reason}"] for reason in ("stop", "length", "abort"))
            requests.add_metric(values, float(finished))
        return [*gauges, *counters, requests]


_SGLANG_GAUGES = (
    ("sglang:num_running_reqs", "The number of running requests."),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    ("sglang:num_retracted_reqs", "The number of retracted requests."),
    ("sglang:cache_hit_rate", "The prefix cache hit rate."),
    ("sglang:token_usage", "The token usage."),
)
_SGLANG_COUNTERS = (
    ("sglang:num_aborted_requests", "Number of requests aborted.", "aborted"),
    ("sglang:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("sglang:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("sglang:cached_tokens", "Number of cached prompt tokens.", "prefix_cache_hits"),
    ("sglang:num_retracted_requests", "Total number of retracted requests.", "retractions"),
)


def _hit_rate(rank: Rank) -> float:
    queries = rank.counters["prefix_cache_queries"]
    return rank.counters["prefix_cache_hits"] / queries if queries else 0.0


def _gauge_values(rank: Rank) -> tuple[float, ...]:
    return (
        float(rank.num_running),
        float(rank.num_waiting),
        float(rank.num_preempted),
        _hit_rate(rank),
        rank.kv_usage(),
    )


def rank_load(rank: Rank, sections: frozenset[str]) -> dict[str, Any]:
    """One rank's entry of `/v1/loads`: SGLang's `LoadSnapshot` fields (the core ones, then `sections`)."""
    settings = rank.engine.settings
    used = rank.used_blocks() * settings.block_size
    queued, uncached = rank.waiting_tokens()
    capacity = rank.total_blocks * settings.block_size
    load: dict[str, Any] = {
        "timestamp": time.time(),
        "dp_rank": rank.index,
        "num_running_reqs": rank.num_running,
        "num_waiting_reqs": rank.num_waiting,
        "num_waiting_uncached_tokens": uncached,
        "num_used_tokens": used,
        "num_total_tokens": used + queued,
        "num_active_tokens": used + queued,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": settings.max_num_seqs,  # 0: no cap (a simulator setting; SGLang always has one)
        "token_usage": round(rank.kv_usage(), 4),
        "gen_throughput": 0.0,
        "cache_hit_rate": round(_hit_rate(rank), 4),
        "utilization": 0.0,
        "total_prefill_uncached_tokens": rank.counters["prefill_tokens"],
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    if "memory" in sections:
        load["memory"] = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": capacity}
    if "disagg" in sections:
        load["disaggregation"] = {"mode": "null", **dict.fromkeys(_DISAGG_COUNTS, 0)}
        load["disaggregation"] |= {"kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
    if "queues" in sections:
        waiting = len(rank.waiting) if rank.scheduled else rank.num_waiting
        load["queues"] = {
            "waiting": waiting,
            "grammar": 0,
            "paused": 0,
            "retracted": rank.num_preempted,
            "prealloc_ready": 0,
        }
    return load


_DISAGG_COUNTS = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
"""What `/v1/loads?include=` accepts (SGLang's `LoadSnapshot.VALID_SECTIONS`)."""


def load_sections(include: str | None) -> frozenset[str]:
    """The sections `include` asks for; SGLang answers 400 for one it does not know."""
    if not include:
        return LOAD_SECTIONS
    asked = frozenset(part.strip() for part in include.split(","))
    unknown = asked - LOAD_SECTIONS
    if unknown:
        raise ContractError(f"Invalid include sections: {set(unknown)}. Valid options: {sorted(LOAD_SECTIONS)}")
    return LOAD_SECTIONS if "all" in asked else asked


def loads_as_prometheus(loads: list[dict[str, Any]]) -> str:
    """`/v1/loads?format=prometheus`: one gauge per numeric field, a sample per rank (`dp_rank` label)."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = {"disaggregation": "disagg"}.get(key, key)
                for sub, number in value.items():
                    if isinstance(number, int | float):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, number))
            elif key != "dp_rank" and isinstance(value, int | float):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines: list[str] = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"
