"""`benchmarks.episodes` runs end to end through two served gateways: every turn comes back as scripted (the
benchmark's own checks; exit status 1 otherwise), and the figures it writes are the history modes' behaviour: one
sample per episode in tokens mode, one per turn in template mode, the same sampled tokens in both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import episodes


def test_a_small_run_gives_one_sample_per_episode_in_tokens_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = tmp_path / "episodes.json"
    argv = ["--turns", "6", "--episodes", "1", "--reasoning-words", "8", "--result-words", "10"]
    assert episodes.main([*argv, "--json", str(figures), "--timeout", "120"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title wraps at the table's width
    assert "Episodes of 6 turns" in out and "template ÷ tokens" in out
    modes = json.loads(figures.read_text())["modes"]
    [tokens], [template] = modes["tokens"]["episodes"], modes["template"]["episodes"]
    assert (tokens["samples"], template["samples"]) == (1, 6)
    assert (tokens["new_samples"], template["new_samples"]) == (1, 6)
    assert tokens["sampled_tokens"] == template["sampled_tokens"] > 0
    assert template["trained_tokens"] > 2 * tokens["trained_tokens"]
    assert 0 < tokens["cache_hits"] < tokens["cache_queries"] and tokens["cpu_s"] > 0


@pytest.mark.parametrize("argv", [["--turns", "0"], ["--user-every", "0"], ["--episodes", "0"]])
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        episodes.main(argv)
