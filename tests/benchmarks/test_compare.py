"""Smoke test of `benchmarks.compare`: its whole machinery at a trivial size (correctness only, no timings)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from benchmarks.compare import (
    AGENT_ROUTES,
    AGENT_WORKLOADS,
    Options,
    agent_checks,
    figures,
    place_processes,
    report,
    router_command,
    run_all,
    workloads,
)
from benchmarks.litellm_target import litellm_missing

pytestmark = pytest.mark.timeout(60)


def tiny_options(targets: tuple[str, ...]) -> Options:
    by_name = {w.name: w for w in workloads(True, None, None, 0.0)}
    chosen = (
        replace(by_name["stream"], sessions=2, requests=2, min_tokens=8, max_tokens=8),
        replace(by_name["multiturn"], sessions=3, turns=3),
    )
    return Options(targets, chosen, rounds=1, timeout_s=30.0, pin=False, json_path=None)


async def test_direct_and_gateway_end_to_end() -> None:
    options = tiny_options(("direct", "gateway"))
    results = await run_all(options, Console(file=io.StringIO()))
    for name in ("direct", "gateway"):
        stream, multi = (results[w.name][name] for w in options.workloads)
        assert (stream.ok, stream.errors, stream.tokens, stream.error_samples) == (2, 0, 16, [])
        assert len(stream.ttfts) == 2
        assert (multi.ok, multi.errors) == (9, 0)
        # Every turn seen by the replicas, attributed to its session; 2 follow-up turns per session.
        assert sum(multi.per_replica) == 9 and multi.pairs == 6
        assert multi.cache_queries > 0
    assert results["multiturn"]["direct"].same == 6  # direct hashes each session to one replica
    assert results["multiturn"]["gateway"].same == 6  # the gateway's sticky routing
    assert results["multiturn"]["gateway"].cpu_proxy_s > 0
    assert figures(results["multiturn"]["gateway"], results["multiturn"]["direct"])["affinity"] == 1.0
    out = io.StringIO()
    report(Console(file=out, width=200), options, results)
    assert "multiturn" in out.getvalue() and "gateway" in out.getvalue()


def agent_options(targets: tuple[str, ...]) -> Options:
    """The agent workloads, whole and streamed, at 3 sessions × 3 turns."""
    by_name = {w.name: w for w in workloads(True, None, None, 0.0)}
    chosen = tuple(replace(by_name[name], sessions=3, turns=3, min_tokens=4, max_tokens=8) for name in AGENT_WORKLOADS)
    return Options(targets, chosen, rounds=1, timeout_s=30.0, pin=False, json_path=None)


async def test_agent_sessions_on_the_gateways_protocol_routes_and_as_completions() -> None:
    """Every turn of every session answered in full on the gateway's chat, Messages and Responses routes (also
    chained by `previous_response_id`) and (with the replies echoed in the prompt) on /v1/completions; the replicas
    attribute each turn to its session through the chat template's preamble, and the gateway keeps each session on
    one replica."""
    options = agent_options(("direct", "gateway", *AGENT_ROUTES))
    results = await run_all(options, Console(file=io.StringIO()))
    for workload in AGENT_WORKLOADS:
        for name, run in results[workload].items():
            assert (run.ok, run.errors, run.error_samples) == (9, 0, []), (workload, name)
            assert 9 * 4 <= run.tokens <= 9 * 8
            assert (sum(run.per_replica), run.pairs, run.same) == (9, 6, 6), (workload, name)
    assert all(len(results["agent-stream"][route].ttfts) == 9 for route in AGENT_ROUTES)
    checks = agent_checks(results)  # each other protocol against chat, for both workloads (no LiteLLM here)
    assert len(checks) == 2 * 3 and all("× gateway-chat" in line for line in checks)
    out = io.StringIO()
    report(Console(file=out, width=200), options, results)
    assert "agent-stream" in out.getvalue() and "gateway-chat" in out.getvalue()


@pytest.mark.skipif(litellm_missing() is not None, reason=f"{litellm_missing()}")
async def test_litellm_serves_every_agent_protocol() -> None:
    """LiteLLM's three routes (through the chat front to the replicas) answer every turn in full; it is not sticky,
    but every turn reaches a replica and is attributed to its session."""
    options = agent_options(("gateway-chat", "litellm-chat", "litellm-messages", "litellm-responses"))
    results = await run_all(options, Console(file=io.StringIO()))
    for workload in AGENT_WORKLOADS:
        for name, run in results[workload].items():
            assert (run.ok, run.errors, run.error_samples) == (9, 0, []), (workload, name)
            assert (sum(run.per_replica), run.pairs) == (9, 6), (workload, name)
            assert run.cpu_proxy_s > 0
    checks = agent_checks(results)
    assert len(checks) == 2 and all("gateway-chat" in line and "LiteLLM's" in line for line in checks)


@pytest.mark.skipif(
    router_command("vllm-consistent_hash") is None or router_command("sglang-manual") is None,
    reason="the Rust routers are not installed (pip install -e '.[bench]')",
)
async def test_rust_routers_end_to_end() -> None:
    options = tiny_options(("sglang-manual", "vllm-consistent_hash"))
    options = replace(options, workloads=options.workloads[1:])
    results = await run_all(options, Console(file=io.StringIO()))
    for run in results["multiturn"].values():
        assert (run.ok, run.errors, sum(run.per_replica), run.pairs) == (9, 0, 9, 6)
        assert run.same == 6  # both are sticky on the session header


async def test_python_relay_end_to_end() -> None:
    """The stack's floor row relays every stream and turn intact (it parses nothing, so a bad relay shows here)."""
    options = tiny_options(("python-relay",))
    results = await run_all(options, Console(file=io.StringIO()))
    stream, multi = (results[w.name]["python-relay"] for w in options.workloads)
    assert (stream.ok, stream.errors, stream.tokens, stream.error_samples) == (2, 0, 16, [])
    assert (multi.ok, multi.errors, sum(multi.per_replica), multi.pairs) == (9, 0, 9, 6)
    assert multi.same == 6  # sticky by a hash of the session header


