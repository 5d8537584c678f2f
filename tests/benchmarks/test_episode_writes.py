"""`benchmarks.episode_writes` runs, and both ways of writing an episode leave the same sample in Redis."""

from __future__ import annotations

import pytest

from benchmarks import episode_writes


def test_quick_run_stores_the_same_sample_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--turns", "3", "--prompt", "20", "--tokens-per-turn", "30", "--layers", "2", "--top-k", "2"]
    assert episode_writes.main([*argv, "--episodes", "2"]) == 0  # 1 if a stored sample differs from the episode's
    out = capsys.readouterr().out
    assert "One episode of 3 turns growing to 110 tokens" in out and "no experts, whole" in out
    assert "whole ÷ extending" in out
