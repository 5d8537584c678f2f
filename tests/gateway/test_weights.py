"""`gateway.weights`: weight updates over real simulator replicas, real HTTP and the session's Redis.

First the updates that fail, and what `POST /admin/weights` asks for (issue 35: the traps a trainer author trips
on); then the update modes (abort, keep, wait), the requests held while an update runs, the replicas held out as
stale, and the labels that name a version.

The replicas of the failure tests run with `weights_must_exist`: a load from a path that is not on disk fails as on
the real engines (vLLM answers 500, SGLang 400 `success: false`), keeping the weights and the label. `publish` loads
`ckpt-<v>`, which is never on disk, so with the fault on it fails."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backends.launcher import free_port
from backends.sim.engine import EngineSettings
from gateway.config import ReplicaConfig
from gateway.embedded_redis import EmbeddedRedis
from gateway.store import Keys, Pausing, Serving, WeightsBus, connect
from gateway.weights import INITIAL_LABELS, parse_version, version_label, version_labels
from tests.chaos.soak import GatewayChild
from tests.conftest import ADMIN, ADMIN_TOKEN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    expected_tokens,
    generate_body,
    publish,
    slow,
    stream_generate,
    weights_of,
)
from tests.sim_helpers import sim_state, wait_for


def replica_id(url: str) -> str:
    return url.removeprefix("http://")


@contextlib.asynccontextmanager
async def coordinating(redis_server: EmbeddedRedis, version: int, mode: str) -> AsyncIterator[tuple[WeightsBus, str]]:
    """The test as the process coordinating an update on the weights bus: on the bus, the lock taken, `pausing` sent
    (nothing more: what follows is the test's)."""
    client = connect(redis_server.url)
    bus = WeightsBus(client, Keys(), origin="test-coordinator")
    try:
        await bus.join(ttl_s=60)
        token = bus.new_token()
        assert await bus.acquire(token, ttl_s=60)
        await bus.announce(Pausing(version, mode, token))
        yield bus, token
    finally:
        await client.aclose()


async def status_of(http: httpx.AsyncClient, url: str) -> dict[str, object]:
    response = await http.get(f"{url}/admin/status", headers=ADMIN)
    assert response.status_code == 200
    status: dict[str, object] = response.json()
    return status


# -- an update that loads nowhere: 502, rolled back --------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_an_update_that_loads_nowhere_is_a_502_and_the_previous_version_serves_on(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str, mode: str
) -> None:
    sims = [await make_sim(*slow(dialect), weights_must_exist=True) for _ in range(2)]
    gw = await make_gateway(sims)
    total, progress = 200, [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, total), progress))
    await wait_for(lambda: progress[0] >= 20, what="tokens before the update")
    failed = await publish(http, gw.url, 1, mode=mode)

    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    ids = sorted(replica_id(sim.url) for sim in sims)
    assert (error["type"], error["code"]) == ("backend_error", "weights_not_updated")
    assert (error["version"], error["requested_version"], error["status"]) == (0, 1, "failed")
    assert sorted(error["kept"]) == ids and error["stale"] == []
    assert sorted(error["errors"]) == ids
    assert all("no checkpoint at 'ckpt-1'" in message for message in error["errors"].values())
    assert all(replica in error["message"] for replica in ids)  # the engines' messages, per replica

    # The request the update preempted finishes under the previous version, as if nothing had happened.
    result = await task
    assert result.error is None and result.final["finish_reason"] == "length"
    assert result.final["versions"] == [0] * total
    assert result.output_ids == expected_tokens(PROMPT, [0] * total, total)
    assert result.final["num_resumes"] == (1 if mode == "abort" else 0)

    status = await status_of(http, gw.url)
    assert status["version"] == 0 and status["state"] == "serving"
    assert [(r["stale"], r["version"]) for r in status["replicas"]] == [(False, 0), (False, 0)]  # type: ignore[attr-defined]
    for sim in sims:
        assert (await sim_state(http, sim.url))["paused"] is False
    after = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 5, session_id="after"))).json()
    assert after["versions"] == [0] * 5

    # The same version may be tried again, and loads once the checkpoint is readable.
    for sim in sims:
        await http.post(f"{sim.url}/sim/faults", json={"weights_must_exist": False})
    retried = await publish(http, gw.url, 1)
    assert retried.status_code == 200, retried.text
    report = retried.json()
    assert report["status"] == "updated" and sorted(report["updated"]) == ids
    assert report["stale"] == [] and report["errors"] == {}