def test_a_dedicated_layout_gives_every_process_cpus_of_its_own() -> None:
    where = place_processes("dedicated", loadgens=3, cpus=range(16))
    assert where.proxy is not None and len(where.replicas) == 2 and len(where.loadgens) == 3
    taken = [where.proxy, *where.replicas, *where.loadgens]
    assert all(cpus is not None and len(cpus) == 1 for cpus in taken)
    assert len(set().union(*taken)) == len(taken)  # no two processes share a CPU
    assert place_processes("auto", loadgens=3, cpus=range(16)) == where
    with pytest.raises(SystemExit, match="dedicated"):
        place_processes("dedicated", loadgens=3, cpus=(0, 1, 2))  # too few CPUs is refused, never crowded
    crowded = place_processes("auto", loadgens=3, cpus=(0, 1, 2))  # auto: the shared layout instead
    assert crowded.replicas[0] == crowded.replicas[1] == crowded.loadgens[0] and len(crowded.loadgens) == 1


async def test_several_load_generators_count_every_request_once() -> None:
    """`--layout dedicated` splits each workload over its load generators (here unpinned): the results sum to the
    same counts as one generator, sessions keep their replica, and a one-agent workload runs on one generator."""
    options = replace(tiny_options(("direct", "gateway")), layout="dedicated", loadgens=2, cpus=tuple(range(8)))
    single = replace({w.name: w for w in workloads(True, None, None, 0.0)}["short-c1"], requests=5)
    options = replace(options, workloads=(*options.workloads, single))
    results = await run_all(options, Console(file=io.StringIO()))
    for name in ("direct", "gateway"):
        stream, multi, one = (results[w.name][name] for w in options.workloads)
        assert (stream.ok, stream.errors, stream.tokens) == (2, 0, 16)
        assert (multi.ok, multi.errors, sum(multi.per_replica), multi.pairs, multi.same) == (9, 0, 9, 6, 6)
        assert (one.ok, one.errors) == (5, 0)
