"""`benchmarks.engine_client` runs: both clients read every answer of both kinds (an empty answer fails the run)."""

from __future__ import annotations

import pytest

from benchmarks import engine_client


def test_quick_run_compares_both_clients(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_client.main(["--requests", "64", "--concurrency", "4", "--rounds", "1", "--events", "3"]) == 0
    out = capsys.readouterr().out
    assert "whole answer" in out and "streamed answer" in out and "pool ÷ aiohttp" in out
