"""The real-engine fleet of `benchmarks.updates` (`--engine vllm|sglang`): one vLLM or SGLang server started on the
CPU recipe of `backends.launcher` (its tiny models), its counters read from `/metrics`, and put back on its first
weights between stacks, so each stack's gateway (a fresh store, at version 0) finds it as at startup.

Where the engine and the models are: `RG_VLLM_PYTHON`, `RG_SGLANG_PYTHON` and `RG_ENGINE_MODELS`, as
`backends.launcher` documents (default: the checkout's `.engines/`), or `--engine-python` and `--engine-model`.
The updates load the second checkpoint (`<model>_v2`) and the first in turn, so the weights really change: from
their paths, or (`--transports transfer`) pushed in memory from tensors read once from the same files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from backends.base import ReplicaSpec
from backends.factory import create_backend
from backends.launcher import EngineKind, EngineLaunch, default_python, free_port, resolve_model, start_engine
from benchmarks.update_timeline import ALL_COUNTERS
from gateway.weights.labels import version_label

# Each timeline counter as the sum of these metrics (`name`, or `name{label="value"}`: the samples with that label).
METRICS: dict[EngineKind, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "generation_tokens": ("vllm:generation_tokens_total",),
        "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
        "retractions": ("vllm:num_preemptions_total",),
        "aborted": ('vllm:request_success_total{finished_reason="abort"}',),
        # recomputed_tokens: vLLM counts no recomputed KV (NaN)
    },
    "sglang": {
        # counted at every decode step (`sglang:generation_tokens_total` only as requests finish)
        "generation_tokens": ('sglang:realtime_tokens_total{mode="decode"}',),
        "prefix_cache_hits": ("sglang:cached_tokens_total",),
        "prefix_cache_queries": ("sglang:prompt_tokens_total",),
        "retractions": ("sglang:num_retracted_requests_total",),
        "recomputed_tokens": ("sglang:num_retracted_input_tokens_total", "sglang:num_retracted_output_tokens_total"),
        "aborted": ("sglang:num_aborted_requests_total",),
    },
}
BUSY: dict[EngineKind, tuple[str, ...]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}
SGLANG_KV_TOKENS = 65536  # SGLang's CPU recipe pools 16,384 tokens: too few for the conversations, it would retract
FLUSH_TIMEOUT_S = 30.0


def metric_sums(text: str, wanted: tuple[str, ...]) -> dict[str, float]:
    """The sum of the samples of each wanted metric in Prometheus text. An absent one is 0: SGLang's labelled
    counters appear only once they have counted."""
    specs = {metric: metric.removesuffix("}").partition("{") for metric in wanted}
    sums = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.removesuffix("}").partition("{")
        for metric, (wanted_name, _, wanted_label) in specs.items():
            if name == wanted_name and (not wanted_label or wanted_label in labels.split(",")):
                sums[metric] += float(value)
    return sums


@dataclass(frozen=True)
class EngineCounters:
    """A `CounterSource` over one engine's `/metrics`."""

    kind: EngineKind
    url: str

    async def _sums(self, client: httpx.AsyncClient, wanted: tuple[str, ...]) -> dict[str, float]:
        answer = await client.get(f"{self.url}/metrics")
        answer.raise_for_status()
        return metric_sums(answer.text, wanted)

    async def counters(self, client: httpx.AsyncClient) -> dict[str, float]:
        metrics = METRICS[self.kind]
        sums = await self._sums(client, tuple(m for names in metrics.values() for m in names))
        return {name: sum(sums[m] for m in metrics[name]) if name in metrics else math.nan for name in ALL_COUNTERS}

    async def busy(self, client: httpx.AsyncClient) -> bool:
        return any(value > 0 for value in (await self._sums(client, BUSY[self.kind])).values())


@dataclass(frozen=True)
class Engine:
    """A running engine server: what it serves, and the checkpoint the updates alternate with."""

    kind: EngineKind
    url: str
    model: Path
    second: Path
    max_model_len: int

    def checkpoint(self, version: int) -> str:
        """The path an update to `version` loads: the second checkpoint for odd versions, the first for even."""
        return str(self.second if version % 2 else self.model)

    gloo: bool = False  # vLLM started with the gloo weight transfer (the project's plugin)

    def replica_entry(self) -> dict[str, Any]:
        """vLLM with scale-out (the launcher starts it with `--enable-scale-out`: its `keep` is real there) and, where
        it was started so, the gloo transfer; SGLang paused in place, as the simulator's replicas."""
        entry: dict[str, Any] = {"url": self.url, "backend": self.kind}
        if self.kind == "sglang":
            return entry | {"keep_mode": "in_place"}
        return entry | {"scale_out": True} | ({"weight_transfer": "gloo"} if self.gloo else {})

    def model_settings(self) -> dict[str, Any]:
        """The gateway's `model:` section: the engine's own tokenizer and context."""
        return {"tokenizer": str(self.model), "max_model_len": self.max_model_len}

    def counters(self) -> EngineCounters:
        return EngineCounters(self.kind, self.url)


@contextlib.contextmanager
def engine_running(
    kind: EngineKind, python: Path | None, model: str | Path, transfer: bool = False
) -> Iterator[Engine]:
    """Start the engine server on `model` (a tiny model's name or a folder, with its `_v2` beside it), stop it on
    exit; `transfer`: vLLM takes in-memory updates over gloo (SGLang takes inline tensors as it is). Raises
    `backends.launcher`'s errors where the engine or the models are not installed."""
    served = resolve_model(model)
    second = resolve_model(served.with_name(f"{served.name}_v2"))
    gloo = transfer and kind == "vllm"
    extra: tuple[str, ...] = ("--max-total-tokens", str(SGLANG_KV_TOKENS)) if kind == "sglang" else ()
    if gloo:
        extra = ("--weight-transfer-config", json.dumps({"backend": "gloo"}))
    launch = EngineLaunch(kind, python or default_python(kind), served, free_port(), extra_args=extra)
    with tempfile.TemporaryDirectory(prefix="rg-bench-engine-") as work, start_engine(launch, Path(work)) as engine:
        yield Engine(kind, engine.url, served, second, launch.max_model_len, gloo)


async def restore(engine: Engine) -> None:
    """Back to the served checkpoint, labelled version 0 (the version a fresh gateway starts at), resumed, with an
    empty prefix cache. SGLang refuses a flush while any request runs (its own `/health` runs one), so the flush is
    retried for a while."""
    backend = create_backend(engine.kind, ReplicaSpec(id="bench-restore", url=engine.url))
    try:
        await backend.resume()
        clean = await backend.update_weights(version_label(0), str(engine.model), flush=True)
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while not clean:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine.kind} at {engine.url} refused to flush its cache for {FLUSH_TIMEOUT_S} s")
            await asyncio.sleep(0.2)
            clean = await backend.flush_cache()
    finally:
        await backend.aclose()
