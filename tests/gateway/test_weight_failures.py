"""Weight updates that fail, and what `POST /admin/weights` asks for, over real simulator replicas, real HTTP and
the session's Redis (issue 35: the traps a trainer author trips on).

The replicas run with `weights_must_exist`: a load from a path that is not on disk fails as on the real engines
(vLLM answers 500, SGLang 400 `success: false`), keeping the weights and the label. `publish` loads `ckpt-<v>`,
which is never on disk, so with the fault on it fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, expected_tokens, generate_body, publish, slow, stream_generate
from tests.sim_helpers import sim_state, wait_for


def replica_id(url: str) -> str:
    return url.removeprefix("http://")


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
