"""Smoke test of `benchmarks.scaling`: one and two worker processes at a trivial size (correctness, no timings)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from benchmarks.scaling import Options, measure, report

pytestmark = pytest.mark.timeout(120)


async def test_one_and_two_workers_end_to_end() -> None:
    options = Options(
        workers=(1, 2), apis=("generate", "completions"), agents=8, rounds=1, duration_s=1.0, timeout_s=60
    )
    rows = await measure(options, Console(file=io.StringIO()))
    for (api, workers), row in rows.items():
        assert row.errors == 0, (api, workers)
        assert len(row.req_s) == len(row.cpu_ms) == len(row.busiest) == 1, (api, workers)
        assert 1 / workers <= row.busiest[0] <= 1.0
    out = io.StringIO()
    report(Console(file=out, width=220), options, rows)
    assert "projected req/s" in out.getvalue() and "completions" in out.getvalue()
