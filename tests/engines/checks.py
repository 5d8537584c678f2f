"""The checks both real-engine tiers run through the gateway (real gateway, real Redis, real engine over HTTP).

Greedy references are the engine's own output for the same prompt run alone (the tiny models are served in
float32, where greedy decoding does not depend on the batch). A resumed request re-prefills its tokens, which
takes other kernels than decoding; the models are built with peaked distributions so that cannot flip a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from backends.routed_experts import decode_npy_b64
from backends.sim.common import SimServerSettings
from backends.sim.engine import EngineSettings
from backends.sim.server import serve_in_process
from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from tests.conftest import ADMIN, ADMIN_TOKEN
from tests.engines.direct import (
    flush,
    greedy,
    load_from_disk,
    metric,
    prompt_of,
    restore,
    wait_metric,
    weight_checksums,
)
from tests.engines.servers import EngineServer
from tests.gateway_helpers import Streamed, generate_body, scrape, stream_generate, value
from tests.sim_helpers import wait_for

PROMPT = prompt_of(8)
# Tokens of the requests a pause or update interrupts: long enough (seconds) that the interruption lands mid-way.
LONG = {"vllm": 3000, "sglang": 600}
_references: dict[tuple[str, str], list[int]] = {}
PAUSE_AFTER = 100  # tokens streamed before the interruption
ATTEMPTS = 6  # tries of `interrupted` to catch its request in the engine
# A non-streamed SGLang request runs this long before `interrupted` freezes it (its 600 tokens take ~1 s here).
SGLANG_WHOLE_RUN_S = 0.2

RUNNING = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}
WAITING = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs"}
GENERATED = {"vllm": "vllm:generation_tokens_total", "sglang": "sglang:generation_tokens_total"}


def transfer_backend(server: EngineServer) -> str:
    """The in-memory transfer a tier pushes: vLLM's `--weight-transfer-config` backend (`gloo` on the CPU, `nccl`
    where scripts/gpu_check.sh starts it), SGLang's inline tensors."""
    if server.kind == "sglang":
        return "tensor"
    if server.weight_transfer is None:
        pytest.skip("the vLLM server takes no in-memory weight transfer (started without --weight-transfer-config)")
    return server.weight_transfer


async def admin(http: httpx.AsyncClient, gw: RunningGateway, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"{gw.url}/admin/{path}", json=body, headers=ADMIN, timeout=300.0)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def interrupted(
    http: httpx.AsyncClient,
    gw: RunningGateway,
    server: EngineServer,
    interrupt: Any,
    prompt: list[int] = PROMPT,
    keep_mode: str = "retract",
    whole: bool = False,
    **extra: Any,
) -> Streamed:
    """Stream `total` greedy tokens through the gateway (`whole`: ask for them in one answer, which the gateway
    takes from the engine in one answer per segment); once the engine generated PAUSE_AFTER of them, await
    `interrupt()` (a gateway pause or update).

    On this two-core machine the test process (which also runs the gateway) can be descheduled while the engine
    keeps generating, so a pause sent "mid-request" may land after the request finished. The engine is therefore
    frozen first with its own keep-style pause (a direct call), the request is checked to be still in the engine,
    and only then does the gateway act; if the request had already finished, the attempt is repeated (ATTEMPTS).
    The gateway's own pause/update calls are what the test checks.

    The stalls of several seconds once seen here (every other request ran to its end before the test saw a token)
    were vLLM's EngineCore spinning on the core the test needs (`launcher.pin_engine_core_beside_its_worker`)."""
    total = LONG[server.kind]
    for _attempt in range(ATTEMPTS):
        before = await metric(http, server, GENERATED[server.kind])
        progress = [0]
        body = generate_body(prompt, total, **extra)
        task = asyncio.create_task(
            whole_answer(http, gw, body) if whole else stream_generate(http, gw.url, body, progress)
        )
        # Whichever says first that generation is under way: the engine's counter (vLLM counts every step;
        # SGLang only when a request finishes) or the tokens that reached the client.
        while not task.done() and progress[0] < PAUSE_AFTER:
            if await metric(http, server, GENERATED[server.kind]) - before >= PAUSE_AFTER:
                break
            if whole and server.kind == "sglang" and await in_engine(http, server) == 1:
                # Nothing counts SGLang's tokens before the answer: let it run a while, then check (below) that
                # the tokens from before the interruption came back (SGLANG_WHOLE_RUN_S bounds no synchronisation).
                await asyncio.sleep(SGLANG_WHOLE_RUN_S)
                break
            await asyncio.sleep(0.1)  # not faster: scraping /metrics costs the engine's API server CPU
        await freeze(http, server, keep_mode)
        if await held_in_engine(http, server):
            break
        await unfreeze(http, server)  # it finished before the freeze landed: try again
        await task
    else:
        raise AssertionError(f"the request finished before it could be interrupted, {ATTEMPTS} times")
    await interrupt()
    result = await asyncio.wait_for(task, 300)
    assert result.error is None, result.error
    assert result.final["finish_reason"] == "length"
    assert len(result.output_ids) == total == len(result.logprobs) == len(result.final["versions"])
    return result


