"""The LoRA checks of the vLLM tier (issue 54 §2, `backends.lora`), on its shared server, started with LoRA on: two
pools on one engine, the base model and an adapter of it (`base_model`); each adapter version is loaded beside the
others without a pause, a request keeps the version it started under, and its tokens are exactly the engine's own
greedy tokens under that adapter. The adapters are made with peft (`trainers.lora.random_adapter`), never downloaded.

vLLM on the CPU takes adapters at run time (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). SGLang's CPU build
cannot: its LoRA layers pin host memory, which needs a GPU driver ("Found no NVIDIA driver", at startup with
`--enable-lora`), so SGLang's adapter calls are proven on the simulator only (docs/engines.md). Each check leaves the
engine as it found it: no adapter loaded.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from tests.conftest import ADMIN, ADMIN_TOKEN, GatewayFactory
from tests.engines.direct import greedy, prompt_of
from tests.engines.servers import EngineServer
from tests.gateway_helpers import generate_body, stream_generate
from tests.sim_helpers import wait_for
from trainers.grpo import GRPOConfig
from trainers.loop import LoopConfig, train
from trainers.lora import random_adapter

ADAPTER = "tiny-lora"


def make_adapters(server: EngineServer, folder: Path) -> list[Path]:
    """Two adapters of the served model that sample differently from it and from each other."""
    return [random_adapter(server.model_path, folder / f"v{seed}", seed) for seed in (1, 2)]


async def two_pools(make_gateway: GatewayFactory, server: EngineServer) -> RunningGateway:
    replica = ReplicaConfig(url=server.url, backend="vllm", scale_out=True)
    return await make_gateway(
        [],
        model={"tokenizer": str(server.model_path), "max_model_len": 4096},
        generation={"request_timeout_s": 300},
        pools=[
            {"model": "tiny", "replicas": [replica]},
            {"model": ADAPTER, "base_model": "tiny", "replicas": [replica]},
        ],
    )


async def publish(http: httpx.AsyncClient, gw: RunningGateway, version: int, path: Path) -> None:
    body = {"model": ADAPTER, "version": version, "path": str(path)}
    answer = await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN, timeout=120)
    assert answer.status_code == 200, answer.text


async def generated(http: httpx.AsyncClient, gw: RunningGateway, model: str, prompt: list[int], n: int) -> Any:
    body = generate_body(prompt, n, model=model)
    answer = await http.post(f"{gw.url}/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def unload_all(http: httpx.AsyncClient, server: EngineServer) -> None:
    """Leave the engine as the module found it: no adapter loaded."""
    cards = (await http.get(f"{server.url}/v1/models")).json()["data"]
    for card in cards:
        if card.get("parent"):
            await http.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


async def each_version_samples_under_its_adapter(
    http: httpx.AsyncClient, make_gateway: GatewayFactory, server: EngineServer, adapters: list[Path]
) -> None:
    """Version 0 samples as the base; after an update, each version's greedy tokens through the gateway are the
    engine's own under that adapter; the base pool is untouched."""
    gw = await two_pools(make_gateway, server)
    prompt, n = prompt_of(24, seed=3), 16
    try:
        base, _ = await greedy(http, server, prompt, n)
        version_0 = await generated(http, gw, ADAPTER, prompt, n)
        assert (version_0["output_ids"], set(version_0["versions"])) == (base, {0})  # version 0: the base model
        await publish(http, gw, 1, adapters[0])
        under_one, _ = await greedy(http, server, prompt, n, adapter=f"{ADAPTER}-v1")
        assert under_one != base  # the adapter changes what the engine samples
        version_1 = await generated(http, gw, ADAPTER, prompt, n)
        assert (version_1["output_ids"], set(version_1["versions"])) == (under_one, {1})
        untouched = await generated(http, gw, "tiny", prompt, n)
        assert (untouched["output_ids"], set(untouched["versions"])) == (base, {0})
    finally:
        await gw.stop()  # else its health probe would load the current version again
        await unload_all(http, server)


async def two_versions_in_flight_keep_their_own_adapter(
    http: httpx.AsyncClient, make_gateway: GatewayFactory, server: EngineServer, adapters: list[Path]
) -> None:
    """A 600-token request started under version 1 finishes under it (tokens, versions, no resume) while version 2
    loads without waiting for it and serves new requests."""
    gw = await two_pools(make_gateway, server)
    prompt, long, short = prompt_of(24, seed=5), 600, 16
    try:
        await publish(http, gw, 1, adapters[0])
        progress = [0]
        streaming = asyncio.create_task(
            stream_generate(http, gw.url, generate_body(prompt, long, model=ADAPTER), progress)
        )
        await wait_for(lambda: progress[0] >= 8, timeout=60, what="the long request's first tokens")
        began = time.monotonic()
        await publish(http, gw, 2, adapters[1])
        print(f"\nvLLM adapter update under load: {time.monotonic() - began:.3f} s (POST /admin/weights)")
        assert not streaming.done()  # the update neither waited for it nor cut it
        after = await generated(http, gw, ADAPTER, prompt, short)
        streamed = await streaming
        assert streamed.error is None
        assert set(streamed.final["versions"]) == {1} and streamed.final["num_resumes"] == 0
        assert streamed.output_ids == (await greedy(http, server, prompt, long, adapter=f"{ADAPTER}-v1"))[0]
        assert set(after["versions"]) == {2}
        assert after["output_ids"] == (await greedy(http, server, prompt, short, adapter=f"{ADAPTER}-v2"))[0]
        loaded = {card["id"] for card in (await http.get(f"{server.url}/v1/models")).json()["data"]}
        assert {f"{ADAPTER}-v1", f"{ADAPTER}-v2"} <= loaded
    finally:
        await gw.stop()  # else its health probe would load the current version again
        await unload_all(http, server)


async def reference_trainer_learns_a_lora_policy(
    make_gateway: GatewayFactory, server: EngineServer, tmp_path: Path
) -> None:
    """The reference GRPO trainer (`trainers.loop`) trains a rank-8 adapter (peft, `GRPOConfig.lora_rank`) of the
    served model through the gateway: each step's adapter is published as a path and loaded beside the version in
    flight (no pause). A fixed-seed run starts below 0.05 mean reward and reaches 0.8 within 60 steps, and on tokens
    the engine sampled under the learner's own adapter its log-probabilities match torch's."""
    gw = await make_gateway(
        [ReplicaConfig(url=server.url, backend="vllm", scale_out=True)],
        model={"name": ADAPTER, "base_model": "tiny", "tokenizer": str(server.model_path), "max_model_len": 4096},
        generation={"request_timeout_s": 300},
    )
    config = LoopConfig(steps=60, stop_at_reward=0.8, seed=0, grpo=GRPOConfig(seed=0, threads=1, lora_rank=8, lr=5e-2))
    try:
        result = await train(
            gw.url, gw.services.redis_url, server.model_path, tmp_path, config, admin_token=ADMIN_TOKEN
        )
    finally:
        await gw.stop()
        async with httpx.AsyncClient(timeout=60) as http:
            await unload_all(http, server)
    rewards = result.rewards
    curve = ", ".join(f"{r:.2f}" for r in rewards)
    print(f"\nvLLM LoRA reward curve: {curve}")
    assert rewards[0] < 0.05, curve
    assert rewards[-1] >= 0.8, f"no step reached 0.8 in {len(rewards)} steps: {curve}"
    mismatch = [s.stats.mismatch_mean for s in result.steps if s.stats.mismatch_mean == s.stats.mismatch_mean]
    assert mismatch and max(mismatch) < 1e-3, mismatch
    assert gw.services.weights.version == result.steps[-1].version
