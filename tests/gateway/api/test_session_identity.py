"""Session identity without touching the agent (issue 36 §1): the API key names the session (`sessions.identity:
api_key`), or the URL prefix `/sessions/{id}/v1` does; `grp-` names make GRPO groups; one precedence. Real
simulator, real gateway, real Redis, the official `openai` client configured with only a base URL and a key."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis

from gateway.server import RunningGateway
from gateway.trainer import TrajectoryConsumer
from tests.conftest import GatewayFactory, SimFactory

API_KEY = "sk-secret-test-key"
KEY_MODE = {"identity": "api_key"}


def agent(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """An agent as CLI and SDK agents configure one: a base URL and an API key, nothing else."""
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


async def two_turns(api: openai.AsyncOpenAI) -> tuple[list[int], list[int]]:
    """Two turns of one conversation; the sampled ids of each."""
    messages: list[Any] = [{"role": "user", "content": "first"}]
    first = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "2"}]
    second = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    rollout = second.model_extra["rollout"] if second.model_extra else {}
    assert rollout["choices"][0]["sample_index"] == 0 and not rollout["choices"][0]["new_sample"]
    sampled = [c.model_extra["rollout"]["choices"][0]["output_ids"] for c in (first, second) if c.model_extra]
    return sampled[0], sampled[1]


async def assert_one_exact_sample(
    gw: RunningGateway, http: httpx.AsyncClient, session: str, out: Any, headers: dict[str, str] | None = None
) -> None:
    """The session holds one sample of two turns: turn 1's ids, the environment's (mask 0), turn 2's (mask 1)."""
    first, second = out
    meta = (await http.get(f"{gw.url}/v1/sessions/{session}", headers=headers)).json()
    assert [s["num_turns"] for s in meta["samples"]] == [2]
    [sample] = await gw.services.store.load_samples(session)
    response, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
    assert response[: len(first)] == first and response[len(response) - len(second) :] == second
    env = len(response) - len(first) - len(second)
    assert env > 0 and mask == [1] * len(first) + [0] * env + [1] * len(second)


def session_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    found: str = answer.json()["rollout"]["session_id"]
    return found


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_the_api_key_names_the_session(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions=KEY_MODE)
    api = agent(f"{gw.url}/v1", "agent-7")
    await assert_one_exact_sample(gw, http, "agent-7", await two_turns(api))
    await api.close()
    # Anthropic's header names it too.
    answer = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"x-api-key": "agent-8"})
    assert session_of(answer) == "agent-8"


async def test_a_configured_key_with_a_session_name(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions=KEY_MODE, server={"api_keys": [API_KEY]})
    api = agent(f"{gw.url}/v1", f"{API_KEY}:ep-1")
    await assert_one_exact_sample(gw, http, "ep-1", await two_turns(api), {"authorization": f"Bearer {API_KEY}"})
    await api.close()
    # A configured key alone authenticates and names no session: a one-turn session.
    alone = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {API_KEY}"})
    assert session_of(alone).startswith("chat-")
    # The secret is checked, never stored: no Redis key or value holds it.
    async for key in redis.scan_iter():
        assert API_KEY.encode() not in key
        if await redis.type(key) == b"hash":
            assert not any(API_KEY.encode() in v for v in (await redis.hgetall(key)).values())
    # Wrong key: 403; no token: 401; an empty session name: 400 naming the format. OpenAI-style bodies.
    for auth, status in (("Bearer sk-wrong:ep-1", 403), (None, 401), (f"Bearer {API_KEY}:", 400)):
        headers = {"authorization": auth} if auth else {}
        refused = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers)
        assert refused.status_code == status, refused.text
        assert set(refused.json()["error"]) >= {"message", "type", "param", "code"}
        assert API_KEY not in refused.text
        if status == 400:
            assert "'<api key>:<session>'" in refused.json()["error"]["message"]


async def test_api_key_identity_without_a_token_is_a_401(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions=KEY_MODE)
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    # The routes that run no turn stay as open as the gateway's keys leave them.
    assert (await http.get(f"{gw.url}/v1/models")).status_code == 200


