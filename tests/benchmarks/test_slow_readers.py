"""`benchmarks.slow_readers` opens never-read streams against a real gateway process and reports its RSS and what
the streams queued, per budget (its checks make the run fail: a stream not answered 200, bytes still queued once the
clients left, a budget overrun)."""

from __future__ import annotations

import pytest

from benchmarks import slow_readers


def test_a_small_run_reports_each_budget(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--budgets-mib", "1", "--streams", "3", "--tokens", "600", "--rounds", "1", "--timeout", "120"]
    assert slow_readers.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps its lines
    assert "3 streamed chat turns never read (600 tokens" in out
    assert "1 MiB" in out and "after round 1" in out
