"""OpenAI's `metadata` on a request reaches its session: stored on the turn that creates it, new keys added on later
turns, a changed value refused (400, nothing stored); through the official client and real Redis."""

from __future__ import annotations

from typing import Any

import httpx
import openai
from redis.asyncio import Redis

from gateway.server import RunningGateway
from gateway.store import Keys
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import client
from tests.sim_helpers import wait_for

KEYS = Keys()


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
