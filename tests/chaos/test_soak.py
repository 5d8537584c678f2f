"""The chaos soak (marker `chaos`). The default run is the bounded CI variant; `RG_CHAOS_SESSIONS`,
`RG_CHAOS_DURATION_S` and `RG_CHAOS_SEED` scale it up or replay it; `RG_CHAOS_PREFIX_CACHE=0` turns the
simulators' prefix cache off."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from tests.chaos.soak import Soak, SoakOptions

pytestmark = pytest.mark.chaos


# In some runs a socket is garbage-collected unclosed: one traced to the soak's own client (httpx over anyio,
# toward the gateway, cancelled mid-connect by a simulated disconnect), and one seen toward a SIGKILLed replica
# whose origin is not traced (see docs/reliability.md). Only unclosed sockets and transports are let through, and
# only here; any other unraisable exception still fails the soak.
@pytest.mark.filterwarnings(r"ignore:Exception ignored in. <socket\.socket:pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <function _SelectorTransport\.__del__:pytest.PytestUnraisableExceptionWarning"
)
@pytest.mark.timeout(int(os.environ.get("RG_CHAOS_DURATION_S", "150")) + 240)
# On the embedded single server (restarted once); RG_CHAOS_REDIS=cluster (or single,cluster) runs it on a Redis
# Cluster (a master SIGKILLed, its replica promoted). The default suite meets a master's death in the load-balancer
# soak (tests/chaos/test_load_balancer.py), which runs on a cluster.
@pytest.mark.parametrize("redis", os.environ.get("RG_CHAOS_REDIS", "single").split(","))
async def test_chaos_soak(tmp_path: Path, redis: str) -> None:
    options = SoakOptions(
        redis=redis,
        seed=int(os.environ.get("RG_CHAOS_SEED", "7")),
        sessions=int(os.environ.get("RG_CHAOS_SESSIONS", "300")),
        duration_s=float(os.environ.get("RG_CHAOS_DURATION_S", "150")),
        prefix_cache=os.environ.get("RG_CHAOS_PREFIX_CACHE", "1") == "1",
    )
    print(f"chaos soak, seed {options.seed} (replay: RG_CHAOS_SEED={options.seed})")
    soak = Soak(options, tmp_path / "redis")
    report = await soak.run()
    # Collect now, inside this test: a socket the soak leaked is otherwise reported by whichever later test the
    # collector happens to run in (seen in CI: an unrelated engine test failed on a socket toward a soak replica).
    gc.collect()
    print(report.figures())
    for error, count in soak.trainer_errors.most_common(5):
        print(f"  trainer error x{count}: {error}")
    for violation in report.violations[:20]:
        print("  violation:", violation)
    assert not report.violations, report.figures()
    assert report.lost == 0 and report.duplicated == 0
    assert report.sessions_acked == options.sessions  # every episode finished within the bound
    assert report.updates >= options.min_updates and report.kills >= options.min_kills
    assert report.hangs >= options.min_hangs and report.slow_readers >= 1 and report.oversized_headers >= 1
    assert report.redis_restarts == 1 and report.gateway_kills == 1 and report.disconnects >= 1
    assert report.resumes >= 1 and report.samples_spanning_updates >= 1
    # The hostile clients met their limits: trickled bodies got 408, tool floods 400 (else a violation above), and
    # never-read streams passed the process-wide budget (the gateways' counts, from their /metrics).
    assert report.trickled_bodies["408"] >= options.min_trickled and report.tool_floods >= options.min_tool_floods
    assert report.slow_clients_cut["budget"] >= options.min_budget_cuts
