"""`benchmarks.updates` at a trivial size (correctness, no timings): a `keep` update with the salt preempts and
recomputes nothing, the same update with the flush preempts the requests in flight and recomputes their KV, nothing
is drained on vLLM, and the table prints one row per cell; the timeline's arithmetic on made-up samples."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
from rich.console import Console

from benchmarks import updates
from benchmarks.update_engine import metric_sums
from benchmarks.update_timeline import Timeline

pytestmark = pytest.mark.timeout(240)

TINY = updates.Options(
    streams=4,
    replicas=1,
    dialects=("vllm",),
    modes=("keep",),
    caches=("salt", "flush"),
    min_tokens=24,
    max_tokens=32,
    prompt_words=32,
    warmup_s=0.5,
    steady_s=1.0,
    period_s=1.5,
    updates=1,
    dip_s=0.5,
    interval_s=0.1,
    pin=False,
    timeout_s=60.0,
)


async def test_a_tiny_run_counts_the_flush_and_prints_a_row_per_cell() -> None:
    cells = await updates.run_all(TINY, Console(file=io.StringIO()))
    by_cache = {cell.cache: cell for cell in cells}
    assert [(c.dialect, c.mode, c.cache) for c in cells] == [("vllm", "keep", "salt"), ("vllm", "keep", "flush")]
    for cell in cells:
        assert cell.error_count == 0 and not cell.errors, cell.errors
        assert cell.turns > 0 and cell.steady_rate > 0 and len(cell.lost) == len(cell.admin_s) == 1
        assert cell.drained == 0 and cell.counts["aborted"] == 0
    salt, flush = by_cache["salt"], by_cache["flush"]
    assert salt.counts["retractions"] == 0 and salt.counts["recomputed_tokens"] == 0
    # Every stream was mid-turn at the update (a turn outlasts the admin call): each kept request was preempted.
    assert flush.counts["retractions"] >= 1 and flush.counts["recomputed_tokens"] > 0
    assert not math.isnan(salt.hit_before) and salt.hit_before > 0  # later turns reuse their own prefix

    out = io.StringIO()
    updates.report(Console(file=out, width=200), TINY, cells)
    text = out.getvalue()
    header = next(line for line in text.splitlines() if "dialect mode cache" in line)
    assert all(column in header for column in ("steady", "lost", "÷ salt", "preempt", "recomp", "hit", "drain"))
    assert "vllm keep salt" in text and "vllm keep flush" in text
    assert "vllm keep: tokens lost per update, flush ÷ salt" in text


async def test_a_tiny_adapter_run_loads_each_version_without_a_pause() -> None:
    """The adapter row: a LoRA policy's versions (the simulator holds any adapter path) load beside the ones in
    flight: nothing aborted, preempted or drained, and the row has its own verdict line."""
    options = dataclasses.replace(TINY, caches=("salt", "flush"), transports=("adapter",))
    cells = await updates.run_all(options, Console(file=io.StringIO()))
    assert [(c.dialect, c.mode, c.cache, c.transport) for c in cells] == [("vllm", "keep", "salt", "adapter")]
    [cell] = cells
    assert cell.error_count == 0 and not cell.errors, cell.errors
    assert cell.turns > 0 and len(cell.admin_s) == 1 and cell.drained == 0
    assert cell.counts["aborted"] == cell.counts["retractions"] == 0
    out = io.StringIO()
    updates.report(Console(file=out, width=200), options, cells)
    assert "vllm adapter: tokens lost per update" in out.getvalue()


def test_the_timeline_interpolates_counters_and_integrates_the_dip() -> None:
    timeline = Timeline()
    for at, tokens in [(0.0, 0.0), (1.0, 100.0), (2.0, 100.0), (3.0, 300.0)]:  # 100/s, a 1-s stall, 200/s
        timeline.add(at, {"generation_tokens": tokens})
    assert timeline.at("generation_tokens", 0.5) == 50.0
    assert timeline.at("generation_tokens", 9.0) == 300.0  # clamped to the last sample
    assert timeline.rate("generation_tokens", 0.0, 1.0) == 100.0
    # Against a steady 100/s: 100 lost in the stall, 100 made up after it (net).
    assert timeline.tokens_lost(100.0, 1.0, 2.0) == 100.0
    assert timeline.tokens_lost(100.0, 1.0, 3.0) == 0.0
    assert timeline.lowest_rate(0.0, 3.0, 1.0) == 0.0


@pytest.mark.parametrize(
    "argv",
    [["--streams", "0"], ["--dip", "9", "--period", "4"], ["--tokens", "8", "4"], ["--transports", "transfer"]],
)
def test_impossible_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        updates.main(argv)


@pytest.mark.parametrize("argv", [["--dialects", "sglang"], ["--replicas", "2"], ["--load-delay", "1"]])
def test_an_engine_run_refuses_the_simulators_fleet_options(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        updates.main(["--engine", "vllm", *argv])


def test_an_engine_run_is_small_keep_only_and_of_its_own_dialect_unless_told() -> None:
    options = updates.options_from(updates.parse_args(["--engine", "sglang", "--streams", "3"]))
    assert (options.engine, options.dialects, options.replicas, options.modes) == ("sglang", ("sglang",), 1, ("keep",))
    assert options.streams == 3 and options.updates == updates.ENGINE_DEFAULTS["updates"]
    assert options.transports == ("path",)
    both = updates.options_from(updates.parse_args(["--engine", "vllm", "--transports", "path", "transfer"]))
    assert both.transports == ("path", "transfer")
    assert updates.options_from(updates.parse_args([])).engine is None


def test_engine_metrics_are_summed_over_label_sets_and_absent_ones_read_zero() -> None:
    text = "\n".join(
        [
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 40.0',
            'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 3.0',
            'vllm:num_preemptions_total{engine="0",model_name="tiny"} 5.0',
            'vllm:num_preemptions_total{engine="1",model_name="tiny"} 2.0',
            'sglang:realtime_tokens_total{model_name="tiny",mode="decode"} 11.0',
            'sglang:realtime_tokens_total{model_name="tiny",mode="prefill_compute"} 80.0',
            'sglang:other_total{forward_mode="decode"} 1.0',
        ]
    )
    wanted = (
        'vllm:request_success_total{finished_reason="abort"}',
        "vllm:num_preemptions_total",
        "vllm:absent_total",
        'sglang:realtime_tokens_total{mode="decode"}',
        'sglang:other_total{mode="decode"}',
    )
    assert metric_sums(text, wanted) == dict(zip(wanted, [3.0, 7.0, 0.0, 11.0, 0.0], strict=True))