async def whole_answer(http: httpx.AsyncClient, gw: RunningGateway, body: dict[str, Any]) -> Streamed:
    """A non-streamed `/generate`, as `stream_generate` reports a stream."""
    response = await http.post(f"{gw.url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return Streamed(answer.pop("output_ids"), answer.pop("logprobs"), answer)


async def freeze(http: httpx.AsyncClient, server: EngineServer, keep_mode: str = "retract") -> None:
    """Pause the engine directly, keeping in-flight requests (vLLM keep; SGLang retract or in_place, the mode
    the gateway will use: a retracted request holds no KV, which would change an in_place scenario)."""
    if server.kind == "vllm":
        # clear_cache false: vLLM 0.32 otherwise resets its cache on a keep pause too, preempting the request.
        response = await http.post(f"{server.url}/pause", params={"mode": "keep", "clear_cache": "false"})
    else:
        response = await http.post(f"{server.url}/pause_generation", json={"mode": keep_mode})
    assert response.status_code == 200, response.text


async def unfreeze(http: httpx.AsyncClient, server: EngineServer) -> None:
    if server.kind == "vllm":
        response = await http.post(f"{server.url}/resume")
    else:
        response = await http.post(f"{server.url}/continue_generation", json={})
    assert response.status_code == 200, response.text


async def held_in_engine(http: httpx.AsyncClient, server: EngineServer, timeout: float = 5.0) -> bool:
    """Whether the frozen engine holds our one request. Its gauges can lag (the API server publishes the
    engine's stats as it catches up with its backlog), so a request counts as gone only if they never show it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while await in_engine(http, server) != 1:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def generated_once_settled(http: httpx.AsyncClient, server: EngineServer, timeout: float = 10.0) -> float:
    """The engine's generated-token count once it stopped rising for half a second. A pause reaches SGLang's
    scheduler after its HTTP answer (the API server forwards it without waiting), and the counter lags the
    scheduler: a step or two may still be counted. An engine that never stops fails here."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = await metric(http, server, GENERATED[server.kind])
    while True:
        await asyncio.sleep(0.5)
        now = await metric(http, server, GENERATED[server.kind])
        if now == last:
            return now
        assert asyncio.get_running_loop().time() < deadline, f"the engine kept generating ({last} -> {now} tokens)"
        last = now


async def in_engine(http: httpx.AsyncClient, server: EngineServer) -> float:
    """Requests the engine holds: running, or queued (SGLang puts retracted requests back in the queue)."""
    return await metric(http, server, RUNNING[server.kind]) + await metric(http, server, WAITING[server.kind])


async def long_reference(http: httpx.AsyncClient, server: EngineServer) -> list[int]:
    """The served model's uninterrupted greedy completion of PROMPT (LONG tokens), run alone; computed once per
    server (every test starts from the same weights)."""
    key = (server.url, server.model)
    if key not in _references:
        _references[key], _ = await greedy(http, server, PROMPT, LONG[server.kind])
    return _references[key]


def summary(result: Streamed) -> dict[str, Any]:
    """The final event without its per-token lists, plus the version counts (for assertion messages)."""
    final = {k: v for k, v in result.final.items() if k != "versions"}
    versions = result.final.get("versions") or []
    return final | {"tokens": len(result.output_ids), "v0": versions.count(0), "v1": versions.count(1)}


def split(versions: list[int]) -> int:
    """The index of the first token of the newer version (versions must be 0…0 then 1…1)."""
    k = versions.index(1)
    assert versions == [0] * k + [1] * (len(versions) - k), versions
    return k


async def generate_matches_engine(http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer) -> None:
    """Token ids in, token ids and logprobs out, equal to the engine's own answer; streamed and not."""
    ref_ids, ref_logprobs = await greedy(http, server, PROMPT, 48)
    answer = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 48), timeout=120)).json()
    assert answer["output_ids"] == ref_ids
    assert answer["finish_reason"] == "length" and answer["versions"] == [0] * 48 and answer["num_resumes"] == 0
    assert all(abs(a - b) < 1e-3 for a, b in zip(answer["logprobs"], ref_logprobs, strict=True))
    assert all(lp <= 0 for lp in answer["logprobs"]) and len(set(ref_ids)) > 10  # real, varied output
    streamed = await stream_generate(http, gw.url, generate_body(PROMPT, 48))
    assert streamed.output_ids == ref_ids and streamed.final["finish_reason"] == "length"


