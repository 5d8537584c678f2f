"""Smoke test of `benchmarks.ab`: two gateway processes from two checkouts, interleaved (correctness, no timings)."""

from __future__ import annotations

import io
import os
from dataclasses import replace

import orjson
import pytest
from rich.console import Console

import benchmarks.ab as ab
from benchmarks.loadgen import LoadGen, Spec
from tests import REPO

pytestmark = pytest.mark.timeout(120)


async def test_two_checkouts_side_by_side_on_sglang_replicas_one_turn_streams() -> None:
    """Rounds in turn, each side measured; `--dialect sglang`: the replicas speak SGLang's protocol (cumulative
    stream events) and every stream counts; `--one-turn` `completions`: measured without a session."""
    stream = {w.name: w for w in ab.workloads(True, None, None, 0.0)}["stream"]
    tiny = replace(stream, sessions=2, requests=8, duration_s=1.0, one_turn=True)
    options = ab.Options((REPO, REPO), "completions", tiny, rounds=2, timeout_s=60, dialect="sglang")
    sides = await ab.measure(options, Console(file=io.StringIO()))
    assert [side.errors for side in sides] == [0, 0]
    assert [len(side.units) for side in sides] == [2, 2]  # every run measured, in both checkouts
    assert ab.replica_arguments("sglang")[:2] == ("--dialect", "sglang")
    out = io.StringIO()
    ab.report(Console(file=out, width=200), options, sides)
    assert "÷ first" in out.getvalue() and str(REPO) in out.getvalue()


async def test_both_checkouts_loaded_at_once() -> None:
    """`--together`: each round loads both gateways in the same moments; every run is still measured on its own."""
    short = {w.name: w for w in ab.workloads(True, None, None, 0.0)}["short-c64"]
    tiny = replace(short, sessions=4, requests=400, duration_s=2.0)
    options = ab.Options((REPO, REPO), "generate", tiny, rounds=2, timeout_s=60, together=True)
    sides = await ab.measure(options, Console(file=io.StringIO()))
    assert [side.errors for side in sides] == [0, 0]
    assert [len(side.units) for side in sides] == [2, 2] and all(u > 0 for side in sides for u in side.units)
    out = io.StringIO()
    ab.report(Console(file=out, width=200), options, sides)
    assert "paired ÷ first" in out.getvalue()


def test_a_side_that_read_no_cpu_tick_is_reported_without_a_ratio() -> None:
    """/proc counts CPU in 10 ms ticks: a short run on a quick host can read 0; the report says so, not crash."""
    short = {w.name: w for w in ab.workloads(True, None, None, 0.0)}["short-c64"]
    options = ab.Options((REPO, REPO), "generate", short, rounds=2, timeout_s=60)
    sides = [ab.Side(REPO, units=[0.0, 0.0]), ab.Side(REPO, units=[0.1, 0.0])]
    out = io.StringIO()
    ab.report(Console(file=out, width=200), options, sides)
    assert "—" in out.getvalue() and "nan" in out.getvalue()  # no ratio to a zero; no paired round either


def test_the_paired_ratio_is_the_median_of_each_rounds_ratio() -> None:
    # The medians' ratio would be 2.0 / 1.5; each round says the second side costs 1.1 to 1.3 times the first.
    assert ab.paired_ratio([1.0, 2.0, 3.0], [1.1, 2.4, 3.9]) == pytest.approx(1.2)
    assert ab.paired_ratio([1.0, 0.0], [2.0, 5.0]) == pytest.approx(2.0)  # a round without a figure is left out


async def test_a_setting_of_the_second_side_reaches_its_gateway_only() -> None:
    """`--set-b`: the same checkout twice, the second under a limit its requests exceed, so only its runs fail."""
    short = {w.name: w for w in ab.workloads(True, None, None, 0.0)}["short-c64"]
    tiny = replace(short, sessions=4, requests=20, duration_s=1.0, min_tokens=2, max_tokens=4)
    options = ab.Options((REPO, REPO), "generate", tiny, 1, 60, env_b=(("RG_SERVER__MAX_TOKENS_LIMIT", "1"),))
    sides = await ab.measure(options, Console(file=io.StringIO()))
    assert (sides[0].errors, len(sides[0].units)) == (0, 1)
    assert sides[1].errors >= 20 and not sides[1].units  # every request refused (the warm-up's too)
    assert sides[1].name.endswith("RG_SERVER__MAX_TOKENS_LIMIT=1")
    assert "RG_SERVER__MAX_TOKENS_LIMIT" not in os.environ  # set only while the second gateway started


def test_a_setting_must_name_a_variable() -> None:
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        ab.main([str(REPO), str(REPO), "--set-b", "RG_GENERATION__STREAM_PACING_S"])


def test_a_one_turn_load_names_no_session() -> None:
    spec = Spec(["http://127.0.0.1:1"], 1, 1, 0, 1, 1, 1, stream=False, api="generate", one_turn=True)
    alone = LoadGen(spec)
    assert alone.headers("s-1") == {}
    assert "session_id" not in orjson.loads(alone.body("s-1", [("user", "hello there")], 4))
    named = LoadGen(replace(spec, one_turn=False))
    assert named.headers("s-1") == {"X-Session-ID": "s-1", "X-SMG-Routing-Key": "s-1"}
    assert orjson.loads(named.body("s-1", [("user", "hello there")], 4))["session_id"] == "s-1"


def test_prompt_words_make_the_prompts_longer() -> None:
    args = ab.build_parser().parse_args([".", ".", "--workload", "short-c1", "--prompt-words", "1000", "--one-turn"])
    workload = ab.chosen_workload(args)
    assert (workload.prompt_words, workload.one_turn, workload.sessions) == (1000, True, 1)
    assert workload.name == "short-c1, one-turn, 1000-word prompts"
    assert ab.chosen_workload(ab.build_parser().parse_args([".", "."])).prompt_words == 16
