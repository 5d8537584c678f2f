"""Smoke tests of `benchmarks.scaling` at a trivial size (correctness, no timings): the shared layout, and the
dedicated layout's multi-load-generator path with pinning off (this machine has too few cores to pin it)."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from benchmarks.scaling import Options, main, measure, plan, report, write_json

pytestmark = pytest.mark.timeout(120)


async def test_one_and_two_workers_end_to_end() -> None:
    options = Options(
        workers=(1, 2), apis=("generate",), agents=8, rounds=1, duration_s=1.0, timeout_s=60
    )  # the dedicated layout's test below measures `completions`
    rows = await measure(options, Console(file=io.StringIO()))
    for (api, workers), row in rows.items():
        assert row.errors == 0, (api, workers)
        assert len(row.req_s) == len(row.cpu_ms) == len(row.busiest) == 1, (api, workers)
        assert 1 / workers <= row.busiest[0] <= 1.0
    out = io.StringIO()
    report(Console(file=out, width=220), options, rows)
    assert "projected req/s" in out.getvalue() and "generate" in out.getvalue()


def test_plan_gives_every_process_a_cpu_of_its_own() -> None:
    layout = plan(range(10), 4, pin=False)
    assert layout.workers == (0, 1, 2, 3) and layout.redis == 4
    assert (len(layout.replicas), len(layout.loadgens)) == (4, 1)  # a quarter of the 5 left: load generators
    everyone = [*layout.workers, layout.redis, *layout.replicas, *layout.loadgens]
    assert sorted(everyone) == list(range(10))
    assert layout.cpus(0) is None  # pin=False: computed, not applied
    assert plan(range(10), 4, replicas=4, pin=False).loadgens == (9,)
    with pytest.raises(ValueError):
        plan(range(6), 4, pin=False)
    with pytest.raises(ValueError):
        plan(range(10), 4, replicas=4, loadgens=2, pin=False)


async def test_dedicated_layout_with_two_load_generators(tmp_path: Path) -> None:
    layout = plan(range(7), 2, replicas=2, loadgens=2, pin=False)
    options = Options(
        workers=(1, 2), apis=("completions",), agents=8, rounds=1, duration_s=1.0, timeout_s=60, layout=layout
    )
    rows = await measure(options, Console(file=io.StringIO()))
    assert set(rows) == {("completions", 1), ("completions", 2), ("direct", 0)}
    for key, row in rows.items():
        assert row.errors == 0, (key, row.error_samples)
        assert len(row.req_s) == len(row.replica_use) == len(row.loadgen_use) == 1, key
        assert row.req_s[0] > 0 and row.loadgen_use[0] > 0, key
    for workers in (1, 2):
        row = rows[("completions", workers)]
        assert len(row.worker_use) == len(row.busiest) == 1
        assert 1 / workers <= row.busiest[0] <= 1.0 and row.worker_use[0] > 0
    assert rows[("direct", 0)].cpu_ms == []  # no gateway in the way
    out = io.StringIO()
    report(Console(file=out, width=260), options, rows)
    text = out.getvalue()
    assert "measured efficiency" in text and "direct to the 2 replicas" in text and "NOT pinned" in text
    write_json(tmp_path / "scaling.json", options, rows)
    written = orjson.loads((tmp_path / "scaling.json").read_bytes())
    assert written["layout"]["loadgens"] == [5, 6] and len(written["rows"]) == 3
    first = next(r for r in written["rows"] if r["api"] == "completions" and r["workers"] == 1)
    assert first["figures"]["measured_efficiency"] == 1.0


def test_dedicated_layout_refused_where_the_cpus_do_not_hold_it() -> None:
    with pytest.raises(SystemExit, match="dedicated"):
        main(["--layout", "dedicated", "--cpus", "0", "1", "--workers", "1", "2"])