async def test_a_replica_reporting_another_label_after_a_failed_update_is_held_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Rolled back only where the engine still reports the previous version: one that reports anything else runs
    weights nobody can name, so it is stale."""
    kept, odd = await make_sim("vllm", weights_must_exist=True), await make_sim("vllm", weights_must_exist=True)
    gw = await make_gateway([kept, odd], routing={"health_interval_s": 30})
    # Someone relabelled the engine behind the gateway's back (the health loop would see it only later).
    assert (await http.post(f"{odd.url}/update_weight_version", json={"new_version": "7"})).status_code == 200
    failed = await publish(http, gw.url, 1)
    assert failed.status_code == 502
    error = failed.json()["error"]
    assert error["kept"] == [replica_id(kept.url)] and error["stale"] == [replica_id(odd.url)]
    assert "reports version '7'" in error["errors"][replica_id(odd.url)]
    assert gw.services.weights.version == 0
    for i in range(6):
        body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id=f"s{i}"))).json()
        assert body["replicas"] == [replica_id(kept.url)] and body["versions"] == [0, 0, 0]


async def test_an_update_refused_by_every_replica_leaves_the_others_processes_on_the_previous_version(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Several gateway processes on one Redis: the failed update's result, published to the others, does not make
    them adopt the new version, and their preempted requests finish under the previous one."""
    sims = [await make_sim(*slow("vllm"), weights_must_exist=True), await make_sim(*slow("sglang"))]
    await http.post(f"{sims[1].url}/sim/faults", json={"weights_must_exist": True})  # switched at run time too
    leader, follower = await make_gateway(sims), await make_gateway(sims)
    progress = [0]
    tasks = [
        asyncio.create_task(
            stream_generate(http, follower.url, generate_body(PROMPT, 150, session_id=f"f{i}"), progress)
        )
        for i in range(4)
    ]
    await wait_for(lambda: progress[0] >= 40, what="progress on the follower")
    assert (await publish(http, leader.url, 1)).status_code == 502
    for result in await asyncio.gather(*tasks):
        assert result.error is None and result.final["versions"] == [0] * 150
        assert result.output_ids == expected_tokens(PROMPT, [0] * 150, 150)
    for gw in (leader, follower):
        status = await status_of(http, gw.url)
        assert status["version"] == 0 and status["state"] == "serving"
        assert not any(r["stale"] for r in status["replicas"])  # type: ignore[attr-defined]
    # A later update that succeeds reaches the follower as before.
    for sim in sims:
        await http.post(f"{sim.url}/sim/faults", json={"weights_must_exist": False})
    assert (await publish(http, leader.url, 1)).status_code == 200
    await wait_for(lambda: follower.services.weights.version == 1, what="the follower adopting v1")


# -- some replicas load it: 207 partial --------------------------------------------------------------------------


async def test_a_partial_update_is_a_207_and_holds_the_failed_replicas_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    good, bad = await make_sim("sglang"), await make_sim("sglang", weights_must_exist=True)
    gw = await make_gateway([good, bad], routing={"health_interval_s": 30})
    response = await publish(http, gw.url, 1)
    assert response.status_code == 207, response.text
    report = response.json()
    assert report["status"] == "partial" and report["version"] == 1
    assert report["updated"] == [replica_id(good.url)] and report["stale"] == [replica_id(bad.url)]
    assert list(report["errors"]) == [replica_id(bad.url)]
    assert "Failed to get weights iterator" in report["errors"][replica_id(bad.url)]
    assert gw.services.weights.version == 1
    for i in range(6):  # never mixed: the replica still on version 0 serves nothing
        body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id=f"p{i}"))).json()
        assert body["replicas"] == [replica_id(good.url)] and body["versions"] == [1, 1, 1]


# -- path or source: external, never a relabel by omission -------------------------------------------------------


