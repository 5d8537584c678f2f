"""The simulator's capacity model and data-parallel ranks, over real sockets: a batch cap queues the excess, KV
exhaustion preempts and recomputes (with the same tokens), KV pressure evicts the prefix cache, the step time grows
with the batch and its prefill, requests pin to a rank, and every rank reports its load as vLLM and SGLang do.

Nothing here times anything: a step's modelled time is read from the simulator's accounting (`busy_s`, `steps`,
`batched_seqs`, `prefill_tokens`), and a batch is assembled while the engine is stalled, so the first step sees all
of it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from backends.sim.cli import build_parser, settings_from_args
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from backends.sim.server import SimReplica
from tests.conftest import SimFactory
from tests.sim_helpers import wait_for

SHAPE = ModelShape()
INIT = ("init", "default")
RUNNING = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}
WAITING = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs"}
USAGE = {"vllm": "vllm:kv_cache_usage_perc", "sglang": "sglang:token_usage"}
PREEMPTED = {"vllm": "vllm:num_preemptions_total", "sglang": "sglang:num_retracted_requests_total"}
HITS = {"vllm": "vllm:prefix_cache_hits_total", "sglang": "sglang:cached_tokens_total"}
# SGLang's `LoadSnapshot` scalar fields (0.5.23, srt/managers/load_snapshot.py): what `/v1/loads` has per rank.
LOAD_CORE = {
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
}


def prompt_of(n: int, seed: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 1900 for i in range(n)]


def reference(prompt: list[int], n: int) -> list[int]:
    return reference_tokens(SHAPE, prompt, INIT, n, ignore_eos=True)


async def generate(
    http: httpx.AsyncClient,
    sim: SimReplica,
    prompt: list[int],
    n: int,
    rank: int | None = None,
    **extra: Any,
) -> list[int]:
    """One greedy request in the replica's dialect (pinned to `rank` the dialect's way); its output tokens."""
    if sim.dialect == "vllm":
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
        response = await http.post(f"{sim.url}/v1/completions", json=body | {"return_token_ids": True}, headers=headers)
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["choices"][0]["token_ids"]
        return tokens
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    payload: dict[str, Any] = {"input_ids": prompt, "sampling_params": sampling} | extra
    if rank is not None:
        payload["routed_dp_rank"] = rank
    response = await http.post(f"{sim.url}/generate", json=payload)
    assert response.status_code == 200, response.text
    output: list[int] = response.json()["output_ids"]
    return output


async def samples(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """`/metrics` as {name{labels}: value}."""
    text = (await http.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def metric(http: httpx.AsyncClient, url: str, name: str) -> float:
    """A metric summed over its label sets."""
    return sum(v for k, v in (await samples(http, url)).items() if k == name or k.startswith(name + "{"))


async def stalled_batch(
    http: httpx.AsyncClient, sim: SimReplica, prompts: list[list[int]], n: int
) -> list[asyncio.Task[list[int]]]:
    """Queue every prompt while the engine steps nothing, so the first step sees them all; then let it run."""
    sim.engine.set_stalled(True)
    tasks = [asyncio.create_task(generate(http, sim, p, n)) for p in prompts]

    async def all_queued() -> bool:
        return await metric(http, sim.url, WAITING[sim.dialect]) == len(prompts)

    await wait_for(all_queued, what="every request queued")
    assert await metric(http, sim.url, RUNNING[sim.dialect]) == 0
    sim.engine.set_stalled(False)
    return tasks


# -- batch cap and step time ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_batch_cap_queues_the_excess_then_drains(
    make_sim: SimFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    sim = await make_sim(dialect, engine=EngineSettings(block_size=16 if dialect == "vllm" else 1, max_num_seqs=2))
    prompts = [prompt_of(8, seed) for seed in range(5)]
    tasks = await stalled_batch(http, sim, prompts, 20)
    outputs = [await task for task in tasks]
    assert outputs == [reference(p, 20) for p in prompts]  # queued requests decode the same tokens
    counters = sim.engine.counters
    # Two, two, then one request in the batch, 20 steps each: without the cap, 20 steps of five.
    assert (counters["steps"], counters["batched_seqs"]) == (60, 100)
    assert await metric(http, sim.url, WAITING[dialect]) == 0 and await metric(http, sim.url, RUNNING[dialect]) == 0


async def test_the_step_time_grows_with_the_batch_and_its_prefill(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    token, per_seq, per_prefill = 1e-4, 2e-4, 1e-5
    settings = EngineSettings(token_delay_s=token, per_seq_delay_s=per_seq, prefill_delay_s_per_token=per_prefill)
    sim = await make_sim("vllm", engine=settings)
    prompts = [prompt_of(40, seed) for seed in range(4)]
    tasks = await stalled_batch(http, sim, prompts, 10)
    assert [await task for task in tasks] == [reference(p, 10) for p in prompts]
    [rank] = sim.engine.ranks
    # One batch of four for 10 steps; the first step also prefilled the four prompts (no cache hit: all differ).
    assert (rank.counters["steps"], rank.counters["batched_seqs"], rank.counters["prefill_tokens"]) == (10, 40, 160)
    assert rank.busy_s == pytest.approx(10 * token + 40 * per_seq + 160 * per_prefill)
    alone = rank.busy_s
    await generate(http, sim, prompts[0], 10)  # the same prompt alone: a batch of one, its prefix cached
    single = rank.busy_s - alone
    assert single == pytest.approx(10 * token + 10 * per_seq + (40 - 32) * per_prefill)
    assert single < alone / 3  # a step of one request is cheaper than a step of four


# -- KV blocks -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_kv_exhaustion_preempts_and_recomputes_the_same_tokens(
    make_sim: SimFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    # Two requests of 8 + 40 tokens need 13 blocks of 4 each at the end: 20 blocks hold one, not both.
    settings = EngineSettings(block_size=4, num_gpu_blocks=20, max_model_len=64)
    sim = await make_sim(dialect, engine=settings)
    prompts = [prompt_of(8, seed) for seed in (1, 2)]
    tasks = await stalled_batch(http, sim, prompts, 40)
    assert [await task for task in tasks] == [reference(p, 40) for p in prompts]
    assert await metric(http, sim.url, PREEMPTED[dialect]) >= 1
    assert sim.engine.counters["recomputed_tokens"] > 0
    assert await metric(http, sim.url, USAGE[dialect]) == 0.0  # nothing runs: cached blocks are free


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_kv_pressure_evicts_the_prefix_cache(make_sim: SimFactory, http: httpx.AsyncClient, dialect: str) -> None:
    async def hits_after_pressure(num_gpu_blocks: int) -> float:
        sim = await make_sim(dialect, engine=EngineSettings(block_size=4, num_gpu_blocks=num_gpu_blocks))
        session = prompt_of(32, 7)
        await generate(http, sim, session, 4)
        before = await metric(http, sim.url, HITS[dialect])
        await generate(http, sim, prompt_of(4000, 8), 90)  # another conversation takes nearly all of the KV
        await generate(http, sim, session, 4)
        return await metric(http, sim.url, HITS[dialect]) - before

    assert await hits_after_pressure(4096) == 28  # 7 whole blocks (the last prompt token is always recomputed)
    assert await hits_after_pressure(1026) == 0  # the session's blocks were evicted for the other one


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_siblings_admitted_in_one_step_share_the_prompt_blocks(
    make_sim: SimFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """A GRPO group sent at once: the first member's full prompt blocks are cached as it is admitted, so the others,
    admitted in the same step, hit them (and hold them with it) instead of prefilling the prompt again."""
    sim = await make_sim(dialect, engine=EngineSettings(block_size=4, num_gpu_blocks=200, max_model_len=64))
    prompt = prompt_of(41, 5)  # 10 whole blocks; a hit covers 40 tokens (the last one is always recomputed)
    tasks = await stalled_batch(http, sim, [prompt] * 4, 6)
    assert [await task for task in tasks] == [reference(prompt, 6)] * 4
    [rank] = sim.engine.ranks
    assert await metric(http, sim.url, HITS[dialect]) == 3 * 40
    assert rank.counters["prefill_tokens"] == 41 + 3 * 1
    assert (rank.private_blocks, rank.pins) == (0, {})  # every block given back: cached, held by nobody


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_kv_usage_counts_the_blocks_running_requests_hold(
    make_sim: SimFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    sim = await make_sim(dialect, engine=EngineSettings(block_size=4, num_gpu_blocks=1100))
    prompt = prompt_of(99, 3)
    await generate(http, sim, prompt, 4)  # cached: the next run holds 24 of its blocks with the cache
    sim.engine.set_stalled(True)
    task = asyncio.create_task(generate(http, sim, prompt, 4))
    await wait_for(lambda: sim.engine.num_waiting == 1, what="the request queued")
    assert await metric(http, sim.url, USAGE[dialect]) == 0.0  # queued: no KV yet
    sim.engine.ranks[0].schedule()  # admit it (the stalled loop does not)
    # ceil((99 + 1) / 4) blocks, 24 of them shared with the cache: held, so used (and counted once).
    assert await metric(http, sim.url, USAGE[dialect]) == pytest.approx(25 / 1100)
    sim.engine.set_stalled(False)
    assert await task == reference(prompt, 4)


def test_num_gpu_blocks_must_hold_one_request_of_max_model_len() -> None:
    EngineSettings(block_size=16, num_gpu_blocks=257, max_model_len=4096)
    with pytest.raises(ValueError, match="cannot hold one request"):
        EngineSettings(block_size=16, num_gpu_blocks=256, max_model_len=4096)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineSettings(data_parallel_size=0)


def test_cli_capacity_flags() -> None:
    args = build_parser().parse_args(
        ["--max-num-seqs", "8", "--num-gpu-blocks", "512", "--per-seq-delay", "0.001", "--data-parallel-size", "2"]
    )
    engine = settings_from_args(args).engine
    assert (engine.max_num_seqs, engine.num_gpu_blocks, engine.per_seq_delay_s) == (8, 512, 0.001)
    assert engine.data_parallel_size == 2 and engine.scheduled
    sglang = settings_from_args(build_parser().parse_args(["--dialect", "sglang", "--max-running-requests", "4"]))
    assert sglang.engine.max_num_seqs == 4
    assert not settings_from_args(build_parser().parse_args([])).engine.scheduled  # defaults: today's engine


# -- data-parallel ranks -------------------------------------------------------------------------------------------


async def test_vllm_pins_by_header_and_reports_each_engine(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(data_parallel_size=2))
    sim.engine.set_stalled(True)
    pinned = asyncio.create_task(generate(http, sim, prompt_of(8, 1), 4, rank=1))
    await wait_for(lambda: sim.engine.ranks[1].num_running == 1, what="the pinned request on rank 1")
    metrics = await samples(http, sim.url)
    assert metrics['vllm:num_requests_running{engine="1",model_name="tiny"}'] == 1
    assert metrics['vllm:num_requests_running{engine="0",model_name="tiny"}'] == 0
    assert 0 < metrics['vllm:kv_cache_usage_perc{engine="1",model_name="tiny"}'] <= 1
    unpinned = asyncio.create_task(generate(http, sim, prompt_of(8, 2), 4))  # least loaded: rank 0
    await wait_for(lambda: sim.engine.ranks[0].num_running == 1, what="the unpinned request on rank 0")
    bad = await http.post(
        f"{sim.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2},
        headers={"X-data-parallel-rank": "2"},
    )
    assert bad.status_code == 400 and "out of range [0, 2)" in bad.json()["error"]["message"]
    sim.engine.set_stalled(False)
    assert await pinned == reference(prompt_of(8, 1), 4) and await unpinned == reference(prompt_of(8, 2), 4)
    metrics = await samples(http, sim.url)
    for rank in ("0", "1"):
        assert metrics[f'vllm:generation_tokens_total{{engine="{rank}",model_name="tiny"}}'] == 4


async def test_sglang_pins_by_body_field_and_loads_lists_each_rank(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang", engine=EngineSettings(block_size=1, data_parallel_size=3))
    sim.engine.set_stalled(True)
    tasks = [
        asyncio.create_task(generate(http, sim, prompt_of(8, 1), 4, rank=2)),
        asyncio.create_task(generate(http, sim, prompt_of(8, 2), 4, data_parallel_rank=2)),  # the older alias
    ]
    await wait_for(lambda: sim.engine.ranks[2].num_running == 2, what="both pinned requests on rank 2")
    loads = (await http.get(f"{sim.url}/v1/loads")).json()
    assert [load["dp_rank"] for load in loads["loads"]] == [0, 1, 2]
    assert [load["num_running_reqs"] for load in loads["loads"]] == [0, 0, 2]
    assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    [only] = (await http.get(f"{sim.url}/v1/loads", params={"dp_rank": 2})).json()["loads"]
    assert only["dp_rank"] == 2 and only["num_used_tokens"] == 16 and only["token_usage"] > 0
    assert (await http.get(f"{sim.url}/v1/loads", params={"dp_rank": 3})).json()["loads"] == []
    metrics = await samples(http, sim.url)
    assert metrics['sglang:num_running_reqs{dp_rank="2",model_name="tiny"}'] == 2
    assert metrics['sglang:num_running_reqs{dp_rank="0",model_name="tiny"}'] == 0
    bad = await http.post(
        f"{sim.url}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 3}
    )
    assert bad.status_code == 400 and "routed_dp_rank=3 out of range [0, 3)" in bad.json()["error"]["message"]
    round_robin = [asyncio.create_task(generate(http, sim, prompt_of(8, 10 + i), 4)) for i in range(3)]
    await wait_for(lambda: sim.engine.num_running == 5, what="the unpinned requests")
    assert [rank.num_running for rank in sim.engine.ranks] == [1, 1, 3]  # one each, in turn
    sim.engine.set_stalled(False)
    for task in [*tasks, *round_robin]:
        assert len(await task) == 4


async def test_sglang_loads_sections_and_formats(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=EngineSettings(block_size=1, num_gpu_blocks=8192, max_num_seqs=4))
    [load] = (await http.get(f"{sim.url}/v1/loads")).json()["loads"]
    assert LOAD_CORE <= set(load) and {"memory", "disaggregation", "queues"} <= set(load)
    assert (load["max_total_num_tokens"], load["max_running_requests"]) == (8192, 4)
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    [core] = (await http.get(f"{sim.url}/v1/loads", params={"include": "core"})).json()["loads"]
    assert set(core) == LOAD_CORE
    assert (await http.get(f"{sim.url}/v1/loads", params={"include": "nope"})).status_code == 400
    text = (await http.get(f"{sim.url}/v1/loads", params={"format": "prometheus"})).text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text and 'sglang_queues_waiting{dp_rank="0"} 0' in text
    metrics = await samples(http, sim.url)
    for name in ("token_usage", "num_running_reqs", "num_queue_reqs", "cache_hit_rate", "num_retracted_reqs"):
        assert f'sglang:{name}{{model_name="tiny"}}' in metrics
    assert 'sglang:num_retracted_requests_total{model_name="tiny"}' in metrics


async def test_a_retract_pause_queues_the_batch_again_under_the_capacity_model(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    """SGLang's retract: the running requests give up their KV and go back to the queue; after the pause they
    are admitted again, recompute, and finish with the tokens of an uninterrupted run."""
    settings = EngineSettings(block_size=1, max_num_seqs=4, token_delay_s=0.002)
    sim = await make_sim("sglang", engine=settings)
    prompt = prompt_of(8, 4)
    task = asyncio.create_task(generate(http, sim, prompt, 300))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 10, what="generation under way")
    assert (await http.post(f"{sim.url}/pause_generation", json={"mode": "retract"})).status_code == 200
    [load] = (await http.get(f"{sim.url}/v1/loads")).json()["loads"]
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["queues"]["retracted"]) == (0, 1, 1)
    assert load["num_used_tokens"] == 0  # its KV is gone
    assert (await http.post(f"{sim.url}/continue_generation", json={})).status_code == 200
    assert await task == reference(prompt, 300)
    assert sim.engine.counters["retractions"] == 1 and sim.engine.counters["recomputed_tokens"] > 8
