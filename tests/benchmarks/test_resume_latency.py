"""`benchmarks.resume_latency` runs end to end: every stream spans the update, resumes, and its tokens equal the
simulator's reference for the weights that sampled them (the benchmark's own checks; exit status 1 otherwise)."""

from __future__ import annotations

import pytest

from benchmarks import resume_latency


def test_quick_run_with_long_prompts_resumes_every_stream_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "12", "--prompt-tokens", "600", "--token-delay", "0.02", "--timeout", "120"]
    assert resume_latency.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title wraps at the table's width
    assert "prompts of 600 tokens" in out
    assert "12 in flight" in out and "failures (must be 0)" in out


@pytest.mark.parametrize("prompt_tokens", ["4", "4000"])
def test_prompt_sizes_the_simulator_cannot_hold_are_refused(prompt_tokens: str) -> None:
    with pytest.raises(SystemExit, match="--prompt-tokens"):
        resume_latency.main(["--prompt-tokens", prompt_tokens])