async def test_a_relabel_must_be_asked_for_and_a_path_is_loaded(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    url = f"{gw.url}/admin/weights"

    neither = await http.post(url, json={"version": 1}, headers=ADMIN)
    assert neither.status_code == 400, neither.text
    error = neither.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "path")
    assert '"path"' in error["message"] and '"source": "external"' in error["message"]
    both = await http.post(url, json={"version": 1, "path": str(tmp_path), "source": "external"}, headers=ADMIN)
    assert both.status_code == 400 and both.json()["error"]["param"] == "source"
    assert "not both" in both.json()["error"]["message"]
    other = await http.post(url, json={"version": 1, "source": "disk"}, headers=ADMIN)
    assert other.status_code == 400 and other.json()["error"]["param"] == "source"
    state = await sim_state(http, sim.url)
    assert (state["version"], state["counters"].get("weight_loads", 0)) == ("default", 0)  # nothing happened
    assert gw.services.weights.version == 0

    relabel = await http.post(url, json={"version": 1, "source": "external"}, headers=ADMIN)
    assert relabel.status_code == 200 and relabel.json()["status"] == "updated"
    state = await sim_state(http, sim.url)
    assert (state["weights"], state["version"], state["counters"].get("weight_loads", 0)) == ("init", "1", 0)

    load = await http.post(url, json={"version": 2, "path": str(tmp_path)}, headers=ADMIN)
    assert load.status_code == 200
    state = await sim_state(http, sim.url)
    assert (state["weights"], state["version"], state["counters"].get("weight_loads", 0)) == (str(tmp_path), "2", 1)


# -- update modes, and what requests see while an update runs ----------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_keep_mode_versions_come_from_engine_spans(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    sim = await make_sim(*slow(dialect))
    gw = await make_gateway([sim])
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200), progress))
    await wait_for(lambda: progress[0] >= 50, what="tokens")
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    result = await task
    versions = result.final["versions"]
    assert result.final["num_resumes"] == 0  # the request stayed in the engine
    assert 0 in versions and 1 in versions and versions == sorted(versions)
    assert result.output_ids == expected_tokens(PROMPT, versions, 200)


async def test_keep_mode_on_vllm_032_without_spans_aborts_and_resumes(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """vLLM 0.32 (observed) has no weight_versions on /v1/completions: a kept request would continue under new
    weights with nothing saying from which token on, so the adapter pauses with abort and the gateway resumes."""
    sim = await make_sim(*slow("vllm"), vllm_version="0.32.0")
    gw = await make_gateway([sim])
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200), progress))
    await wait_for(lambda: progress[0] >= 50, what="tokens")
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    result = await task
    versions = result.final["versions"]
    assert result.final["num_resumes"] == 1
    assert 0 in versions and 1 in versions and versions == sorted(versions)
    assert result.output_ids == expected_tokens(PROMPT, versions, 200)


async def test_keep_mode_on_vllm_032_with_scale_out_keeps(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """With --enable-scale-out the adapter uses /inference/v1/generate, whose spans 0.32 does report."""
    sim = await make_sim(*slow("vllm"), vllm_version="0.32.0", enable_scale_out=True)
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", scale_out=True)])
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200), progress))
    await wait_for(lambda: progress[0] >= 50, what="tokens")
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    result = await task
    versions = result.final["versions"]
    assert result.final["num_resumes"] == 0
    assert 0 in versions and 1 in versions and versions == sorted(versions)
    assert result.output_ids == expected_tokens(PROMPT, versions, 200)


async def test_wait_mode_drains_before_updating(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim(*slow("sglang"))  # no native wait: the gateway drains its own in-flight requests
    gw = await make_gateway([sim])
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 150), progress))
    await wait_for(lambda: progress[0] >= 20, what="tokens")
    assert (await publish(http, gw.url, 1, mode="wait")).status_code == 200
    result = await task
    assert set(result.final["versions"]) == {0} and result.final["num_resumes"] == 0
    after = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 10))).json()
    assert after["versions"] == [1] * 10


async def test_new_requests_wait_during_an_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    await http.post(f"{gw.url}/admin/pause", json={"mode": "abort"}, headers=ADMIN)
    task = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 5)))
    await asyncio.wait({task}, timeout=0.3)
    assert not task.done() and sim.engine.counters["prompt_tokens"] == 0  # held by the gateway, not the engine
    ready = await http.get(f"{gw.url}/ready")
    assert ready.status_code == 503
    resumed = await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)
    assert resumed.json()["updated"] == [gw.services.pool.all()[0].id]
    assert (await task).json()["versions"] == [1] * 5


