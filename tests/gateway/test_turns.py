"""`gateway.turns.runner`, a session's turn end to end, through the official client, real Redis and the trainer: GRPO
groups from one request (`group: true`: the n choices become n sessions of one group, each finished with its own
reward) and per-sample rewards on finish; OpenAI's `metadata` on a request reaching its session (stored on the turn
that creates it, new keys added on later turns, a changed value refused: 400, nothing stored); and a turn cut short,
recorded with what it generated."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis

from gateway.server import RunningGateway
from gateway.store import Keys
from gateway.trainer import TrajectoryConsumer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import (
    client,
)
from tests.sim_helpers import wait_for

KEYS = Keys()


async def test_a_group_request_makes_one_session_per_choice_and_the_trainer_gets_the_group(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = client(gw, **{"X-Session-ID": "task7"})
    chat = await api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "solve"}],
        max_tokens=6,
        n=3,
        temperature=1.0,
        metadata={"task_id": "7"},
        extra_body={"group": True},
    )
    rollout = chat.model_extra["rollout"]
    members = [c["session_id"] for c in rollout["choices"]]
    assert members == ["task7-0", "task7-1", "task7-2"] and rollout["group_id"] == "task7"
    assert [c["sample_index"] for c in rollout["choices"]] == [0, 0, 0]
    assert (await http.get(f"{gw.url}/v1/sessions/task7")).status_code == 404  # the id only names the members
    for index, member in enumerate(members):
        meta = (await http.get(f"{gw.url}/v1/sessions/{member}")).json()
        assert meta["metadata"] == {"task_id": "7", "group_id": "task7", "group_size": 3, "group_index": index}
        assert [s["num_turns"] for s in meta["samples"]] == [1]

    # A member goes on as a session of its own.
    reply = chat.choices[1].message
    member_api = client(gw, **{"X-Session-ID": members[1]})
    follow = await member_api.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "solve"},
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": "again"},
        ],
        max_tokens=4,
    )
    assert follow.model_extra["rollout"]["choices"][0]["sample_index"] == 0
    await member_api.close()

    rewards = {members[0]: 0.0, members[1]: 1.0, members[2]: 0.5}
    for member, reward in rewards.items():
        assert (await http.post(f"{gw.url}/v1/sessions/{member}/finish", json={"reward": reward})).status_code == 200
    async with TrajectoryConsumer(redis_server.url, "trainers", "t0", group_by="group_id") as consumer:
        batch = await consumer.next_batch(8, timeout=5)
        assert sorted(t.session_id for t in batch.trajectories) == members and batch.num_groups == 1
        assert {t.session_id: t.reward for t in batch.trajectories} == rewards
        tensors = batch.to_tensors()
        assert tensors["rewards"].tolist() == [rewards[t.session_id] for t in batch.trajectories]
        sampled = {c["session_id"]: c["output_ids"] for c in rollout["choices"]}
        assert batch.trajectories[0].samples[0].response_ids.tolist()[:6] == sampled[batch.trajectories[0].session_id]
        await consumer.ack(batch)
    await api.close()


async def test_a_group_whose_member_exists_is_a_conflict(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    await http.post(f"{gw.url}/v1/sessions", json={"session_id": "g-1"})
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "group": True, "session_id": "g"}
    refused = await http.post(f"{gw.url}/v1/completions", json=body)
    assert refused.status_code == 409 and "g-1" in refused.json()["error"]["message"]
    assert await redis.exists(Keys().meta("g-0")) == 0  # nothing of the group was created
    bad = await http.post(f"{gw.url}/v1/completions", json=body | {"session_id": "h", "metadata": {"group_size": "3"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata"


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


# -- a request's metadata reaches its session --------------------------------------------------------------------------


async def session_of(http: httpx.AsyncClient, gw: RunningGateway, session_id: str) -> dict[str, Any]:
    response = await http.get(f"{gw.url}/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    meta: dict[str, Any] = response.json()
    return meta


async def test_request_metadata_reaches_the_session(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = client(gw, **{"X-Session-ID": "meta"})
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    chat = await api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, metadata={"task_id": "t1", "group_id": "g"}
    )
    assert (await session_of(http, gw, "meta"))["metadata"] == {"task_id": "t1", "group_id": "g"}

    messages += [{"role": "assistant", "content": chat.choices[0].message.content}, {"role": "user", "content": "and"}]
    await api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, metadata={"task_id": "t1", "attempt": "2"}
    )
    session = await session_of(http, gw, "meta")
    assert session["metadata"] == {"task_id": "t1", "group_id": "g", "attempt": "2"}
    assert [s["num_turns"] for s in session["samples"]] == [2]

    try:
        await api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, metadata={"task_id": "t2"})
        raise AssertionError("a changed metadata value was accepted")
    except openai.BadRequestError as exc:
        assert exc.status_code == 400 and exc.body["param"] == "metadata"  # type: ignore[index]
    session = await session_of(http, gw, "meta")
    assert session["metadata"]["task_id"] == "t1" and [s["num_turns"] for s in session["samples"]] == [2]
    await api.close()


async def test_metadata_of_a_created_session_and_of_a_one_turn_request(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    """A session created with JSON metadata accepts the same values as strings (OpenAI metadata is str → str); a
    request without a session stores its metadata with its one-turn session."""
    gw = await make_gateway([await make_sim("vllm")])
    created = await http.post(f"{gw.url}/v1/sessions", json={"session_id": "made", "metadata": {"group_size": 4}})
    assert created.status_code == 201
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "session_id": "made"}
    same = await http.post(f"{gw.url}/v1/completions", json=body | {"metadata": {"group_size": "4", "task": "x"}})
    assert same.status_code == 200, same.text
    assert (await session_of(http, gw, "made"))["metadata"] == {"group_size": 4, "task": "x"}
    other = await http.post(f"{gw.url}/v1/completions", json=body | {"metadata": {"group_size": "5"}})
    assert other.status_code == 400 and other.json()["error"]["param"] == "metadata"

    one = await http.post(
        f"{gw.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "metadata": {"task_id": "solo"}},
    )
    session_id = one.json()["rollout"]["session_id"]
    await wait_for(lambda: redis.xlen(KEYS.trajectories), what="a trajectory")  # type: ignore[arg-type,return-value]
    meta = await gw.services.store.get_session(session_id)
    assert meta is not None and meta.metadata == {"task_id": "solo", "one_turn": True}


# -- a turn cut short --------------------------------------------------------------------------------------------------


async def test_turn_cut_mid_segment_is_recorded_with_aligned_arrays(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug: a turn cut mid-segment (client gone, or shutdown past its bound) had its tokens and logprobs but not
    their versions (those were assigned when a segment closed), so recording it raised TrajectoryFormatError
    and the tokens generated so far were lost instead of checkpointed."""
    from backends.sim.engine import EngineSettings

    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    gw = await make_gateway([sim])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000, "stream": True}
    body |= {"ignore_eos": True}
    seen = 0
    async with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": "cut"}) as r:
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 20:
                break  # leave mid-generation: the connection closes
    store = gw.services.store

    async def recorded() -> bool:
        return bool(await store.load_samples("cut"))

    await wait_for(recorded, what="the cut turn recorded")
    [sample] = await store.load_samples("cut")
    n = len(sample.response_ids)
    assert sample.cancelled and 15 <= n < 2000
    assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n
    assert not gw.services.turns.sessions.lock("cut").locked()
