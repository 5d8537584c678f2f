"""A policy trained as a LoRA adapter (`model.base_model`, `backends.lora`): its versions load beside each other on
engines serving the base model, without a pause; a request keeps the adapter version it started under to its end,
and every token is labelled with it. The simulator holds adapters as vLLM and SGLang do (`backends.sim.adapters`)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.reference import reference_tokens
from gateway.config import ReplicaConfig, load_config
from gateway.errors import ConfigError
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import SHAPE, generate_body, stream_generate, weights_of
from tests.sim_helpers import wait_for

PROMPT = [5, 6, 7, 8]
BASE = weights_of(0)


async def lora_gateway(
    make_sim: SimFactory, make_gateway: GatewayFactory, dialect: str, delay: float = 0.0, **sections: Any
) -> tuple[Any, Any]:
    """A base pool (`tiny`) and a LoRA policy on its engine (`tiny-lora`), one simulated replica of `dialect`."""
    engine = EngineSettings(block_size=16 if dialect == "vllm" else 1, max_loras=8, token_delay_s=delay)
    sim = await make_sim(dialect, engine)
    replica = ReplicaConfig(url=sim.url, backend="sim", dialect=dialect)
    pools = [
        {"model": "tiny", "replicas": [replica]},
        {"model": "tiny-lora", "base_model": "tiny", "replicas": [replica]},
    ]
    return await make_gateway([], pools=pools, **sections), sim


async def publish_adapter(http: httpx.AsyncClient, url: str, version: int, **extra: Any) -> httpx.Response:
    body = {"model": "tiny-lora", "version": version, "path": f"lora-{version}"} | extra
    return await http.post(f"{url}/admin/weights", json=body, headers=ADMIN)


async def generate(http: httpx.AsyncClient, url: str, model: str, max_tokens: int = 8) -> dict[str, Any]:
    answer = await http.post(f"{url}/generate", json=generate_body(PROMPT, max_tokens, model=model))
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


async def loaded(http: httpx.AsyncClient, sim_url: str) -> list[str]:
    cards = (await http.get(f"{sim_url}/v1/models")).json()["data"]
    return [card["id"] for card in cards if card.get("parent") == "tiny"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_each_version_samples_under_its_own_adapter_and_the_base_pool_is_untouched(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    gw, sim = await lora_gateway(make_sim, make_gateway, dialect)
    base = reference_tokens(SHAPE, PROMPT, BASE, 8, ignore_eos=True)
    first = await generate(http, gw.url, "tiny-lora")
    assert (first["output_ids"], set(first["versions"])) == (base, {0})  # version 0 is the base model
    updated = await publish_adapter(http, gw.url, 1)
    assert updated.status_code == 200, updated.text
    assert await loaded(http, sim.url) == ["tiny-lora-v1"]
    under_one = await generate(http, gw.url, "tiny-lora")
    assert under_one["output_ids"] == reference_tokens(SHAPE, PROMPT, BASE, 8, ignore_eos=True, adapter_path="lora-1")
    assert set(under_one["versions"]) == {1}
    assert under_one["output_ids"] != base
    untouched = await generate(http, gw.url, "tiny")
    assert (untouched["output_ids"], set(untouched["versions"])) == (base, {0})
    assert gw.services.for_model("tiny").weights.version == 0


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_request_in_flight_finishes_under_the_version_it_started_with(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    gw, sim = await lora_gateway(make_sim, make_gateway, dialect, delay=0.01)
    assert (await publish_adapter(http, gw.url, 1)).status_code == 200
    progress = [0]
    streaming = stream_generate(http, gw.url, generate_body(PROMPT, 60, model="tiny-lora"), progress)
    task = asyncio.create_task(streaming)
    await wait_for(lambda: progress[0] >= 5, what="the first tokens")
    updated = await publish_adapter(http, gw.url, 2)
    assert updated.status_code == 200, updated.text
    assert not task.done()  # the update did not wait for it, nor cut it
    after = await generate(http, gw.url, "tiny-lora")
    streamed = await task
    assert streamed.error is None
    assert streamed.output_ids == reference_tokens(SHAPE, PROMPT, BASE, 60, ignore_eos=True, adapter_path="lora-1")
    assert set(streamed.final["versions"]) == {1} and streamed.final["num_resumes"] == 0
    assert after["output_ids"] == reference_tokens(SHAPE, PROMPT, BASE, 8, ignore_eos=True, adapter_path="lora-2")
    assert set(after["versions"]) == {2}
    assert sorted(await loaded(http, sim.url)) == ["tiny-lora-v1", "tiny-lora-v2"]


async def test_the_newest_versions_within_the_staleness_budget_stay_loaded(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, sim = await lora_gateway(make_sim, make_gateway, "vllm", weights={"max_staleness": 1})
    for version in (1, 2, 3):
        assert (await publish_adapter(http, gw.url, version)).status_code == 200
    assert sorted(await loaded(http, sim.url)) == ["tiny-lora-v2", "tiny-lora-v3"]
    status = (await http.get(f"{gw.url}/admin/status", params={"model": "tiny-lora"}, headers=ADMIN)).json()
    assert status["version"] == 3


async def test_an_adapter_update_that_is_no_load_from_a_path_is_refused(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, _ = await lora_gateway(make_sim, make_gateway, "vllm")
    aborting = await publish_adapter(http, gw.url, 1, mode="abort")
    assert aborting.status_code == 400 and aborting.json()["error"]["param"] == "mode"
    relabel = {"model": "tiny-lora", "version": 1, "source": "external"}
    refused = await http.post(f"{gw.url}/admin/weights", json=relabel, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "path"
    assert gw.services.for_model("tiny-lora").weights.version == 0


def test_a_lora_policy_updates_in_keep_mode() -> None:
    settings = load_config(model={"base_model": "tiny"})
    assert settings.pool_settings()[0].weights.pause_mode == "keep"
    with pytest.raises(ConfigError, match="without a pause"):
        load_config(model={"base_model": "tiny"}, weights={"pause_mode": "abort"})
    with pytest.raises(ConfigError, match="'b'.*without a pause"):
        load_config(pools=[{"model": "a"}, {"model": "b", "base_model": "a", "weights": {"pause_mode": "wait"}}])
