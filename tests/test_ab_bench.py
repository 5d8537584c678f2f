"""Smoke test of `benchmarks.ab`: two gateway processes from two checkouts, interleaved (correctness, no timings)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

import benchmarks.ab as ab

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]


async def test_two_checkouts_side_by_side() -> None:
    short = {w.name: w for w in ab.workloads(True, None, None, 0.0)}["short-c64"]
    tiny = replace(short, sessions=4, requests=40, duration_s=1.0)
    options = ab.Options((REPO, REPO), "generate", tiny, rounds=2, timeout_s=60)
    sides = await ab.measure(options, Console(file=io.StringIO()))
    assert [side.errors for side in sides] == [0, 0]
    assert [len(side.units) for side in sides] == [2, 2]  # every run measured, in both checkouts
    out = io.StringIO()
    ab.report(Console(file=out, width=200), options, sides)
    assert "÷ first" in out.getvalue() and str(REPO) in out.getvalue()