async def test_the_url_prefix_names_the_session(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = agent(f"{gw.url}/sessions/abc/v1", "anything")
    await assert_one_exact_sample(gw, http, "abc", await two_turns(api))
    models = await api.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert (await http.get(f"{gw.url}/sessions/abc/v1/models")).json() == (await http.get(f"{gw.url}/v1/models")).json()
    completion = await api.completions.create(model="tiny", prompt="raw text", max_tokens=3)
    assert completion.model_extra and completion.model_extra["rollout"]["session_id"] == "abc"
    meta = (await http.get(f"{gw.url}/v1/sessions/abc")).json()
    assert [s["num_turns"] for s in meta["samples"]] == [2, 1]
    await api.close()


@pytest.mark.parametrize("form", ["key", "url"])
async def test_grp_names_make_one_group(
    form: str, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    sections: dict[str, Any] = {"sessions": KEY_MODE} if form == "key" else {}
    gw = await make_gateway([await make_sim("vllm")], **sections)
    members = ["grp-step3-0of2", "grp-step3-1of2"]
    for member in members:
        api = agent(f"{gw.url}/v1", member) if form == "key" else agent(f"{gw.url}/sessions/{member}/v1", "x")
        await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "solve"}], max_tokens=3)
        await api.close()
    for index, member in enumerate(members):
        meta = (await http.get(f"{gw.url}/v1/sessions/{member}")).json()
        assert meta["metadata"] == {"group_id": "step3", "group_index": str(index), "group_size": "2"}
        assert (await http.post(f"{gw.url}/v1/sessions/{member}/finish", json={"reward": index})).status_code == 200
    async with TrajectoryConsumer(redis_server.url, "trainers", "t0", group_by="group_id") as consumer:
        batch = await consumer.next_batch(8, timeout=5)
        assert sorted(t.session_id for t in batch.trajectories) == members and batch.num_groups == 1
        await consumer.ack(batch)


async def test_a_grp_name_without_a_size_and_a_disagreeing_group(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions=KEY_MODE)
    ok = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"x-api-key": "grp-a-b-3"})
    assert session_of(ok) == "grp-a-b-3"
    meta = (await http.get(f"{gw.url}/v1/sessions/grp-a-b-3")).json()
    assert meta["metadata"] == {"group_id": "a-b", "group_index": "3"}
    body = CHAT | {"metadata": {"group_id": "other"}}
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-api-key": "grp-a-b-4"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"
    url = f"{gw.url}/sessions/grp-a-2of2/v1/chat/completions"
    bad_index = await http.post(url, json=CHAT, headers={"x-api-key": "k"})
    assert bad_index.status_code == 400, bad_index.text
    # A header or body name is taken as it is: no group metadata (today's behaviour).
    headers = {"x-session-id": "grp-h-0", "x-api-key": "k"}
    plain = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers)
    assert session_of(plain) == "grp-h-0"
    assert (await http.get(f"{gw.url}/v1/sessions/grp-h-0")).json()["metadata"] == {}


async def test_precedence_path_header_body_key_user(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions=KEY_MODE)
    key = {"authorization": "Bearer s-key"}
    header = key | {"x-session-id": "s-header"}
    body = CHAT | {"session_id": "s-body", "user": "s-user"}
    for path in ("/v1/chat/completions", "/sessions/s-path/v1/chat/completions"):
        url = f"{gw.url}{path}"
        expect = "s-path" if path.startswith("/sessions") else None
        assert session_of(await http.post(url, json=body, headers=header)) == (expect or "s-header")
        assert session_of(await http.post(url, json=body, headers=key)) == (expect or "s-body")
        assert session_of(await http.post(url, json=CHAT | {"user": "s-user"}, headers=key)) == (expect or "s-key")
    completion = {"model": "tiny", "prompt": "go", "max_tokens": 2, "session_id": "s-body"}
    assert session_of(await http.post(f"{gw.url}/v1/completions", json=completion, headers=key)) == "s-body"
    assert (
        session_of(await http.post(f"{gw.url}/v1/completions", json=completion | {"session_id": None}, headers=key))
        == "s-key"
    )


async def test_the_header_mode_forms_are_unchanged(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    url, key = f"{gw.url}/v1/chat/completions", {"authorization": "Bearer some-key"}
    body = CHAT | {"session_id": "s-body", "user": "s-user"}
    assert session_of(await http.post(url, json=body, headers=key | {"x-session-id": "s-header"})) == "s-header"
    assert session_of(await http.post(url, json=body, headers=key)) == "s-body"
    assert session_of(await http.post(url, json=CHAT | {"user": "s-user"}, headers=key)) == "s-user"
    assert session_of(await http.post(url, json=CHAT, headers=key)).startswith("chat-")  # the key names nothing
    assert session_of(await http.post(url, json=CHAT)).startswith("chat-")