async def test_stale_replica_is_held_out_until_a_later_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    good, bad = await make_sim("vllm"), await make_sim("vllm", engine=EngineSettings(), dev_mode=False)
    gw = await make_gateway([good, bad], routing={"health_interval_s": 30})
    response = await publish(http, gw.url, 1)
    assert response.status_code == 207  # partial: the replica without the dev-mode routes could not load it
    report = response.json()
    bad_id = bad.url.removeprefix("http://")
    assert report["status"] == "partial" and list(report["errors"]) == [bad_id]
    assert report["stale"] == [bad_id] and report["updated"] == [good.url.removeprefix("http://")]
    for i in range(6):
        body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id=f"x{i}"))).json()
        assert body["replicas"] == [good.url.removeprefix("http://")] and body["versions"] == [1, 1, 1]
    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    assert {r["id"]: r["stale"] for r in status["replicas"]}[bad_id] is True


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_pause_slower_than_a_health_probe_still_updates_the_replica(
    dialect: str, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """An engine on a busy host answers a pause only after its current step: the pause is bounded by
    `weights.control_timeout_s`, not by the health probe's timeout (with which the replica was marked stale and
    the fleet served nothing, seen on SGLang while a trainer held the CPU)."""
    sim = await make_sim(dialect)
    gw = await make_gateway([sim], routing={"health_timeout_s": 0.2, "health_interval_s": 30})
    await http.post(f"{sim.url}/sim/faults", json={"pause_delay": 0.6})
    report = (await publish(http, gw.url, 1)).json()
    assert report["updated"] == [sim.url.removeprefix("http://")] and report["stale"] == []
    body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3))).json()
    assert body["versions"] == [1, 1, 1]


async def test_request_queued_during_a_keep_pause_never_reads_old_weights_kv(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the chaos soak with the prefix cache on): vLLM keeps its prefix cache across a weight
    reload, and `/reset_prefix_cache` is refused while a keep-paused request holds KV. The gateway then flushed
    later, once the replica was idle; but a request that reached the engine after its pause (sent just before
    it, or by another gateway process) is queued there and admitted on resume, onto prefix KV of the old
    weights: it sampled tokens that no version draws. The flush now preempts running requests (they recompute
    their KV under the new weights), so it succeeds before the replica resumes. That flush is what
    `weights.kv_after_update: recompute` keeps (by default the cache is salted per version instead, and a request
    queued with the old version's salt keeps its KV, as a kept request does: tests/gateway/test_cache_salt.py)."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    gw = await make_gateway([sim], weights={"kv_after_update": "recompute"})
    prompt = list(range(10, 50))  # two full cache blocks
    warm = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 4, session_id="warm"))
    assert warm.status_code == 200  # the prompt's blocks are now cached, computed under the initial weights
    long = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body([7, 8, 9], 200, session_id="l")))
    await wait_for(lambda: sim.engine.num_running == 1, what="the long request running")
    assert (await http.post(f"{gw.url}/admin/pause", json={"mode": "keep"}, headers=ADMIN)).status_code == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "ckpt-1"}}  # the out-of-band weight sync
    assert (await http.post(f"{sim.url}/collective_rpc", json=rpc)).status_code == 200
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    queued = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=body | {"return_token_ids": True}))
    await wait_for(lambda: sim.engine.held == 1, what="the request queued at the paused engine")
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)).status_code == 200
    tokens = (await queued).json()["choices"][0]["token_ids"]
    assert tokens == expected_tokens(prompt, [1] * 8, 8)
    result = (await long).json()
    assert result["finish_reason"] == "length" and len(result["output_ids"]) == 200


# -- the labels that name a version ------------------------------------------------------------------------------------


def test_the_labels_of_a_version_are_those_that_parse_to_it() -> None:
    for version in (0, 1, 7, 123):
        labels = version_labels(version)
        assert version_label(version) in labels
        assert {parse_version(label) for label in labels} == {version}
    assert version_labels(0) >= INITIAL_LABELS  # an engine that never had an update says "default"
    assert "default" not in version_labels(1)


