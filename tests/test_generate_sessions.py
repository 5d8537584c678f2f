"""`POST /generate` in a session: its turns are recorded like the OpenAI routes' (token-in/token-out, the caller's
ids as the prompt, the prefix rule for continuing a sample) and reach the trainer once the session is finished.
Without a session, /generate records nothing."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
from redis.asyncio import Redis

from backends.routed_experts import decode_npy_b64
from backends.sim.engine import EngineSettings
from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from gateway.store import Keys
from gateway.trainer import TrajectoryConsumer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, stream_generate

PROMPT = [11, 22, 33, 44, 55]
KEYS = Keys()


async def generate(http: httpx.AsyncClient, gw: RunningGateway, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"{gw.url}/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_generate_in_a_session_records_its_turns_for_the_trainer(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    """Turn 2 resends turn 1's prompt + output + environment tokens: the same sample, the extension masked 0; turn 3
    (streamed) starts over: a new sample. Finished with a reward, the session reaches the trainer exactly."""
    gw = await make_gateway([await make_sim("vllm")])
    first = await generate(http, gw, generate_body(PROMPT, 5, session_id="loop"))
    assert (first["session_id"], first["sample_index"], first["new_sample"]) == ("loop", 0, True)
    env = [7, 8, 9]
    second_prompt = PROMPT + first["output_ids"] + env
    second = await generate(http, gw, generate_body(second_prompt, 4, session_id="loop"))
    assert (second["sample_index"], second["new_sample"]) == (0, False)
    third = await stream_generate(http, gw.url, generate_body([3, 1, 4], 3, session_id="loop"))
    assert (third.final["sample_index"], third.final["new_sample"]) == (1, True)

    session = (await http.get(f"{gw.url}/v1/sessions/loop")).json()
    assert [s["num_turns"] for s in session["samples"]] == [2, 1]
    finished = await http.post(f"{gw.url}/v1/sessions/loop/finish", json={"reward": 1.5})
    assert finished.status_code == 200

    async with TrajectoryConsumer(redis_server.url, "trainers", "t0") as consumer:
        batch = await consumer.next_batch(4, timeout=5)
        (trajectory,) = batch.trajectories
        assert (trajectory.session_id, trajectory.reward) == ("loop", 1.5)
        sample, other = trajectory.samples
        assert sample.prompt_ids.tolist() == PROMPT
        assert sample.response_ids.tolist() == first["output_ids"] + env + second["output_ids"]
        assert sample.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * 4
        expected_logprobs = first["logprobs"] + [0.0] * 3 + second["logprobs"]
        assert np.allclose(sample.logprobs, np.asarray(expected_logprobs, np.float32))
        assert sample.versions.tolist() == [0] * 5 + [-1] * 3 + [0] * 4
        assert other.prompt_ids.tolist() == [3, 1, 4] and other.response_ids.tolist() == third.output_ids
        assert other.loss_mask.tolist() == [1] * 3
        rows = batch.to_tensors()
        assert rows["loss_mask"][0].sum().item() == 9
        assert await consumer.ack(batch) == 1


async def test_generate_without_a_session_records_nothing(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    await generate(http, gw, generate_body(PROMPT, 3))  # the app's first request may set its own keys up
    keys = sorted(await redis.keys("*"))
    answer = await generate(http, gw, generate_body(PROMPT, 3))
    streamed = await stream_generate(http, gw.url, generate_body(PROMPT, 3))
    assert answer["session_id"] is None and "sample_index" not in answer
    assert streamed.final["session_id"] is None
    assert sorted(await redis.keys("*")) == keys


async def test_generate_in_a_finished_session_is_a_conflict(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    await generate(http, gw, generate_body(PROMPT, 3, session_id="done"))
    assert (await http.post(f"{gw.url}/v1/sessions/done/finish", json={})).status_code == 200
    again = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id="done"))
    assert again.status_code == 409
    assert [s["num_turns"] for s in (await http.get(f"{gw.url}/v1/sessions/done")).json()["samples"]] == [1]


async def test_routed_experts_of_a_continued_turn_cover_its_whole_input(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The second turn fetches only its new positions' experts (the sample holds the others); its answer still has
    one row per position of `input_ids + output_ids` but the last, as a one-shot's has."""
    sim = await make_sim("vllm", engine=EngineSettings(block_size=16, routed_experts_output=True))
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True)])
    first = await generate(http, gw, generate_body(PROMPT, 4, session_id="r3", return_routed_experts=True))
    prompt = PROMPT + first["output_ids"] + [9]
    second = await generate(http, gw, generate_body(prompt, 4, session_id="r3", return_routed_experts=True))
    assert second["new_sample"] is False
    experts = decode_npy_b64(second["routed_experts"])
    oneshot = await generate(http, gw, generate_body(prompt, 4, return_routed_experts=True))
    assert oneshot["output_ids"] == second["output_ids"]
    assert experts.shape[0] == len(prompt) + 4 - 1
    assert np.array_equal(experts, decode_npy_b64(oneshot["routed_experts"]))
    (sample,) = await gw.services.store.load_samples("r3")
    assert sample.routed_experts is not None and np.array_equal(sample.routed_experts, experts)
