"""The simulator's vLLM `/metrics`: the engine's counters under vLLM's metric names, read at scrape time.

One label set per data-parallel rank, `engine="<rank>"`, as vLLM labels its engine cores."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.sim.engine import SimEngine

_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "prefix_cache_hits"),
    ("vllm:prompt_tokens", "prompt_tokens"),
    ("vllm:generation_tokens", "generation_tokens"),
    ("vllm:num_preemptions", "retractions"),
)


class VllmMetrics:
    """Prometheus collector reading the engine's counters at scrape time (no per-token metric calls)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> list[Metric]:
        e = self.engine
        model = e.settings.model_name
        names = ["model_name", "engine"]
        gauges = [GaugeMetricFamily(name, doc, labels=names) for name, doc in _GAUGES]
        counters = [CounterMetricFamily(name, name, labels=names) for name, _ in _COUNTERS]
        success = CounterMetricFamily("vllm:request_success", "finished requests", labels=[*names, "finished_reason"])
        for rank in e.ranks:
            values = [model, str(rank.index)]
            for gauge, value in zip(gauges, (rank.num_running, rank.num_waiting, rank.kv_usage()), strict=True):
                gauge.add_metric(values, value)
            for counter, (_, key) in zip(counters, _COUNTERS, strict=True):
                counter.add_metric(values, rank.counters[key])
            for reason in ("stop", "length", "abort"):
                success.add_metric([*values, reason], rank.counters[f"finished_{reason}"])
        return [*gauges, *counters, success]
