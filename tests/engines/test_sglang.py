"""The sglang tier: the gateway over a real SGLang server (sglang on the CPU, tiny Qwen2 in float32), started once
per session, with the stand-in `sgl_kernel` on its path (tests/engines/sgl_kernel_stub; see docs/engines.md).

Needs scripts/engines/setup.sh; skips without it, fails without it under CI.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory
from tests.engines import agent_checks, checks, teacher_checks
from tests.engines.conftest import gateway_over
from tests.engines.direct import greedy, restore
from tests.engines.servers import EngineServer
from tests.gateway_helpers import generate_body

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

MakeGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def make(
    sglang_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> AsyncIterator[MakeGateway]:
    """Gateways over the session's SGLang server (`keep_mode` = retract | in_place), from a restored engine."""
    await restore(http, sglang_server)
    made: list[RunningGateway] = []

    async def make_one(weights: dict[str, Any] | None = None, **replica: Any) -> RunningGateway:
        if sglang_server.routed_experts:
            layers, top_k, _ = checks.experts_shape(sglang_server)
            replica |= {"routed_experts": True, "routed_experts_shape": (layers, top_k)}
        made.append(await gateway_over(make_gateway, sglang_server, weights, **replica))
        return made[-1]

    yield make_one
    for gateway in made:  # a live gateway's health probe would see the restore and load its weights back
        await gateway.stop()
    await restore(http, sglang_server)
    assert_stand_in_unused(sglang_server)


def assert_stand_in_unused(server: EngineServer) -> None:
    """No function of the stand-in sgl_kernel ran (each one records its call before raising)."""
    assert server.stub_calls is None or not server.stub_calls.exists(), server.stub_calls.read_text()


async def test_generate_by_token_ids_with_logprobs(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.generate_matches_engine(http, await make(), sglang_server)


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole-answer"])
async def test_abort_pause_resumes_with_the_uninterrupted_greedy_tokens(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient, whole: bool
) -> None:
    await checks.abort_pause_resumes_transparently(http, await make(), sglang_server, whole)


@pytest.mark.parametrize("keep_mode", ["retract", "in_place"])
async def test_keep_pause_continues_in_the_engine(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient, keep_mode: str
) -> None:
    gw = await make(keep_mode=keep_mode)
    await checks.keep_pause_continues_in_the_engine(http, gw, sglang_server, keep_mode)


async def test_weight_update_from_disk_with_weight_version(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.abort_update_resumes_under_new_weights(http, await make(), sglang_server)


async def test_retract_update_continue_reports_weight_version_spans(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    report = await checks.keep_update_switches_weights_in_flight(http, await make(keep_mode="retract"), sglang_server)
    assert report["flush_pending"] == [] and report["stale"] == []


async def test_in_place_update_drains_nothing_and_new_work_misses_the_old_prefix(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    """pause(in_place) + /update_weights_from_disk with `flush_cache: false` (requests carry their version as
    `extra_key`): the frozen request keeps its KV, is not retracted, and the replica takes new work at once; the
    old version's prefix is a miss, the new version's a hit."""
    gw = await make(keep_mode="in_place")
    report = await checks.salted_keep_update(http, gw, sglang_server, "in_place")
    assert report["updated"] == [gw.services.pool.all()[0].id]
    assert not gw.services.pool.all()[0].draining


async def test_in_place_update_with_kv_recomputed_flushes_the_cache_before_new_work(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    """`weights.kv_after_update: recompute`: pause(in_place) + /update_weights_from_disk answers 400 (weights and
    version switched, radix cache not flushed: the frozen request holds KV). The gateway counts the update as done,
    keeps new work off the replica until the request finished and the cache is flushed, so new work never reuses
    KV of the old weights."""
    gw = await make({"kv_after_update": "recompute"}, keep_mode="in_place")
    report = await checks.keep_update_switches_weights_in_flight(http, gw, sglang_server, "in_place")
    assert report["updated"] == [gw.services.pool.all()[0].id]
    assert report["flush_pending"] == report["updated"]
    replica = gw.services.pool.all()[0]
    await asyncio.wait_for(_until(lambda: not replica.draining), 30)
    # A prompt whose prefix the old weights had cached: served from a flushed cache, it equals a clean v2 run.
    answer = (await http.post(f"{gw.url}/generate", json=generate_body(checks.PROMPT, 32), timeout=120)).json()
    assert answer["versions"] == [1] * 32
    await checks.flush(http, sglang_server)
    clean, _ = await greedy(http, sglang_server, checks.PROMPT, 32)
    assert answer["output_ids"] == clean


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


async def test_new_requests_during_a_pause(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.new_requests_wait_during_a_pause(http, await make(), sglang_server)


async def test_client_disconnect_aborts_the_engine_request(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.disconnect_aborts_the_engine_request(http, await make(), sglang_server)


async def test_continuation_hits_the_prefix_cache(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    # The radix cache matches token by token (page size 1).
    await checks.continuation_hits_the_prefix_cache(http, await make(), sglang_server, "sglang:cached_tokens_total", 1)


async def test_routed_experts_splice_on_resume(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    if not sglang_server.routed_experts:
        pytest.skip("routed-expert capture crashes on the CPU (hard-coded pin_memory); GPU: scripts/gpu_check.sh")
    await checks.routed_experts_splice_on_resume(http, await make(), sglang_server)


async def test_an_in_memory_transfer_serves_what_a_disk_load_of_the_same_checkpoint_serves(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    """Inline tensors (`/update_weights_from_tensor`), pickled by the reference trainer's publisher."""
    await checks.transfer_serves_what_a_disk_load_serves(http, await make(), sglang_server)


async def test_a_transfer_never_committed_is_reloaded_and_the_next_is_committed_through_another_gateway(
    make: MakeGateway, sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    weights = {"transfer_commit_timeout_s": 10}
    holder, other = await make(weights), await make(weights)
    await checks.a_transfer_never_committed_then_one_committed_elsewhere(http, holder, other, sglang_server)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["checkpoint", "transfer"])
async def test_the_reference_trainer_learns_through_the_gateway(
    make: MakeGateway, sglang_server: EngineServer, tmp_path: Path, weights: str
) -> None:
    await checks.reference_trainer_learns(await make(), sglang_server, str(tmp_path / "checkpoints"), weights)


async def test_engine_and_trainer_logprobs_agree_under_the_same_weights(
    make: MakeGateway, sglang_server: EngineServer, tmp_path: Path
) -> None:
    await checks.logprob_mismatch_is_numerical(await make(), sglang_server, str(tmp_path))


@pytest.mark.parametrize("history", ["tokens", "template"])
async def test_a_reasoning_tool_agent_is_one_sample_in_tokens_mode(
    sglang_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient, history: str
) -> None:
    await restore(http, sglang_server)
    await agent_checks.reasoning_agent_episode(http, make_gateway, sglang_server, {}, history)
    await restore(http, sglang_server)


async def test_a_teacher_scores_the_tokens_as_the_engine_sampled_them(
    sglang_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await restore(http, sglang_server)
    await teacher_checks.scores_match_what_the_engine_sampled(http, sglang_server)


async def test_load_reports_mean_what_the_simulator_says(sglang_server: EngineServer, http: httpx.AsyncClient) -> None:
    await restore(http, sglang_server)
    await checks.load_reports_mean_what_the_simulator_says(http, sglang_server)


async def test_placement_reads_the_engine_load(
    sglang_server: EngineServer, make_gateway: GatewayFactory, make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    await restore(http, sglang_server)
    await checks.placement_reads_the_engine_load(http, make_gateway, make_sim, sglang_server)