async def abort_pause_resumes_transparently(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, whole: bool = False
) -> None:
    """An abort pause mid-generation (the engine ends the request with its partial tokens, streamed or in its one
    answer: `whole`) is invisible: the resumed completion equals an uninterrupted one, token for token."""
    reference = await long_reference(http, server)

    async def pause_and_resume() -> None:
        await admin(http, gw, "pause", {"mode": "abort"})
        await asyncio.sleep(0.5)
        await admin(http, gw, "resume", {"version": 1})  # same weights, new label: shows where it resumed

    result = await interrupted(http, gw, server, pause_and_resume, whole=whole)
    assert result.final["num_resumes"] >= 1, summary(result)
    k = split(result.final["versions"])
    # A non-streamed SGLang request is frozen after a time, not a token count: its partial tokens came back (k > 0).
    assert (1 if whole and server.kind == "sglang" else PAUSE_AFTER) <= k < len(reference), summary(result)
    assert result.output_ids == reference


async def keep_pause_continues_in_the_engine(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, keep_mode: str = "retract"
) -> None:
    """keep: the request stays frozen in the engine (no abort, no resume by the gateway) and goes on after the
    pause; the version label that changed meanwhile is reported per token from the engine's spans."""
    reference = await long_reference(http, server)

    async def pause_and_resume() -> None:
        await admin(http, gw, "pause", {"mode": "keep"})
        assert await held_in_engine(http, server)  # still held by the engine
        before = await generated_once_settled(http, server)
        await asyncio.sleep(1.0)
        assert await metric(http, server, GENERATED[server.kind]) == before  # frozen
        await admin(http, gw, "resume", {"version": 1})

    result = await interrupted(http, gw, server, pause_and_resume, keep_mode=keep_mode)
    assert result.final["num_resumes"] == 0, summary(result)
    k = split(result.final["versions"])
    assert PAUSE_AFTER <= k < len(reference)
    assert result.output_ids == reference


async def abort_update_resumes_under_new_weights(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer
) -> None:
    """A weight update (abort mode) mid-generation: tokens before it are the old model's, tokens after it are
    exactly the new model's greedy continuation of everything so far, each with its version; the engine's
    prefix cache was flushed (a continuation on stale KV would differ from a fresh one)."""
    reference = await long_reference(http, server)
    update = {"version": 1, "path": server.second_checkpoint, "mode": "abort"}
    result = await interrupted(http, gw, server, lambda: admin(http, gw, "weights", update))
    assert result.final["num_resumes"] >= 1, summary(result)
    k = split(result.final["versions"])
    out = result.output_ids
    assert out[:k] == reference[:k]
    assert out[k:] != reference[k:]  # the new weights are in use
    await flush(http, server)
    continuation, _ = await greedy(http, server, PROMPT + out[:k], len(out) - k)
    assert out[k:] == continuation


async def keep_update_switches_weights_in_flight(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, keep_mode: str = "retract"
) -> dict[str, Any]:
    """A weight update in keep mode: the frozen request continues under the new weights; the engine's spans
    give each token its version. Returns the admin report."""
    reference = await long_reference(http, server)
    update = {"version": 1, "path": server.second_checkpoint, "mode": "keep"}
    reports: list[dict[str, Any]] = []

    async def run_update() -> None:
        reports.append(await admin(http, gw, "weights", update))

    result = await interrupted(http, gw, server, run_update, keep_mode=keep_mode)
    assert result.final["num_resumes"] == 0, summary(result)
    k = split(result.final["versions"])
    assert PAUSE_AFTER <= k < len(reference)
    assert result.output_ids[:k] == reference[:k]
    assert result.output_ids[k:] != reference[k:]
    return reports[0]


PREEMPTED = {"vllm": "vllm:num_preemptions_total", "sglang": "sglang:num_retracted_requests_total"}
# SGLang's two counters appear once they counted something (labelled counters): absent is zero.
CACHED = {"vllm": "vllm:prefix_cache_hits_total", "sglang": "sglang:cached_tokens_total"}
SALTED_PROMPT = prompt_of(300, seed=5)  # two whole vLLM-CPU blocks (128 tokens) and more


