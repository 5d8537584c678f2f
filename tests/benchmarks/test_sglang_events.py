"""`benchmarks.sglang_events` runs: every way of decoding gives the stream's tokens whole and in order, or it fails."""

from __future__ import annotations

import pytest

from benchmarks import sglang_events


def test_quick_run_compares_the_ways_of_decoding(capsys: pytest.CaptureFixture[str]) -> None:
    assert sglang_events.main(["--tokens", "16", "40", "--events-per-read", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 a read, last only" in out and "40" in out


def test_a_cumulative_stream_repeats_its_output_and_deltas_do_not() -> None:
    cumulative, deltas = sglang_events.events(5, True), sglang_events.events(5, False)
    assert b'"output_ids":[100,101,102,103,104]' in cumulative[-1]
    assert b'"output_ids":[104]' in deltas[-1] and len(cumulative[-1]) > len(deltas[-1])
