"""Several pools on one gateway (`pools:`, docs/serving.md "Several pools"): the request's `model` picks the pool,
and each pool has its own replicas, weight version, update lock, sessions and trajectory stream on the one Redis."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.config import ReplicaConfig, Settings, load_config
from gateway.errors import ConfigError
from gateway.trainer.consumer import TrajectoryConsumer
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, scrape, value, weights_of

KEYS = [{"id": "alpha-only", "key": "sk-alpha"}, {"id": "anyone", "key": "sk-any"}]


def pool(model: str, sim: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "replicas": [ReplicaConfig(url=sim.url, backend="sim", dialect=sim.dialect)]} | extra


def chat(model: str, session: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "session_id": session,
    }


async def two_pools(make_sim: SimFactory, make_gateway: GatewayFactory, **sections: Any) -> tuple[Any, Any, Any]:
    alpha, beta = await make_sim("vllm"), await make_sim("sglang")
    gw = await make_gateway(
        [], pools=[pool("alpha", alpha), pool("beta", beta, weights={"pause_mode": "wait"})], **sections
    )
    return gw, alpha, beta


async def test_the_model_picks_the_pool_and_each_pool_keeps_its_own_sessions(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    gw, alpha, beta = await two_pools(make_sim, make_gateway)
    models = (await http.get(f"{gw.url}/v1/models")).json()
    assert [card["id"] for card in models["data"]] == ["alpha", "beta"]
    for model, session in (("alpha", "s-a"), ("beta", "s-b")):
        answer = await http.post(f"{gw.url}/v1/chat/completions", json=chat(model, session))
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
    a = (await http.get(f"{gw.url}/v1/sessions/s-a")).json()  # found in the pool that holds it
    b = (await http.get(f"{gw.url}/v1/sessions/s-b", params={"model": "beta"})).json()
    assert {g["replica"] for g in a["samples"][0]["segments"]} == {gw.services.for_model("alpha").pool.all()[0].id}
    assert {g["replica"] for g in b["samples"][0]["segments"]} == {gw.services.for_model("beta").pool.all()[0].id}
    assert (await http.get(f"{gw.url}/v1/sessions/s-a", params={"model": "beta"})).status_code == 404
    for session in ("s-a", "s-b"):
        assert (await http.post(f"{gw.url}/v1/sessions/{session}/finish", json={"reward": 1.0})).status_code == 200
    # Each pool's trajectories come through its own stream.
    for name, session in (("alpha", "s-a"), ("beta", "s-b")):
        async with TrajectoryConsumer(redis_server.url, "trainer", "t0", pool=name) as consumer:
            batch = await consumer.next_batch(1, timeout=5)
            assert [t.session_id for t in batch.trajectories] == [session]


async def test_an_unknown_or_missing_model_is_refused_naming_the_served_ones(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, _, _ = await two_pools(make_sim, make_gateway)
    unknown = await http.post(f"{gw.url}/v1/chat/completions", json=chat("gamma", "s-x"))
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"
    assert "`alpha`, `beta`" in unknown.json()["error"]["message"]
    missing = await http.post(f"{gw.url}/generate", json=generate_body([1, 2, 3], 2))
    assert missing.status_code == 400
    assert "several models" in missing.json()["error"]["message"]
    named = await http.post(f"{gw.url}/generate", json=generate_body([1, 2, 3], 2, model="beta"))
    assert named.status_code == 200, named.text
    assert (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).status_code == 400
    status = (await http.get(f"{gw.url}/admin/status", params={"model": "beta"}, headers=ADMIN)).json()
    assert (status["model"], status["models"], status["store_prefix"]) == ("beta", ["alpha", "beta"], "rg:beta:")


async def test_an_update_moves_only_its_own_pool(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, alpha, beta = await two_pools(make_sim, make_gateway)
    body = {"version": 1, "path": weights_of(1)[0]}
    refused = await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "model"
    updated = await http.post(f"{gw.url}/admin/weights", json=body | {"model": "alpha"}, headers=ADMIN)
    assert updated.status_code == 200, updated.text
    assert gw.services.for_model("alpha").weights.version == 1
    assert gw.services.for_model("beta").weights.version == 0
    alpha_state = (await http.get(f"{alpha.url}/sim/state")).json()
    beta_state = (await http.get(f"{beta.url}/sim/state")).json()
    assert alpha_state["weights"] == weights_of(1)[0]
    assert beta_state["weights"] == weights_of(0)[0]
    # The other pool updates on its own lock, to its own version sequence.
    again = await http.post(f"{gw.url}/admin/weights", json=body | {"model": "beta"}, headers=ADMIN)
    assert again.status_code == 200, again.text
    samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_weight_version", pool="alpha") == 1
    assert value(samples, "rollout_gateway_weight_version", pool="beta") == 1


async def test_a_key_bound_to_a_pool_is_refused_on_the_others(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    alpha, beta = await make_sim("vllm"), await make_sim("sglang")
    gw = await make_gateway(
        [],
        server={"api_keys": KEYS},
        pools=[pool("alpha", alpha), pool("beta", beta, keys=["anyone"])],
    )
    as_alpha = {"authorization": "Bearer sk-alpha"}
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=chat("beta", "k-1"), headers=as_alpha)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["param"] == "model"
    allowed = await http.post(f"{gw.url}/v1/chat/completions", json=chat("alpha", "k-2"), headers=as_alpha)
    assert allowed.status_code == 200, allowed.text
    anyone = {"authorization": "Bearer sk-any"}
    assert (
        await http.post(f"{gw.url}/v1/chat/completions", json=chat("beta", "k-3"), headers=anyone)
    ).status_code == 200


def test_pools_are_validated_naming_the_key() -> None:
    replica = {"url": "http://127.0.0.1:9", "backend": "sim"}
    cases = {
        "has 2 pools": {"pools": [{"model": "a", "replicas": [replica]}, {"model": "a"}]},
        "pools[0].model": {"pools": [{"model": "a:b"}]},
        "pools[0].weights: pause_mode": {"pools": [{"model": "a", "weights": {"pause_mode": "later"}}]},
        "replicas belong inside each pool": {"pools": [{"model": "a"}], "replicas": [replica]},
        "pools[0].keys names 'k'": {"pools": [{"model": "a", "keys": ["k"]}]},
    }
    for expected, given in cases.items():
        with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            load_config(**given)


def test_each_pool_is_the_top_level_settings_with_its_own_keys() -> None:
    settings = Settings(
        weights={"pause_mode": "keep", "update_timeout_s": 30},
        pools=[{"model": "a"}, {"model": "b", "weights": {"pause_mode": "wait"}, "routing": {"policy": "round_robin"}}],
    )
    a, b = settings.pool_settings()
    assert (a.model.name, a.store.prefix, a.weights.pause_mode, a.routing.policy) == ("a", "rg:a:", "keep", "sticky")
    assert (b.model.name, b.store.prefix, b.weights.pause_mode, b.routing.policy) == (
        "b",
        "rg:b:",
        "wait",
        "round_robin",
    )
    assert b.weights.update_timeout_s == 30  # the top level's, where the pool says nothing
    assert Settings().pool_settings()[0].store.prefix == "rg:"  # one model: the keys as they were