async def test_a_wait_update_drains_every_gateway_process_before_any_replica_is_paused(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Issue 38 §3: SGLang has no native `wait`, so the coordinating process pauses it with `abort` once requests
    are drained; the other processes' requests on it must be drained too, or they resume under the new version
    (two versions in one reply)."""
    sim = await make_sim(*slow("sglang", delay=0.004), incremental_streaming_output=True)
    leader, follower = await make_gateway([sim]), await make_gateway([sim])
    total, progress = 300, [0]
    tasks = [
        asyncio.create_task(
            stream_generate(http, follower.url, generate_body(PROMPT, total, session_id=f"b{i}"), progress)
        )
        for i in range(3)
    ]
    await wait_for(lambda: progress[0] >= 30, what="progress on the follower")
    response = await publish(http, leader.url, 1, mode="wait")
    assert response.status_code == 200, response.text
    for result in await asyncio.gather(*tasks):
        assert result.error is None
        assert result.final["versions"] == [0] * total and result.final["num_resumes"] == 0  # one version each
        assert result.output_ids == expected_tokens(PROMPT, [0] * total, total)
    after = (await http.post(f"{follower.url}/generate", json=generate_body(PROMPT, 5, session_id="later"))).json()
    assert after["versions"] == [1] * 5


@pytest.mark.timeout(300)  # its child gateway may take over a minute to start beside the heavy tests
async def test_a_gateway_killed_while_it_coordinates_an_update_leaves_the_others_serving(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    redis_server: EmbeddedRedis,
    http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    """A `serve` process coordinating a `wait` update is SIGKILLed while it waits for the other gateway to drain:
    its lock and the others' pause would last `weights.update_timeout_s` (10 min). Once its heartbeat expired, the
    other gateway takes the lock over, brings the replica back to the recorded version and serves again, and the
    trainer's retried update goes through; the streams in flight end with their tokens exact. (A heartbeat TTL of
    2.5 s rather than the default 10 s, for the test's time.)"""
    ttl_s = 2.5
    sim = await make_sim(*slow("sglang", delay=0.004), incremental_streaming_output=True)
    follower = await make_gateway([sim], weights={"member_ttl_s": ttl_s})
    settings = {
        "server": {"port": free_port(), "admin_token": ADMIN_TOKEN},
        "redis": {"url": redis_server.url},
        "replicas": [ReplicaConfig(url=sim.url, backend="sim", dialect="sglang").model_dump(mode="json")],
        "routing": {"health_interval_s": 0.2},
        "weights": {"member_ttl_s": ttl_s},
    }
    coordinator = GatewayChild(settings, tmp_path / "coordinator")
    await asyncio.to_thread(coordinator.start)
    try:
        total, progress = 2_000, [0]
        body = generate_body(PROMPT, total, session_id="held")
        streaming = asyncio.create_task(stream_generate(http, follower.url, body, progress))
        await wait_for(lambda: progress[0] >= 30, what="progress on the follower")
        update = asyncio.create_task(publish(http, coordinator.url, 1, mode="wait"))

        async def following() -> bool:
            return (await status_of(http, follower.url))["state"] == "following"

        await wait_for(following, what="the follower following the update")
        await asyncio.to_thread(coordinator.kill)
        with pytest.raises(httpx.TransportError):
            await update
        killed = time.monotonic()

        async def serving() -> bool:
            return (await status_of(http, follower.url))["state"] == "serving"

        heartbeat_s = follower.services.weights.heartbeat_s
        await wait_for(serving, timeout=2 * ttl_s + 3 * heartbeat_s + 5, what="the follower serving again")
        recovered_s = time.monotonic() - killed
        print(f"\nthe follower serves again {recovered_s:.1f} s after the kill")
        assert 2 * ttl_s - heartbeat_s - 0.5 < recovered_s, recovered_s  # no sooner than that
        result = await streaming
        assert result.error is None and result.output_ids == expected_tokens(PROMPT, result.final["versions"], total)
        response = await publish(http, follower.url, 1, mode="wait")  # the trainer's retry
        assert response.status_code == 200, response.text
        after = (await http.post(f"{follower.url}/generate", json=generate_body(PROMPT, 5, session_id="x"))).json()
        assert after["versions"] == [1] * 5
    finally:
        await asyncio.to_thread(coordinator.kill)


async def test_a_follower_that_missed_the_result_of_an_update_adopts_the_recorded_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """A follower's subscription can be down when the result goes out (a Redis failover, a restart): once the lock no
    longer names the update, it adopts what `rg:weights` records, replicas held out included, instead of waiting
    `weights.update_timeout_s`. The coordinator here is the test itself, on the bus, announcing `pausing` only."""
    sim, other = await make_sim("vllm"), await make_sim("vllm")
    follower = await make_gateway([sim, other])
    async with coordinating(redis_server, 1, "abort") as (bus, token):

        async def state_is(state: str) -> bool:
            return (await status_of(http, follower.url))["state"] == state

        await wait_for(lambda: state_is("following"), what="the follower following the update")
        heartbeat_s = follower.services.weights.heartbeat_s
        await asyncio.sleep(2 * heartbeat_s)
        assert await state_is("following")  # the lock names the update: it goes on
        await bus.record(1, "serving", "ckpt-1", updated=[replica_id(sim.url)], stale=[replica_id(other.url)])
        await bus.release(token)  # ... and no `serving` event
        await wait_for(lambda: state_is("serving"), timeout=3 * heartbeat_s, what="the follower serving again")
        status = await status_of(http, follower.url)
        assert status["version"] == 1, status
        stale = {r["id"]: r["stale"] for r in status["replicas"]}  # type: ignore[attr-defined]
        assert stale == {replica_id(sim.url): False, replica_id(other.url): True}, stale


async def test_a_follower_busy_catching_up_a_replica_still_follows_and_reports_its_drain(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """A catch-up holds its process's update lock for as long as the engine takes to load: SGLang's load waits for
    the requests in flight to end. A `pausing` from another process meanwhile must still stop this one dispatching,
    and in `wait` get its drain report (it was dropped: a `wait` update waited for the report until the catch-up
    ended, minutes with long generations). Here a request sent to the engine directly is in flight, and the engine
    is taken back to version 1 under it, out of band, so that the gateway, on version 2, catches it up."""
    sim = await make_sim(*slow("sglang", delay=0.004), incremental_streaming_output=True)
    follower = await make_gateway([sim])
    assert (await publish(http, follower.url, 2)).status_code == 200  # the follower's weights come from a path

    async def direct_stream() -> int:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1_500, "ignore_eos": True}, "stream": True}
        async with http.stream("POST", f"{sim.url}/generate", json=body) as response:
            await response.aread()  # to its end
            return response.status_code

    held = asyncio.create_task(direct_stream())
    await wait_for(lambda: sim.engine.num_running == 1, what="the direct request running")
    for path, body in (
        ("/pause_generation", {"mode": "in_place"}),
        ("/update_weights_from_disk", {"model_path": weights_of(1)[0], "weight_version": "1", "flush_cache": False}),
        ("/continue_generation", {}),
    ):
        assert (await http.post(f"{sim.url}{path}", json=body)).status_code == 200, path

    async def catching_up() -> bool:  # held out, and the engine's load waiting for the request: the lock is held
        status, state = await status_of(http, follower.url), await sim_state(http, sim.url)
        return bool(status["replicas"][0]["stale"]) and bool(state["admission_closed"])  # type: ignore[index]

    await wait_for(catching_up, what="the follower catching the replica up")
    async with coordinating(redis_server, 3, "wait") as (bus, token):
        origin = follower.services.weights.bus.origin  # type: ignore[union-attr]

        async def reported() -> bool:
            return origin in await bus.drained(token)

        await wait_for(reported, timeout=3.0, what="the follower's drain report")
        assert not held.done()  # the catch-up still waits for the request: it did not end first
        assert (await status_of(http, follower.url))["state"] == "following"
        await bus.release(token)
        await bus.announce(Serving(2, weights_of(2)[0]))
    assert await held == 200