async def salted_keep_update(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, keep_mode: str = "retract"
) -> dict[str, Any]:
    """Issue 50 §1: every request carries its replica's version as a cache salt, so a `keep` update flushes
    nothing: the request frozen in the engine is not preempted (no recompute; SGLang `retract` retracts by its own
    design, so there only the flush is checked), and the replica takes new work at once. A prompt cached under the
    old version is a miss under the new one (and its tokens are the new weights' clean ones); the new version's
    own prefix is a hit. Returns the admin report."""
    warm = await http.post(f"{gw.url}/generate", json=generate_body(SALTED_PROMPT, 4, session_id="s"), timeout=120)
    assert warm.status_code == 200, warm.text  # SALTED_PROMPT cached under version 0's salt
    preempted = await metric(http, server, PREEMPTED[server.kind], absent_is_zero=True)
    report = await keep_update_switches_weights_in_flight(http, gw, server, keep_mode)
    assert report["flush_pending"] == [] and report["stale"] == [], report
    if keep_mode != "retract" or server.kind == "vllm":
        assert await metric(http, server, PREEMPTED[server.kind], absent_is_zero=True) == preempted
    hits = await metric(http, server, CACHED[server.kind], absent_is_zero=True)
    body = generate_body(SALTED_PROMPT, 16, session_id="s")
    after = (await http.post(f"{gw.url}/generate", json=body, timeout=120)).json()
    assert after["versions"] == [1] * 16
    assert (
        await metric(http, server, CACHED[server.kind], absent_is_zero=True) == hits
    )  # nothing of version 0's prefix reused
    again = (await http.post(f"{gw.url}/generate", json=body, timeout=120)).json()
    assert (
        await metric(http, server, CACHED[server.kind], absent_is_zero=True) >= hits + 128
    )  # version 1's own prefix reused
    assert again["output_ids"] == after["output_ids"]
    await flush(http, server)
    clean, _ = await greedy(http, server, SALTED_PROMPT, 16)
    assert after["output_ids"] == clean
    return report


async def new_requests_wait_during_a_pause(http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer) -> None:
    """A request that arrives while the gateway is paused waits (it does not fail), then runs under the new label."""
    reference, _ = await greedy(http, server, PROMPT, 16)
    before = await metric(http, server, GENERATED[server.kind])
    await admin(http, gw, "pause", {"mode": "abort"})
    task = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 16), timeout=120))
    await asyncio.wait({task}, timeout=1.0)
    assert not task.done()
    assert await metric(http, server, GENERATED[server.kind]) == before
    await admin(http, gw, "resume", {"version": 1})
    answer = (await task).json()
    assert answer["output_ids"] == reference and answer["versions"] == [1] * 16


async def disconnect_aborts_the_engine_request(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer
) -> None:
    """A client that goes away: the engine request is aborted and never generates. The engine is frozen (a direct
    keep pause, which holds new requests) while the request is dispatched and the client leaves, so the check
    does not depend on how fast this busy machine schedules anyone; without the abort the held request would
    run its 4000 tokens after the unfreeze."""
    total = 4000
    replica = gw.services.pool.all()[0]
    before = await metric(http, server, GENERATED[server.kind])
    await freeze(http, server)
    try:
        body = generate_body(PROMPT, total, stream=True)
        task = asyncio.create_task(http.post(f"{gw.url}/generate", json=body, timeout=60))
        await wait_for(lambda: replica.in_flight == 1, timeout=30, what="the request dispatched to the engine")
        await asyncio.sleep(0.5)  # the engine has received it (held while frozen)
        task.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_for(lambda: replica.in_flight == 0, timeout=30, what="the gateway ended the engine request")
    finally:
        await unfreeze(http, server)
    await asyncio.sleep(2.0)
    assert await metric(http, server, GENERATED[server.kind]) == before  # the held request never ran
    assert await in_engine(http, server) == 0


async def continuation_hits_the_prefix_cache(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, hits_metric: str, block: int
) -> float:
    """The next turn of a session (prompt + the tokens just generated) reuses the engine's KV for whole blocks,
    including those made of generated tokens. Returns the number of cached prompt tokens."""
    prompt = prompt_of(300, seed=1)
    first = (await http.post(f"{gw.url}/generate", json=generate_body(prompt, 40, session_id="s1"))).json()
    before = await metric(http, server, hits_metric)
    follow = prompt + first["output_ids"]
    second = (await http.post(f"{gw.url}/generate", json=generate_body(follow, 8, session_id="s1"))).json()
    assert second["finish_reason"] == "length"
    hits = await metric(http, server, hits_metric) - before
    assert hits >= (len(follow) - 1) // block * block >= len(prompt) // block * block > 0
    return hits


def experts_shape(server: EngineServer) -> tuple[int, int, int]:
    """(layers, top_k, experts) of the served MoE model, from its config."""
    config = json.loads((server.model_path / "config.json").read_text())
    return config["num_hidden_layers"], config["num_experts_per_tok"], config["num_experts"]


async def routed_experts_splice_on_resume(http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer) -> None:
    """R3 (GPU recipe; CPU builds cannot capture experts): across an abort pause and resume the gateway returns
    the experts of every position but the last (prompt + output - 1), each position keeping the experts it was
    routed to when it ran (splice), which equal those of an uninterrupted run of the same greedy tokens."""
    layers, top_k, experts = experts_shape(server)
    total = LONG[server.kind]
    body = generate_body(PROMPT, total, return_routed_experts=True)
    plain = (await http.post(f"{gw.url}/generate", json=body, timeout=300)).json()
    reference = decode_npy_b64(plain["routed_experts"])
    assert reference.shape == (len(PROMPT) + total - 1, layers, top_k)

    async def pause_and_resume() -> None:
        await admin(http, gw, "pause", {"mode": "abort"})
        await admin(http, gw, "resume", {"version": 1})

    result = await interrupted(http, gw, server, pause_and_resume, return_routed_experts=True)
    assert result.final["num_resumes"] >= 1, summary(result)
    assert result.output_ids == plain["output_ids"]
    spliced = decode_npy_b64(result.final["routed_experts"])
    assert spliced.shape == reference.shape
    assert int(spliced.min()) >= 0 and int(spliced.max()) < experts
    # Same weights, same greedy tokens: the routing of the common positions agrees (top-k sets, order-free;
    # a GPU may break an exact tie between two experts differently, hence 99 % rather than all).
    same = np.all(np.sort(reference, axis=-1) == np.sort(spliced, axis=-1), axis=(1, 2))
    assert same.mean() >= 0.99, f"{same.mean():.3f} of positions routed alike"


