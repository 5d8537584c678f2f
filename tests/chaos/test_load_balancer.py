"""Three gateways behind HAProxy, one killed and restarted mid-run (marker `chaos`; tests/chaos/load_balancer.py).
Skips without the `haproxy` binary (Debian's package `haproxy`; .ci/run installs it). `RG_LB_SEED` replays a run."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway.embedded_redis import EmbeddedRedis
from rollout_cli.redis_cluster import LocalRedisCluster
from tests.chaos.load_balancer import LoadBalancerOptions, LoadBalancerSoak

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(
        shutil.which("haproxy") is None, reason="haproxy is not on PATH (Debian: apt-get install haproxy)"
    ),
]


# The agents' client is cut mid-stream when a gateway dies: an unclosed socket may be collected later, as in the
# chaos soak (tests/chaos/test_soak.py). Only unclosed sockets and transports are let through.
@pytest.mark.filterwarnings(r"ignore:Exception ignored in. <socket\.socket:pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <function _SelectorTransport\.__del__:pytest.PytestUnraisableExceptionWarning"
)
@pytest.mark.timeout(240)
# On a Redis Cluster (3 masters with a replica each, 3 stream partitions) by default; RG_LB_REDIS=single runs it on
# the embedded single server, RG_LB_REDIS=single,cluster on both. On the cluster one master is SIGKILLed mid-run
# (RG_LB_MASTER_KILL=0: not).
@pytest.mark.parametrize("redis_kind", os.environ.get("RG_LB_REDIS", "cluster").split(","))
async def test_gateways_behind_haproxy(
    redis_server: EmbeddedRedis, redis: Redis, tmp_path: Path, redis_kind: str
) -> None:
    options = LoadBalancerOptions(seed=int(os.environ.get("RG_LB_SEED", "11")))
    killing = redis_kind == "cluster" and os.environ.get("RG_LB_MASTER_KILL", "1") == "1"
    print(f"load-balancer soak on {redis_kind} Redis, seed {options.seed} (replay: RG_LB_SEED={options.seed})")
    with contextlib.ExitStack() as stack:
        if redis_kind == "cluster":
            cluster = stack.enter_context(LocalRedisCluster(data_dir=tmp_path / "cluster"))
            report = await LoadBalancerSoak(options, cluster.url, tmp_path, cluster, kill_a_master=killing).run()
        else:
            report = await LoadBalancerSoak(options, redis_server.url, tmp_path).run()  # `redis` emptied it
    gc.collect()  # a socket the run leaked is reported here, not in whichever test runs next
    print(report.lb_figures())
    for violation in report.violations[:20]:
        print("  violation:", violation)
    assert not report.violations, report.lb_figures()
    # Every episode finished, and the trainer got each one exactly once, token ids exact (judge_delivery).
    assert report.sessions_acked == options.sessions
    assert report.delivered == options.sessions and report.lost == 0 and report.duplicated == 0
    # The agents saw at most a retried turn: one failed attempt in a turn, one such turn in a session, and only
    # attempts in flight on the gateway when it died (later ones HAProxy sends elsewhere).
    assert report.most_failures_in_a_turn <= 1 and report.most_retried_turns_in_a_session <= 1
    assert report.failed_attempts_after_kill == 0
    # The kill happened, HAProxy took the gateway out and back, and updates went on after its return.
    assert report.gateway_kills == 1 and report.back_in_rotation_s is not None
    assert report.redis_restarts == int(killing)
    assert report.updates >= options.min_updates
    # Updates reached several gateways through HAProxy and all three ended on the last version.
    assert len(report.updates_by_gateway) >= 2
    assert set(report.final_versions.values()) == {report.updates}
    assert report.samples_spanning_updates >= 1