async def test_a_process_behind_its_replicas_adopts_the_recorded_version_and_never_loads_an_older_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, http: httpx.AsyncClient
) -> None:
    """A process that missed an update's result sees its replicas report a newer version than its own. It adopts the
    version `rg:weights` records instead of loading its own, older one back onto them (two processes doing so in
    turns, each "catching up" the replicas to its own version, was seen after a Redis failover)."""
    sim = await make_sim("vllm")
    behind = await make_gateway([sim])
    elsewhere = await make_gateway([sim], store={"prefix": "elsewhere:"})  # a bus of its own: `behind` hears nothing
    assert (await publish(http, elsewhere.url, 1)).status_code == 200  # the replica runs ckpt-1, labelled "1"
    client = connect(redis_server.url)
    try:
        await WeightsBus(client, Keys(), origin="test").record(1, "serving", "ckpt-1", updated=[replica_id(sim.url)])
    finally:
        await client.aclose()

    async def adopted() -> bool:
        return (await status_of(http, behind.url))["version"] == 1

    await wait_for(adopted, what="the process adopting the recorded version")
    status = await status_of(http, behind.url)
    assert [(r["version"], r["stale"]) for r in status["replicas"]] == [(1, False)], status  # type: ignore[attr-defined]
    state = await sim_state(http, sim.url)
    assert (state["weights"], state["counters"]["weight_loads"]) == ("ckpt-1", 1)  # nothing loaded back