async def reference_trainer_learns(
    gw: RunningGateway, server: EngineServer, checkpoints: str, weights: str = "checkpoint"
) -> None:
    """The reference GRPO trainer (`trainers.loop`) learns the digits task through the gateway: a fixed-seed run
    starts below 0.05 mean reward and reaches 0.8 within 40 steps, while every step's weights reach the engine in
    abort mode under live rollouts (so some samples are resumed across an update), from a checkpoint or pushed in
    memory (`weights="transfer"`: gloo into vLLM on the CPU, inline tensors into SGLang), and on tokens the engine
    sampled with
    the learner's own weights its log-probabilities match torch's. Anything wrong on the path (tokens, masks,
    log-probabilities, versions, the weights' way in) stops the rise."""
    from trainers.grpo import GRPOConfig
    from trainers.loop import LoopConfig, train

    config = LoopConfig(
        steps=40,
        stop_at_reward=0.8,
        seed=0,
        weights=weights,  # type: ignore[arg-type]
        transfer_backend=transfer_backend(server) if weights == "transfer" else None,  # type: ignore[arg-type]
        grpo=GRPOConfig(seed=0, threads=1),
    )
    result = await train(gw.url, gw.services.redis_url, server.model_path, checkpoints, config, admin_token=ADMIN_TOKEN)
    rewards = result.rewards
    curve = ", ".join(f"{r:.2f}" for r in rewards)
    print(f"\n{server.kind} reward curve ({weights}): {curve}")
    assert rewards[0] < 0.05, curve
    assert rewards[-1] >= 0.8, f"no step reached 0.8 in {len(rewards)} steps: {curve}"
    last = result.steps[-1]
    assert last.resumed_samples > 0, "no sample spanned a weight update"
    mismatch = [s.stats.mismatch_mean for s in result.steps if s.stats.mismatch_mean == s.stats.mismatch_mean]
    assert mismatch and max(mismatch) < 1e-3, mismatch  # float32 on both sides
    assert gw.services.weights.version == last.version  # every step's checkpoint was posted and taken
    await dashboard_shows_the_run(gw, updates=len(result.steps))


async def reference_trainer_learns_a_chat_task(gw: RunningGateway, server: EngineServer, checkpoints: str) -> None:
    """The digits task over three answers of one chat with a tool result between (`LoopConfig.turns`), the gateway
    in `sessions.history: tokens`: each episode is one sample (no turn started another), and the reward rises from
    below 0.05 to 0.8 as in the one-turn run, with every step's checkpoint loaded in abort mode."""
    from trainers.grpo import GRPOConfig
    from trainers.loop import LoopConfig, train

    config = LoopConfig(steps=40, stop_at_reward=0.8, seed=0, turns=3, grpo=GRPOConfig(seed=0, threads=1))
    result = await train(gw.url, gw.services.redis_url, server.model_path, checkpoints, config, admin_token=ADMIN_TOKEN)
    curve = ", ".join(f"{r:.2f}" for r in result.rewards)
    print(f"\n{server.kind} three-turn reward curve: {curve}")
    assert result.rewards[0] < 0.05, curve
    assert result.rewards[-1] >= 0.8, f"no step reached 0.8 in {len(result.rewards)} steps: {curve}"
    async with httpx.AsyncClient() as http:
        samples = await scrape(http, gw.url)
    continued = value(samples, "rollout_gateway_chat_turns_total", history="tokens")
    assert continued > 0 and value(samples, "rollout_gateway_chat_turns_total", history="rewritten") == 0


async def dashboard_shows_the_run(gw: RunningGateway, updates: int) -> None:
    """What `/dashboard` draws after a real training run (issue 40): throughput, the weight updates on the timeline,
    the trainer's backlog, and the reward per weight version rising (the run's learning curve)."""
    state: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=10.0) as http:

        async def rewards_of_several_versions() -> bool:
            state.update((await http.get(f"{gw.url}/dashboard/state")).json())
            return len(state["reward"]) >= 2

        await wait_for(rewards_of_several_versions, timeout=15.0, what="the reward of two versions on the dashboard")
    series = state["series"]
    assert sum(series["turns"]) > 0 and sum(series["tokens"]) > 0 and sum(series["delivered"]) > 0
    assert {"pending", "unacked", "reclaimed_total"} <= set(series)
    done = [u for u in state["timeline"] if u["status"] == "updated"]
    assert len(done) >= min(updates, 2), state["timeline"]
    curve = state["reward"]
    assert curve[0]["mean"] < 0.3 and max(point["mean"] for point in curve) >= 0.5, curve


