"""Per-sample rewards on finish, through real HTTP, real Redis and the trainer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.server import RunningGateway
from gateway.trainer import TrajectoryConsumer
from tests.conftest import GatewayFactory, SimFactory


def client(gw: RunningGateway, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", default_headers=headers, max_retries=0)


@pytest.mark.parametrize("count", [1, 3])
async def test_per_sample_rewards_on_finish_reach_every_row(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any, count: int
) -> None:
    """n = 2 in one session: two samples of one trajectory, each with its own reward; a count other than the
    session's samples is a 400 and leaves the session active."""
    gw = await make_gateway([await make_sim("vllm")])
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "session_id": "two"}
    assert (await http.post(f"{gw.url}/v1/completions", json=body)).status_code == 200
    wrong = await http.post(f"{gw.url}/v1/sessions/two/finish", json={"rewards": [0.5] * count})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "rewards"
    assert (await http.get(f"{gw.url}/v1/sessions/two")).json()["status"] == "active"
    done = await http.post(f"{gw.url}/v1/sessions/two/finish", json={"reward": 0.5, "rewards": [0.25, 1.0]})
    assert done.status_code == 200
    assert (await http.get(f"{gw.url}/v1/sessions/two")).json()["rewards"] == [0.25, 1.0]
    async with TrajectoryConsumer(redis_server.url, "trainers", "t0") as consumer:
        batch = await consumer.next_batch(4, timeout=5)
        (trajectory,) = batch.trajectories
        assert (trajectory.reward, trajectory.rewards) == (0.5, [0.25, 1.0])
        assert batch.to_tensors()["rewards"].tolist() == [0.25, 1.0]
        await consumer.ack(batch)
