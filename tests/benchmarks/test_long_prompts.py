"""`benchmarks.long_prompts` runs end to end: both settings serve every stream and long prompt, each on the replica
the placement hash chose (the benchmark's own checks; exit status 1 otherwise)."""

from __future__ import annotations

import pytest

from benchmarks import long_prompts


def test_a_small_run_serves_everything_on_the_chosen_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--threads", "0", "2", "--rounds", "1", "--streams", "4", "--stream-tokens", "30"]
    assert long_prompts.main([*argv, "--prompt-chars", "6000", "--timeout", "120"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title wraps at the table's width
    assert "Long prompts (6,000 characters" in out
    assert "on the loop" in out and "2 threads" in out


@pytest.mark.parametrize("argv", [["--threads", "-1"], ["--prompt-chars", "200000"], ["--stream-tokens", "1"]])
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        long_prompts.main(argv)
