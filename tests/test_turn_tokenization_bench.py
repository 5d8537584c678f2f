"""`benchmarks.turn_tokenization` runs and finds both ways of tokenizing a chat turn in agreement."""

from __future__ import annotations

import pytest

from benchmarks import turn_tokenization


def test_quick_run_agrees_and_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert turn_tokenization.main(["--turns", "1", "3", "--words", "30", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "Tokenizing one chat turn" in out
    assert "new tail only ms" in out
