"""The dashboard's time series: the mergeable points and ring, and the feed of `/dashboard/state` over real
gateways (one, and two sharing one Redis), after turns, a weight update, a failed one and finished sessions."""

from __future__ import annotations

import asyncio
import glob
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

from backends.sim.engine import EngineSettings
from gateway.dashboard.sampler import DashboardSampler
from gateway.dashboard.timeseries import LatencyHistogram, Ring, empty_point
from gateway.embedded_redis import EmbeddedRedis
from gateway.generation import Generator
from gateway.routing import ReplicaPool
from gateway.server import RunningGateway
from gateway.store import Keys, connect
from gateway.trainer import TrajectoryConsumer
from gateway.weights import WeightCoordinator
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, publish, stream_generate
from tests.sim_helpers import wait_for

PROMPT = [11, 22, 33, 44, 55]
LONG_PROMPT = list(range(100, 140))  # two full cache blocks of 16 tokens


def test_latency_histogram_quantiles_are_bucket_upper_bounds() -> None:
    h = LatencyHistogram()
    assert h.quantile(0.5) is None
    for seconds in [0.01] * 98 + [1.0, 2.0]:
        h.observe(seconds)
    p50, p99 = h.quantile(0.5), h.quantile(0.99)
    assert p50 is not None and 0.01 <= p50 < 0.01 * 1.2  # 2^(1/4) apart: within 19% above
    assert p99 is not None and 1.0 <= p99 < 1.2
    merged = LatencyHistogram(dict(h.counts))
    merged.add({LatencyHistogram.bucket(5.0): 100})
    assert merged.total == 200 and merged.quantile(0.99) is not None and merged.quantile(0.99) >= 5.0  # type: ignore[operator]


def test_ring_merges_points_of_a_second_and_drops_what_leaves_the_window() -> None:
    ring = Ring(window_s=10)
    for worker, turns in (("a", 3), ("b", 4)):
        point = empty_point(100) | {"w": worker, "n": {"turns": turns}, "g": {"in_flight": 2}, "x": {"pending": 7}}
        point["r"] = {"r1": {"healthy": 1, "in_flight": 1, "tokens": 5, "version": turns, "open": 0}}
        ring.merge(point)
    (merged,) = ring.points()
    assert merged["n"]["turns"] == 7 and merged["g"]["in_flight"] == 4 and merged["x"]["pending"] == 7
    assert merged["r"]["r1"] == {"healthy": 1, "in_flight": 2, "tokens": 10, "version": 4, "open": 0}
    ring.merge(empty_point(105))
    ring.merge(empty_point(111))  # 100 is now more than 10 s old
    assert [p["t"] for p in ring.points()] == [105, 111]
    ring.merge(empty_point(90))  # late and outside the window: dropped
    assert len(ring) == 2


async def _state(http: httpx.AsyncClient, gw: RunningGateway) -> dict[str, Any]:
    response = await http.get(f"{gw.url}/dashboard/state")
    assert response.status_code == 200
    return dict(response.json())


async def _until(http: httpx.AsyncClient, gw: RunningGateway, check: Any, what: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def holds() -> bool:
        seen.update(await _state(http, gw))
        return bool(check(seen))

    await wait_for(holds, timeout=15.0, what=what)
    return seen


async def test_the_feed_shows_turns_an_update_and_a_finished_sessions_reward(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005, block_size=16)) for _ in range(2)]
    gw = await make_gateway(sims)
    dashboard = gw.services.dashboard
    assert dashboard is not None
    await dashboard.scrape_caches()  # the engines' prefix cache counters before (the sampler reads them every 5 s)
    for session in ("a", "b", "c"):
        body = generate_body(LONG_PROMPT, 12, session_id=session)
        assert (await http.post(f"{gw.url}/generate", json=body)).status_code == 200
    progress = [0]
    task = asyncio.create_task(
        stream_generate(http, gw.url, generate_body(LONG_PROMPT, 200, session_id="long"), progress)
    )
    await wait_for(lambda: progress[0] >= 30, what="tokens before the update")
    assert (await publish(http, gw.url, 1)).status_code == 200
    streamed = await task
    assert streamed.error is None and streamed.final["num_resumes"] >= 1
    finished = await http.post(f"{gw.url}/v1/sessions/long/finish", json={"reward": 0.75})
    assert finished.status_code == 200 and finished.json()["delivered"]
    completion = gw.services.generator.completion_tokens_total
    await dashboard.scrape_caches()  # and after: the next tick carries what they grew by

    state = await _until(
        http,
        gw,
        lambda s: (
            sum(s["series"]["turns"]) == 4
            and sum(s["series"]["tokens"]) == completion
            and s["reward"]
            and any(rate is not None for c in s["replica_series"].values() for rate in c["cache_hit_rate"])
        ),
        "turns, tokens, the reward and the prefix cache in the feed",
    )
    series = state["series"]
    assert len(series["t"]) == len(series["turns"]) == len(series["latency_p99"]) and series["t"] == sorted(series["t"])
    assert sum(series["delivered"]) == 1 and max(series["version"]) == 1
    assert any(p is not None for p in series["latency_p50"]) and any(p is not None for p in series["ttft_p99"])
    # A page that has the earlier seconds asks for the newest only; the whole-window parts come every time.
    newest = series["t"][-1]
    recent = (await http.get(f"{gw.url}/dashboard/state", params={"since": newest})).json()
    assert recent["series"]["t"] and recent["series"]["t"][0] == newest and recent["timeline"] == state["timeline"]
    assert all(len(column) == len(recent["series"]["t"]) for column in recent["series"].values())
    (update,) = state["timeline"]
    assert (update["version"], update["mode"], update["status"]) == (1, "abort", "updated")
    assert update["started_at"] <= update["paused_at"] <= update["loaded_at"] <= update["finished_at"]
    assert update["preemptions"] >= 1  # the long stream was cut by it
    # The long session's tokens came from versions 0 and 1: its reward counts for its newest version, and its
    # sample's oldest token is one version behind the version serving at delivery.
    assert state["reward"] == [{"version": 1, "mean": 0.75, "sessions": 1}]
    assert state["staleness"] == {"1": 1}
    assert sorted((e["session_id"], e["turns"]) for e in state["top_sessions"]) == [
        ("a", 1),
        ("b", 1),
        ("c", 1),
        ("long", 1),
    ]
    assert set(state["replica_series"]) == {r.id for r in gw.services.pool.all()}
    assert sum(sum(columns["tokens"]) for columns in state["replica_series"].values()) == completion
    for columns in state["replica_series"].values():
        assert len(columns["t"]) == len(columns["in_flight"]) == len(columns["cache_hit_rate"])
        assert set(columns["healthy"]) == {1}
    # The prompt repeats across sessions and a resumed request re-sends its own prefix: the caches hit.
    rates = [rate for c in state["replica_series"].values() for rate in c["cache_hit_rate"] if rate is not None]
    assert max(rates) > 0 and all(0 <= rate <= 1 for rate in rates)


