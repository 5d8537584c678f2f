"""`benchmarks.turn_tokenization` runs and finds both ways of tokenizing a chat turn, and of choosing its sample, in
agreement (the session manager in both history modes)."""

from __future__ import annotations

import pytest

from benchmarks import turn_tokenization


def test_quick_run_agrees_and_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--turns", "1", "3", "--words", "30", "--repeat", "1", "--samples", "3"]
    assert turn_tokenization.main(argv) == 0  # 1 if the session manager and the reference choose differently
    out = capsys.readouterr().out
    assert "Tokenizing one chat turn" in out
    assert "new tail only ms" in out
    assert "n=3: continue the first reply" in out
    assert "template mode ms" in out and "tokens mode ms" in out  # the session manager in both history modes
