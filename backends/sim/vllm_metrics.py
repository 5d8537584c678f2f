"""The simulator's vLLM `/metrics`: the engine's counters under vLLM's metric names, read at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.sim.engine import SimEngine


class VllmMetrics:
    """Prometheus collector reading the engine's counters at scrape time (no per-token metric calls)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> list[Metric]:
        e = self.engine
        labels = {"model_name": e.settings.model_name, "engine": "0"}
        names = list(labels)
        values = list(labels.values())
        out: list[Metric] = []
        for name, value in (
            ("vllm:num_requests_running", e.num_running),
            ("vllm:num_requests_waiting", e.num_waiting),
            ("vllm:kv_cache_usage_perc", min(1.0, len(e.running) / 256)),
        ):
            gauge = GaugeMetricFamily(name, name, labels=names)
            gauge.add_metric(values, value)
            out.append(gauge)
        for name, key in (
            ("vllm:prefix_cache_queries", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "prefix_cache_hits"),
            ("vllm:prompt_tokens", "prompt_tokens"),
            ("vllm:generation_tokens", "generation_tokens"),
            ("vllm:num_preemptions", "retractions"),
        ):
            counter = CounterMetricFamily(name, name, labels=names)
            counter.add_metric(values, e.counters[key])
            out.append(counter)
        success = CounterMetricFamily("vllm:request_success", "finished requests", labels=[*names, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], e.counters[f"finished_{reason}"])
        out.append(success)
        return out