async def logprob_mismatch_is_numerical(gw: RunningGateway, server: EngineServer, scratch: str) -> None:
    """`benchmarks.mismatch` through the gateway on the tier's float32 server: under the same weights the engine's
    log-probabilities of the sampled tokens equal torch's to float32 noise, before and after the engine loaded a
    checkpoint the trainer wrote; under the previous version (one training step) they differ far more."""
    from pathlib import Path

    from benchmarks.mismatch import measure_through

    same, previous = await measure_through(
        gw.url, server.model_path, "float32", Path(scratch), prompts=4, samples=4, max_tokens=16, token=ADMIN_TOKEN
    )
    print(f"\n{server.kind} float32 mismatch: same {same}, previous {previous}")
    assert same.tokens == 2 * 4 * 4 * 16 and same.p99 < 1e-3 and same.max < 1e-2, same
    assert previous.mean > 10 * same.mean, (same, previous)


# The load the simulator reports (backends/sim: vllm_metrics.py, sglang_load.py), by the names the real engines use.
LOAD_GAUGES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:num_retracted_reqs",
    ),
}
LOAD_COUNTERS = {
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"),
    # SGLang's labelled counters have no sample before they count (sglang:cached_tokens_total, ...; see PREEMPTED).
    "sglang": (),
}
USAGE = {"vllm": "vllm:kv_cache_usage_perc", "sglang": "sglang:token_usage"}
LOAD_TOKENS = {"vllm": 3000, "sglang": 2000}  # long enough to be seen running on a busy two-core machine
# Per-rank fields of SGLang's /v1/loads the simulator reports (srt/managers/load_snapshot.py, `LoadSnapshot`).
LOADS_FIELDS = (
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "cache_hit_rate",
)


async def load_reports_mean_what_the_simulator_says(http: httpx.AsyncClient, server: EngineServer) -> None:
    """Issue 51 §1: the load names the simulator reports exist on the real engine, with its labels and meaning.
    One long request in flight: running 1, waiting 0, KV usage in (0, 1]; SGLang's /v1/loads lists rank 0 with the
    same, and `?dp_rank=0` only it. A simulator replica of the same dialect reports every one of those names."""
    kind = server.kind
    task = asyncio.create_task(_long_stream(http, server, LOAD_TOKENS[kind]))
    try:
        await wait_for(
            lambda: _one_running_with_kv(http, server), timeout=60, what="the long request running, holding KV"
        )
        assert await metric(http, server, WAITING[kind]) == 0
        text = (await http.get(f"{server.url}/metrics")).text
        real = _sample_names(text)
        for name in (*LOAD_GAUGES[kind], *LOAD_COUNTERS[kind]):
            assert name in real, f"the engine exports no {name}"
        if kind == "vllm":
            assert any(line.startswith(f'{RUNNING[kind]}{{engine="0"') for line in text.splitlines()), text[:2000]
        else:
            await _loads_agree(http, server)
    finally:
        task.cancel()  # the client goes away: the engine aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_metric(http, server, RUNNING[kind], 0, timeout=60)
    assert set((*LOAD_GAUGES[kind], *LOAD_COUNTERS[kind])) <= await _simulator_names(kind)


