"""Smoke test of `benchmarks.routing`: its whole machinery at the smallest size (correctness only, no timings): every
turn and every group member answered, the engines' counters read around each run, the table and the verdicts."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from benchmarks.compare import router_command
from benchmarks.routing import Capacity, Options, figures, report, run_all

pytestmark = pytest.mark.timeout(90)


ROUTERS = ("sglang-cache_aware", "vllm-consistent_hash")
INSTALLED = tuple(name for name in ROUTERS if router_command(name) is not None)


def tiny(targets: tuple[str, ...]) -> Options:
    """2 replicas, both workloads at low load: 2 agents for 1 s, one burst of one group of 8; short prompts, fast
    replicas."""
    return Options(
        replicas=2,
        workloads=("agentic", "grpo"),
        loads=("low",),
        targets=targets,
        rounds=1,
        duration_s=1.0,
        bursts=1,
        system_words=60,
        group_words=60,
        timeout_s=30.0,
        pin=False,
        capacity=Capacity(token_delay_s=0.0005, per_seq_delay_s=0.0001),
    )


async def test_our_policies_and_the_routers_end_to_end() -> None:
    """Every turn and group member answered through two of our policies and (where installed) two routers; the
    engines' counters read around each run; a GRPO group kept on one replica by our `together` placement and by a
    hashing router given the group id as its key, its prompt prefilled once."""
    options = tiny(("rg-sticky", "rg-cache_aware", *INSTALLED))
    results = await run_all(options, Console(file=io.StringIO()))
    assert set(results) == {("agentic", "low"), ("grpo", "low")}
    for (workload, _), runs in results.items():
        assert set(runs) == set(options.targets)
        for name, run in runs.items():
            values = figures(run)
            assert (run.errors, run.error_samples) == (0, []), (workload, name)
            assert 0.0 <= values["hit"] <= 1.0, (workload, name)
            assert run.cache_queries > 0 and sum(run.per_replica) == run.ok, (workload, name)
            assert run.cpu_proxy_s > 0, (workload, name)
            if workload == "agentic":
                assert run.ok >= 2  # each agent's turns, one after the other
            else:
                assert run.ok == 8 and len(run.group_times) == 1  # every member answered, the group timed
    for name in ("rg-sticky", "rg-cache_aware", "vllm-consistent_hash"):
        if name in options.targets:
            run = results[("grpo", "low")][name]
            assert sorted(run.per_replica) == [0, 8], name  # the group on one replica: 7 members hit its prompt
            assert figures(run)["hit"] > 0.6, name
    out = io.StringIO()
    report(Console(file=out, width=250), options, results)
    text = out.getvalue()
    assert "agentic, low load" in text and "grpo, low load" in text
    assert all(name in text for name in options.targets)
    assert "no policy of ours worse than rg-sticky" in text
    if INSTALLED:
        assert "prefix hit ≥ best router's" in text and "group p50 ≤ 0.8× best router's" in text