async def test_a_failed_update_is_marked_in_the_timeline(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm", weights_must_exist=True)])
    assert (await publish(http, gw.url, 1)).status_code == 502
    state = await _until(http, gw, lambda s: s["timeline"], "the failed update in the timeline")
    (update,) = state["timeline"]
    assert (update["version"], update["status"], update["errors"]) == (1, "failed", 1)
    assert state["version"] == 0


async def test_two_gateways_on_one_redis_each_show_the_whole_cluster(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("vllm")]
    first, second = await make_gateway(sims), await make_gateway(sims)
    for n, (gw, turns) in enumerate(((first, 2), (second, 3))):
        for i in range(turns):
            body = generate_body(PROMPT, 5, session_id=f"g{n}-{i}")
            assert (await http.post(f"{gw.url}/generate", json=body)).status_code == 200
    for gw in (first, second):
        state = await _until(
            http, gw, lambda s: sum(s["series"]["turns"]) == 5, "both processes' turns in each one's feed"
        )
        assert sum(state["series"]["tokens"]) == 25


async def test_the_backlog_shows_unacknowledged_and_reclaimed_entries(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: EmbeddedRedis
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 4, session_id="ep"))).status_code == 200
    assert (await http.post(f"{gw.url}/v1/sessions/ep/finish", json={"reward": 1.0})).status_code == 200
    async with (
        TrajectoryConsumer(redis_server.url, "trainers", "t0") as first,
        TrajectoryConsumer(redis_server.url, "trainers", "t1", claim_idle_s=0) as second,
    ):
        assert len((await first.next_batch(4, timeout=5)).trajectories) == 1  # read, never acknowledged
        batch = await second.next_batch(4, timeout=5)
        assert len(batch.trajectories) == 1  # reclaimed from t0 at once

        def backlog(s: dict[str, Any]) -> bool:
            series = s["series"]
            last = [series[name][-1] for name in ("pending", "unacked", "reclaimed_total")] if series["t"] else []
            return last == [1, 1, 1]

        await _until(http, gw, backlog, "pending, unacknowledged and reclaimed entries in the feed")
        await second.ack(batch)

        def consumed(s: dict[str, Any]) -> bool:
            series = s["series"]
            return series["unacked"][-1] == series["pending"][-1] == 0 and sum(c or 0 for c in series["consumed"]) == 1

        await _until(http, gw, consumed, "the acknowledged entry in the feed")


async def test_with_redis_unreachable_a_process_charts_what_it_sees(unused_tcp_port: int) -> None:
    pool = ReplicaPool()
    weights = WeightCoordinator(pool)
    generator = Generator(pool, weights)
    client = connect(f"redis://127.0.0.1:{unused_tcp_port}", socket_timeout_s=0.5)  # nothing listens there
    sampler = DashboardSampler(pool, weights, generator, client, Keys())
    try:
        generator.completion_tokens_total += 7  # as a turn would have counted them
        await sampler.tick(int(time.time()) - 1)  # Redis refuses: logged, the point still counts
        feed = sampler.feed()
        assert feed["series"]["tokens"] == [7] and feed["series"]["pending"] == [None]
    finally:
        await client.aclose()


def test_the_package_data_ships_every_dashboard_asset() -> None:
    """The page and vendored uPlot are package data (an installed gateway serves them): setuptools globs these
    patterns from the package folder, so every file under assets/dashboard must match one."""
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gateway"]
    shipped = {path for pattern in patterns for path in glob.glob(pattern, root_dir=root / "gateway")}
    assets = {
        str(path.relative_to(root / "gateway"))
        for path in (root / "gateway" / "assets" / "dashboard").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert {"assets/dashboard/index.html", "assets/dashboard/vendor/uPlot.iife.min.js"} <= assets
    assert assets <= shipped, assets - shipped