async def placement_reads_the_engine_load(
    http: httpx.AsyncClient, make_gateway: Any, make_sim: Any, server: EngineServer
) -> None:
    """Issue 51 §3 on the CPU tier: a gateway over the real engine and a simulator replica beside it, placing by
    engine load (`sticky_least_loaded`), reads the real engine's load as it reports it (a request another client sent
    running, KV in use) and places new sessions on the simulator replica meanwhile; then the other way round: the
    simulator replica busy with a request sent around the gateway, new sessions go to the engine."""
    kind = server.kind
    sim = await make_sim(kind, EngineSettings(block_size=16 if kind == "vllm" else 1))
    routing = {"policy": "sticky_least_loaded", "load_interval_s": 0.1, "load_bound": 0}
    gw = await make_gateway(
        [ReplicaConfig(url=server.url, backend=kind), sim],  # type: ignore[arg-type]
        model={"tokenizer": str(server.model_path), "max_model_len": 4096},
        generation={"request_timeout_s": 300},
        routing=routing,
    )
    pool = gw.services.pool
    engine = pool.get(server.url.removeprefix("http://"))
    beside = pool.get(sim.url.removeprefix("http://"))
    assert engine is not None and beside is not None

    async def placed(session: str) -> str:
        body = generate_body(prompt_of(16, seed=len(session)), 2, session_id=session)
        response = await http.post(f"{gw.url}/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        replicas: list[str] = response.json()["replicas"]
        return replicas[0]

    task = asyncio.create_task(_long_stream(http, server, LOAD_TOKENS[kind]))  # sent to the engine, not the gateway
    try:
        await wait_for(  # its gauges lag the scheduler (published each logging interval)
            lambda: engine.engine_load is not None and engine.engine_load.requests >= 1 and bool(engine.kv_usage),
            timeout=60,
            what="the engine's own report of a request the gateway never saw, holding KV",
        )
        assert engine.in_flight == 0
        assert [await placed(f"busy{i}") for i in range(3)] == [beside.id] * 3
    finally:
        task.cancel()  # the client goes away: the engine aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_for(
        lambda: engine.engine_load is not None and engine.engine_load.requests == 0,
        timeout=60,
        what="the engine's report of its request aborted",
    )
    await http.post(f"{sim.url}/sim/speed", json={"token_delay": 0.05})  # its request stays in flight
    task = asyncio.create_task(_long_stream(http, SimpleNamespace(url=sim.url, kind=kind), 2000))
    try:
        await wait_for(
            lambda: beside.engine_load is not None and beside.engine_load.requests >= 1,
            timeout=60,
            what="the simulator replica's report of a request the gateway never saw",
        )
        assert [await placed(f"idle{i}") for i in range(3)] == [engine.id] * 3
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert pool.affinity.moved == 0


async def _long_stream(http: httpx.AsyncClient, server: EngineServer | Any, n: int) -> None:
    """A streamed request of `n` tokens sent straight to `server` (an engine, or a simulator replica of its kind)."""
    if server.kind == "vllm":
        url = f"{server.url}/v1/completions"
        body: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "stream": True}
    else:
        url = f"{server.url}/generate"
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
    async with http.stream("POST", url, json=body, timeout=300) as response:
        async for _ in response.aiter_bytes():
            pass


async def _one_running_with_kv(http: httpx.AsyncClient, server: EngineServer) -> bool:
    """Gauges lag the scheduler (published each logging interval): poll until they show the request."""
    if await metric(http, server, RUNNING[server.kind]) != 1:
        return False
    usage = await metric(http, server, USAGE[server.kind])
    assert 0 <= usage <= 1, usage
    return usage > 0


async def _loads_agree(http: httpx.AsyncClient, server: EngineServer) -> None:
    answer = (await http.get(f"{server.url}/v1/loads")).json()
    [load] = answer["loads"]
    assert set(LOADS_FIELDS) <= set(load), sorted(load)
    assert (load["dp_rank"], load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1, 0), load
    assert 0 < load["token_usage"] <= 1 and load["num_used_tokens"] > 0, load
    assert "queues" in load and {"waiting", "retracted"} <= set(load["queues"]), load
    [only] = (await http.get(f"{server.url}/v1/loads", params={"dp_rank": 0})).json()["loads"]
    assert only["dp_rank"] == 0
    assert (await http.get(f"{server.url}/v1/loads", params={"dp_rank": 1})).json()["loads"] == []


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


