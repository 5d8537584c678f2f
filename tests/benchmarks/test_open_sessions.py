"""`benchmarks.open_sessions` runs a few sessions through a real gateway process, leaves them open, and reports the
RSS growth per 1,000 (every turn checked: a failed one makes the run fail)."""

from __future__ import annotations

import pytest

from benchmarks import open_sessions


def test_a_small_run_reports_memory_per_open_session(capsys: pytest.CaptureFixture[str]) -> None:
    assert open_sessions.main(["--sessions", "24", "--turns", "2", "--concurrency", "8", "--timeout", "120"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps its lines
    assert "24 open sessions of 2 chat turns" in out
    assert "MiB per 1,000 open sessions" in out and "0 failures" in out
