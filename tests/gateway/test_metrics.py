"""Observability: `/metrics` over a real gateway, the status page and its JSON feed, and a headless-browser check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from backends.sim.engine import EngineSettings
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.errors import StoreError
from gateway.generation import Generator
from gateway.metrics import ContextFormatter, GatewayMetrics
from gateway.routing import ReplicaPool
from gateway.server import RunningGateway
from gateway.session.samples import SessionManager
from gateway.store import Keys, StoreStats
from gateway.tokenization import ChatTokenizer
from gateway.weights import UpdateReport, WeightCoordinator
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, publish, scrape, stream_generate, value
from tests.sim_helpers import wait_for

PROMPT = [11, 22, 33, 44, 55]
CHROMIUM = "/usr/bin/chromium"


async def two_replica_gateway(
    make_sim: SimFactory, make_gateway: GatewayFactory, delay: float, **sections: Any
) -> RunningGateway:
    sims = [
        await make_sim("vllm", engine=EngineSettings(token_delay_s=delay, block_size=16)),
        await make_sim("sglang", engine=EngineSettings(token_delay_s=delay, block_size=1)),
    ]
    return await make_gateway(sims, **sections)


async def test_metrics_after_generation_and_an_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await two_replica_gateway(make_sim, make_gateway, delay=0.002)
    returned = 0
    for session in ("a", "a", "b"):  # "a" twice: its second turn follows the first (affinity)
        response = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 20, session_id=session))
        assert response.status_code == 200
        returned += len(response.json()["output_ids"])

    progress = [0]
    body = generate_body(PROMPT, 300, session_id="long")
    task = asyncio.create_task(stream_generate(http, gw.url, body, progress))
    await wait_for(lambda: progress[0] >= 100, what="tokens before the update")
    assert (await publish(http, gw.url, 1)).status_code == 200
    streamed = await task
    assert streamed.error is None and streamed.final["num_resumes"] >= 1
    returned += len(streamed.output_ids)

    # A one-session chat turn, finished: one trajectory waits for the trainer (`rg:pending:sessions` holds it).
    chat = await http.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
        headers={"x-session-id": "episode-1"},
    )
    assert chat.status_code == 200
    usage = chat.json()["usage"]
    returned += usage["completion_tokens"]
    assert (await http.post(f"{gw.url}/v1/sessions/episode-1/finish", json={"reward": 1.0})).status_code == 200
    assert (await http.get(f"{gw.url}/no/such/path")).status_code == 404

    m = await scrape(http, gw.url)
    requests = "rollout_gateway_requests_total"
    assert value(m, requests, route="/generate", status="200") == 4
    assert value(m, requests, route="/admin/weights", status="200") == 1
    assert value(m, requests, route="/v1/chat/completions", status="200") == 1
    assert value(m, requests, route="/v1/sessions/{session_id}/finish", status="200") == 1  # the template
    assert value(m, requests, route="unmatched", status="404") == 1
    assert value(m, "rollout_gateway_tokens_total", kind="completion") == returned
    assert value(m, "rollout_gateway_tokens_total", kind="prompt") == 4 * len(PROMPT) + usage["prompt_tokens"]
    assert value(m, "rollout_gateway_weight_version") == 1
    assert value(m, "rollout_gateway_weight_update_seconds_count") == 1
    assert value(m, "rollout_gateway_weight_update_seconds_sum") > 0
    resumes = value(m, "rollout_gateway_resumes_total")
    assert resumes >= 1 and value(m, "rollout_gateway_preemptions_total") >= 1
    assert value(m, "rollout_gateway_resume_latency_seconds_count") == resumes  # every resume produced tokens
    assert value(m, "rollout_gateway_resume_latency_seconds_sum") > 0
    # Every preempted segment's continuation was sent once (no replica failed here).
    assert value(m, "rollout_gateway_resume_dispatch_seconds_count") == value(m, "rollout_gateway_preemptions_total")
    replicas = [r.id for r in gw.services.pool.all()]
    for replica in replicas:
        assert value(m, "rollout_gateway_in_flight", replica=replica) == 0
        assert value(m, "rollout_gateway_replica_healthy", replica=replica) == 1
    pending = int(await redis.scard(Keys().pending))
    assert pending == 1 and value(m, "rollout_gateway_store_pending") == pending
    affinity = value(m, "rollout_gateway_affinity_ratio")
    assert affinity == gw.services.pool.affinity.ratio and 0 < affinity <= 1
    # The chat turn's Redis round trips (session, sample, finish's pending check...) went through the batcher.
    pipelines, calls = value(m, "rollout_gateway_store_pipelines_total"), value(m, "rollout_gateway_store_calls_total")
    assert 1 <= pipelines <= calls <= gw.services.store.batcher.calls

    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    assert status["resumes_total"] == resumes and status["store_pending"] == pending
    assert status["tokens"]["completion"] == returned and status["affinity_ratio"] == affinity


async def test_in_flight_is_read_while_requests_run(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await two_replica_gateway(make_sim, make_gateway, delay=0.01)
    tasks = [
        asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200, session_id=f"s{i}")))
        for i in range(4)
    ]
    pool = gw.services.pool
    await wait_for(lambda: sum(r.in_flight for r in pool.all()) == 4, what="four streams under way")
    m = await scrape(http, gw.url)  # the streams run ~2 s: the scrape sees them all
    assert {r.id: value(m, "rollout_gateway_in_flight", replica=r.id) for r in pool.all()} == {
        r.id: r.in_flight for r in pool.all()
    }
    assert sum(value(m, "rollout_gateway_in_flight", replica=r.id) for r in pool.all()) == 4
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: all(r.in_flight == 0 for r in pool.all()), what="leases released")
    m = await scrape(http, gw.url)
    assert all(value(m, "rollout_gateway_in_flight", replica=r.id) == 0 for r in pool.all())


async def test_each_gateway_has_its_own_registry(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    first, second = await make_gateway([sim]), await make_gateway([sim])
    for _ in range(3):
        assert (await http.post(f"{first.url}/generate", json=generate_body(PROMPT, 4))).status_code == 200
    assert value(await scrape(http, first.url), "rollout_gateway_tokens_total", kind="completion") == 12
    samples = await scrape(http, second.url)
    assert value(samples, "rollout_gateway_tokens_total", kind="completion") == 0
    assert ("rollout_gateway_requests_total", (("route", "/generate"), ("status", "200"))) not in samples


class _Store:
    """A trajectory store stand-in whose pending count fails or hangs."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.batcher = types.SimpleNamespace(pipelines=0, calls=0)  # nothing sent: the counters `collect` reads
        self.stats = StoreStats()

    async def pending(self) -> int:
        if self.behaviour == "fail":
            raise StoreError("redis: read pending failed: connection refused")
        if self.behaviour == "hang":
            await asyncio.Event().wait()
        return 7