async def _simulator_names(kind: str) -> set[str]:
    """The sample names of a simulator replica of this dialect, after one request (counters appear once counted)."""
    settings = SimServerSettings(dialect=kind, engine=EngineSettings(block_size=16 if kind == "vllm" else 1))  # type: ignore[arg-type]
    async with serve_in_process(settings) as sim, httpx.AsyncClient(timeout=30) as client:
        if kind == "vllm":
            await client.post(f"{sim.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        else:
            await client.post(
                f"{sim.url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            )
        return _sample_names((await client.get(f"{sim.url}/metrics")).text)


async def transfer_serves_what_a_disk_load_serves(
    http: httpx.AsyncClient, gw: RunningGateway, server: EngineServer, fan_out: bool = False
) -> None:
    """Issue 53 §2, on the CPU builds: the second checkpoint pushed in memory through the gateway's two-phase update
    by the reference trainer's publisher (vLLM over its `--weight-transfer-config` backend: `gloo` on the CPU, the
    project's plugin; SGLang `tensor`, inline) leaves
    the engine holding exactly what a disk load of the same checkpoint leaves: equal weight checksums (vLLM's cover
    its embeddings, norms and head only: on the CPU every linear layer is packed for oneDNN and its parameter left
    empty), the same greedy tokens with logprobs within float32 noise, under the transferred version's label."""
    from safetensors.torch import load_file

    from gateway.weights import version_label
    from trainers.publish import TransferPublisher

    prompt, n = prompt_of(40, seed=3), 12
    before, served = await greedy(http, server, prompt, n), await weight_checksums(http, server)
    await load_from_disk(http, server, server.second_checkpoint)
    from_disk, loaded = await greedy(http, server, prompt, n), await weight_checksums(http, server)
    assert from_disk[0] != before[0]  # the second checkpoint answers otherwise: the comparison below means something
    assert loaded.keys() == served.keys() and loaded != served
    changed = sum(loaded[name] != served[name] for name in loaded)
    print(f"\n{server.kind}: {changed} of {len(loaded)} weight checksums differ between the two checkpoints")
    await restore(http, server)

    backend = transfer_backend(server)
    tensors = load_file(str(Path(server.second_checkpoint) / "model.safetensors"))
    async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN, timeout=300.0) as trainer:
        publisher = TransferPublisher(trainer, "abort", backend, fan_out=fan_out)  # type: ignore[arg-type]
        try:
            answer = await publisher.transfer(1, list(tensors.items()))
        finally:
            await publisher.aclose()
    assert answer["status"] == "updated", answer
    info = await http.get(f"{server.url}/{'weight_info' if server.kind == 'vllm' else 'model_info'}")
    assert info.json()["weight_version"] == version_label(1)
    transferred = await greedy(http, server, prompt, n)
    assert transferred[0] == from_disk[0]
    assert transferred[1] == pytest.approx(from_disk[1], abs=1e-5)
    assert await weight_checksums(http, server) == loaded


class SplitBalancer(httpx.AsyncBaseTransport):
    """A load balancer in front of two gateways of one fleet: a transfer's begin (`POST /admin/weights`) reaches the
    first, every other call the second (its `GET /admin/weights/{version}`, its commit)."""

    def __init__(self, begin_at: RunningGateway, rest_at: RunningGateway) -> None:
        self.begin_at, self.rest_at = httpx.URL(begin_at.url), httpx.URL(rest_at.url)
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        begin = request.method == "POST" and request.url.path == "/admin/weights"
        to = self.begin_at if begin else self.rest_at
        request.url = request.url.copy_with(host=to.host, port=to.port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def a_transfer_never_committed_then_one_committed_elsewhere(
    http: httpx.AsyncClient, holder: RunningGateway, other: RunningGateway, server: EngineServer
) -> None:
    """Issue 53's faults on a real engine, two gateways on one Redis in front of it, the trainer behind a balancer
    that sends a transfer's begin to one and its other calls to the other:
    - a trainer that pushes half the tensors and never commits: at `weights.transfer_commit_timeout_s` the update
      fails, the engine (which held mixed weights under the old label) is loaded again from the last checkpoint
      path the gateway knows and serves exactly that checkpoint under its version;
    - the next transfer, committed through the gateway that does not hold it: relayed, committed by the holder,
      answered on the other; the engine then serves exactly the transferred weights under their version."""
    from safetensors.torch import load_file

    from gateway.weights import version_label
    from trainers.publish import TransferPublisher

    prompt, n = prompt_of(40, seed=5), 12
    label = "weight_info" if server.kind == "vllm" else "model_info"
    served = await greedy(http, server, prompt, n)
    await admin(http, holder, "weights", {"version": 1, "path": server.second_checkpoint, "mode": "abort"})
    second = await greedy(http, server, prompt, n)
    assert second[0] != served[0]
    tensors = list(load_file(str(server.model_path / "model.safetensors")).items())  # the served checkpoint
    backend = transfer_backend(server)
    async with httpx.AsyncClient(
        base_url=holder.url, headers=ADMIN, timeout=300.0, transport=SplitBalancer(holder, other)
    ) as trainer:
        publisher = TransferPublisher(trainer, "abort", backend)  # type: ignore[arg-type]
        try:
            [url] = await publisher.begin(2)
            await publisher.push(url, tensors[: len(tensors) // 2])

            async def ended() -> bool:
                shown = await http.get(f"{other.url}/admin/weights/2", headers=ADMIN)
                return bool(shown.status_code == 200 and shown.json()["status"] == "failed")

            await wait_for(ended, timeout=120.0, what="the uncommitted transfer's end at its deadline")
            await wait_for(lambda: holder.services.weights.state == "serving", timeout=60.0, what="serving again")
            assert (holder.services.weights.version, other.services.weights.version) == (1, 1)
            assert (await http.get(f"{server.url}/{label}")).json()["weight_version"] == version_label(1)
            reloaded = await greedy(http, server, prompt, n)
            assert reloaded[0] == second[0] and reloaded[1] == pytest.approx(second[1], abs=1e-5)

            [url] = await publisher.begin(3)
            await publisher.push(url, tensors)
            answer = await publisher.commit(3)  # to the other gateway: relayed to the holder
        finally:
            await publisher.aclose()
    assert answer["status"] == "updated", answer
    assert (holder.services.weights.version, other.services.weights.version) == (3, 3)
    assert (await http.get(f"{server.url}/{label}")).json()["weight_version"] == version_label(3)
    transferred = await greedy(http, server, prompt, n)
    assert transferred[0] == served[0] and transferred[1] == pytest.approx(served[1], abs=1e-5)
