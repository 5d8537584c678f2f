"""Smoke tests of `benchmarks.fleet` at a trivial size (correctness, no timings): every part runs end to end, turns
succeed across weight updates, the trainer reads every trajectory written, and the tables print."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import orjson
import pytest
from rich.console import Console

from benchmarks import fleet
from benchmarks.fleet import Options, measure, report, write_json
from benchmarks.sim_fleet import SimFleet
from gateway.store import keys

pytestmark = pytest.mark.timeout(240)

TINY = Options(
    gateways=(1, 2),
    replicas=4,
    per_host=2,
    sessions=6,
    duration_s=2.5,
    update_every_s=0.8,
    trajectories=12,
    expert_layers=4,
    top_k=2,
    batch=5,
    timeout_s=90.0,
)


def test_a_sim_fleet_serves_many_replicas_from_few_processes() -> None:
    with SimFleet(2, 3, ["--dialect", "vllm"]) as sims:
        assert len(sims.pids) == 2 and len(set(sims.urls)) == 6
        for url in sims.urls:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert sims.processes == []


async def test_a_small_fleet_end_to_end(tmp_path: Path) -> None:
    results = await measure(TINY, Console(file=io.StringIO()))
    assert results.failures == []
    assert [row.gateways for row in results.rows] == [1, 2]
    for row in results.rows:
        assert row.errors == 0, row.error_samples
        assert row.ok > 0 and row.updates >= 1 and len(row.update_s) == row.updates
        assert row.cpu_gateways_s > 0 and row.cpu_redis_s > 0 and len(row.rss_after_mib) == row.gateways
    # Turns were in flight at the updates: aborted, then dispatched again by the gateways.
    assert sum(row.dispatch.count for row in results.rows if row.dispatch is not None) > 0
    plain, experts = results.store
    assert (plain.experts, experts.experts) == ("none", "4 × 2")
    for store in results.store:
        assert store.read == TINY.trajectories and store.error == ""
    assert experts.key_bytes > plain.key_bytes
    out = io.StringIO()
    report(Console(file=out, width=260), TINY, results)
    text = out.getvalue()
    assert "1 gw · 1 Redis" in text and "2 gw · 1 Redis" in text
    assert "resume dispatch p99" in text and "into the trainer" in text and "Sizing figures" in text
    assert "not measured" not in text
    write_json(tmp_path / "fleet.json", TINY, results)
    written = orjson.loads((tmp_path / "fleet.json").read_bytes())
    assert len(written["rows"]) == 2 and written["rows"][0]["figures"]["turns_s"] > 0


@pytest.mark.skipif(not hasattr(keys, "is_cluster_url"), reason="this branch's store cannot use a Redis Cluster yet")
async def test_the_cluster_setup_measures_the_same() -> None:
    options = Options(
        gateways=(1,),
        replicas=2,
        per_host=2,
        sessions=4,
        duration_s=2.0,
        update_every_s=0.8,
        redis="cluster",
        masters=(3,),
        trajectories=6,
        expert_layers=0,
        timeout_s=90.0,
    )
    results = await measure(options, Console(file=io.StringIO()))
    assert results.failures == []
    [row] = results.rows
    assert row.setup == "cluster, 3 masters" and row.errors == 0 and row.ok > 0
    [store] = results.store
    assert store.read == options.trajectories


def test_settings_that_cannot_run_are_refused() -> None:
    for argv in (["--sessions", "0"], ["--duration", "0"], ["--trajectory-tokens", "2"], ["--masters", "0"]):
        with pytest.raises(SystemExit):
            fleet.main(argv)