@pytest.mark.parametrize("behaviour", ["fail", "hang"])
async def test_store_pending_is_left_out_when_redis_does_not_answer(
    behaviour: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = ReplicaPool()
    weights = WeightCoordinator(pool)
    generator = Generator(pool, weights)
    metrics = GatewayMetrics(pending_timeout_s=0.05)
    store: Any = _Store("ok")
    metrics.bind(pool, weights, generator, store, SessionManager(ChatTokenizer.load(TINY_TOKENIZER_DIR), store))
    await metrics.refresh()
    assert metrics.store_pending == 7 and b"rollout_gateway_store_pending 7.0" in metrics.render()
    store.behaviour = behaviour
    with caplog.at_level(logging.WARNING, logger="gateway.metrics"):
        await metrics.refresh()
        await metrics.refresh()
    assert metrics.store_pending is None and b"rollout_gateway_store_pending" not in metrics.render()
    assert len(caplog.records) == 1  # the outage is logged once, not once per scrape
    assert b"rollout_gateway_weight_version 0.0" in metrics.render()  # the rest of the scrape still works


def test_hooks_record_updates_and_resumes() -> None:
    pool = ReplicaPool()
    weights = WeightCoordinator(pool)
    generator = Generator(pool, weights)
    metrics = GatewayMetrics()
    store: Any = _Store("ok")
    sessions = SessionManager(ChatTokenizer.load(TINY_TOKENIZER_DIR), store)
    metrics.bind(pool, weights, generator, store, sessions)
    assert generator.on_resume == metrics.observe_resume and weights.on_update == [metrics.observe_update]
    assert generator.on_dispatch == metrics.observe_dispatch
    metrics.observe_update(UpdateReport(1, "abort", updated=["r1"], duration_s=0.5))
    metrics.observe_update(UpdateReport(2, "abort", updated=["r1"]))  # out-of-band: no duration, nothing observed
    metrics.observe_update(UpdateReport(3, "abort", duration_s=0.5))  # failed (announced for the dashboard): not one
    generator.on_resume(0.2)
    generator.on_dispatch(0.01)
    text = metrics.render().decode()
    assert "rollout_gateway_weight_update_seconds_count 1.0" in text
    assert "rollout_gateway_resume_latency_seconds_count 1.0" in text
    assert "rollout_gateway_resume_dispatch_seconds_count 1.0" in text
    with pytest.raises(RuntimeError):
        metrics.bind(pool, weights, generator, store, sessions)


def test_log_records_carry_session_replica_and_version() -> None:
    formatter = ContextFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("gateway.generation", logging.WARNING, __file__, 1, "replica %s failed", ("r1",), None)
    record.__dict__.update(session_id="sess-1", replica="r1", version=3)
    assert formatter.format(record) == "WARNING replica r1 failed session_id=sess-1 replica=r1 version=3"
    plain = logging.LogRecord("gateway", logging.INFO, __file__, 1, "ready", (), None)
    assert formatter.format(plain) == "INFO ready"


async def test_dashboard_state_and_page(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await two_replica_gateway(make_sim, make_gateway, delay=0.0)
    assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 8, session_id="x"))).status_code == 200
    response = await http.get(f"{gw.url}/dashboard/state")
    assert response.status_code == 200
    state = response.json()
    assert set(state) >= {
        "version",
        "state",
        "replicas",
        "serving_replicas",
        "in_flight",
        "queue_depth",
        "resumes_total",
        "affinity_ratio",
    }
    assert (state["version"], state["state"], state["queue_depth"], state["in_flight"]) == (0, "serving", 0, 0)
    assert state["serving_replicas"] == 2 and state["tokens"]["completion"] == 8
    assert [r["id"] for r in state["replicas"]] == [r.id for r in gw.services.pool.all()]
    for replica in state["replicas"]:
        assert set(replica) == {"id", "healthy", "stale", "draining", "in_flight", "version"}  # no URLs, no secrets
        assert replica["healthy"] and not replica["stale"] and replica["in_flight"] == 0

    page = await http.get(f"{gw.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self';" in policy  # no inline script, nothing elsewhere
    assert "http://" not in page.text and "https://" not in page.text  # self-contained: assets from the gateway
    for asset, kind in (("uPlot.iife.min.js", "text/javascript"), ("uPlot.min.css", "text/css")):
        assert f'"dashboard/assets/{asset}"' in page.text
        served = await http.get(f"{gw.url}/dashboard/assets/{asset}")
        assert served.status_code == 200 and served.headers["content-type"].startswith(kind) and served.content
    script = await http.get(f"{gw.url}/dashboard/assets/dashboard.js")
    assert "fetch(" in script.text and "dashboard/state" in script.text and "http" not in script.text
    assert (await http.get(f"{gw.url}/dashboard/assets/..%2Fdashboard.py")).status_code == 404


METRICS = {"authorization": "Bearer m-tok-41"}


async def test_a_metrics_token_guards_metrics_and_the_dashboard_state(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """With `server.metrics_token`, `/metrics` and `/dashboard/state` need it (neither the admin token nor an API key
    opens them); the page itself holds no data and stays open."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], server={"metrics_token": "m-tok-41", "api_keys": ["agent-key"]})
    for path in ("/metrics", "/dashboard/state"):
        missing = await http.get(f"{gw.url}{path}")
        assert missing.status_code == 401, path
        assert missing.json()["error"]["type"] == "authentication_error"
        assert "m-tok-41" not in missing.text
        for wrong in ("nope", ADMIN["authorization"].removeprefix("Bearer "), "agent-key"):
            refused = await http.get(f"{gw.url}{path}", headers={"authorization": f"Bearer {wrong}"})
            assert refused.status_code == 403, (path, wrong)
        assert (await http.get(f"{gw.url}{path}", headers=METRICS)).status_code == 200, path
    assert "rollout_gateway_" in (await http.get(f"{gw.url}/metrics", headers=METRICS)).text
    page = await http.get(f"{gw.url}/dashboard")  # the page and its assets hold no data: open
    script = await http.get(f"{gw.url}/dashboard/assets/dashboard.js")
    assert page.status_code == 200 and script.status_code == 200 and "location.hash" in script.text


async def _chromium(*args: str, timeout: float = 60.0) -> bytes:
    """Run headless Chromium without blocking the event loop the gateway under test runs on."""
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise AssertionError(f"chromium did not finish within {timeout}s") from None
    assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
    return stdout


CHARTS = ("throughput", "latency", "versions", "backlog", "reward", "staleness", "sessions")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)")
@pytest.mark.parametrize("token", [None, "m-tok-41"])
async def test_dashboard_renders_in_headless_chromium(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, tmp_path: Path, token: str | None
) -> None:
    """A short demo-like run (turns, a weight update under load, a finished session with a reward), then the page
    in a real browser: every chart drew points, every replica its sparklines, and the page raised no error; with a
    metrics token, the one its URL's fragment carries."""
    gw = await two_replica_gateway(make_sim, make_gateway, delay=0.02, server={"metrics_token": token})
    auth = {"authorization": f"Bearer {token}"} if token else {}
    page = f"{gw.url}/dashboard" + (f"#token={token}" if token else "")
    progress = [0]
    tasks = [
        asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 150, session_id=f"s{i}"), progress))
        for i in range(5)
    ]
    try:
        await wait_for(lambda: progress[0] >= 50, what="streams under way")
        assert (await publish(http, gw.url, 1)).status_code == 200
        for streamed in await asyncio.gather(*tasks):  # each one resumed across the update
            assert streamed.error is None and streamed.final["num_resumes"] >= 1
        done = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 8, session_id="episode"))
        assert done.status_code == 200
        finished = await http.post(f"{gw.url}/v1/sessions/episode/finish", json={"reward": 0.5})
        assert finished.status_code == 200

        async def fed() -> bool:
            state = (await http.get(f"{gw.url}/dashboard/state", headers=auth)).json()
            return bool(state["reward"] and state["timeline"] and len(state["series"]["t"]) >= 3)

        await wait_for(fed, timeout=15.0, what="the feed to hold the update and the reward")
        common = [f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000", "--window-size=1400,1700"]
        dom = (await _chromium(*common, "--dump-dom", page)).decode()
        shot = tmp_path / "dash.png"
        if token is None:  # the picture once: the token changes nothing on it
            await _chromium(*common, f"--screenshot={shot}", page)
        detail_page = f"{gw.url}/dashboard#" + (f"token={token}&" if token else "") + "session=s0"
        detail = (await _chromium(*common, "--dump-dom", detail_page)).decode()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    errors = re.search(r'<span id="errors" data-count="(\d+)">([^<]*)</span>', dom)
    assert errors is not None and errors.group(1) == "0", errors and errors.group(2)
    status = re.search(r'<span id="status"[^>]*>([^<]*)</span>', dom)
    assert status is not None and status.group(1).startswith("live"), status
    for name in CHARTS:
        drawn = re.search(rf'id="chart-{name}"[^>]*data-points="(\d+)"', dom)
        assert drawn is not None and int(drawn.group(1)) > 0, f"chart {name} drew nothing"
        assert re.search(rf'id="chart-{name}"[^>]*>\s*<div class="uplot', dom), f"chart {name} is not a uPlot chart"
    assert re.search(r'id="chart-versions"[^>]*data-updates="1"', dom)
    assert re.search(r'<tr data-version="1" data-status="updated">', dom)
    link = r'href="#(?:token=[\w-]+&amp;)?session=episode"'
    assert re.search(rf'<tr data-session="episode"><td><a {link}>episode</a></td><td>1</td>', dom)
    # A session's detail: its sample with the per-token version strip, two segments (versions 0 then 1).
    errors = re.search(r'<span id="errors" data-count="(\d+)">([^<]*)</span>', detail)
    assert errors is not None and errors.group(1) == "0", errors and errors.group(2)
    assert re.search(r'<div class="sample" data-sample="0">sample 0: [^<]*0 \u2192 1\)<canvas', detail), detail[-3000:]
    assert 'data-segments="2"' in detail
    for replica in gw.services.pool.all():
        row = re.search(rf'<tr data-replica="{re.escape(replica.id)}" data-points="(\d+)"', dom)
        assert row is not None and int(row.group(1)) > 0, f"replica {replica.id} has no sparkline points"
    if token is not None:
        return
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert int.from_bytes(data[16:20], "big") == 1400 and len(data) > 20_000  # a real page, not a blank frame
    if os.environ.get("RG_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["RG_DASHBOARD_SCREENSHOT"])
