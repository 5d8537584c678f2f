"""Security and request limits over real HTTP: admin and agent credentials, size/count/token/concurrency limits,
every refusal a 4xx OpenAI-style error naming the field or limit, and secrets that never reach a log."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import openai
import orjson
import pytest
from redis.asyncio import Redis

from backends.sim.engine import EngineSettings
from gateway.config import load_config
from gateway.errors import ConfigError, Overloaded
from gateway.server import RunningGateway
from gateway.session.quotas import SessionQuota
from tests.conftest import ADMIN, ADMIN_TOKEN, GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body
from tests.sim_helpers import wait_for

AGENT_KEY = "sk-agent-0123456789abcdef"
OTHER_KEY = "sk-agent-fedcba9876543210"
USER = [{"role": "user", "content": "x"}]


async def gateway_on(make_sim: SimFactory, make_gateway: GatewayFactory, delay: float = 0.0, **server: Any) -> Any:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=delay))
    return await make_gateway([sim], server=server)


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    return error


async def nothing_stored(redis: Redis) -> bool:
    return not [k async for k in redis.scan_iter(match="rg:{*")]


async def test_too_many_messages(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await gateway_on(make_sim, make_gateway, max_messages=3)
    body = {"model": "tiny", "messages": USER * 4, "max_tokens": 2}
    response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    error = assert_error(response, 400, "messages", "too_many_messages")
    assert "server.max_messages" in error["message"] and error["type"] == "invalid_request_error"
    assert await nothing_stored(redis)
    ok = await http.post(f"{gw.url}/v1/chat/completions", json=body | {"messages": USER * 3})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 9}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": USER, "max_completion_tokens": 9},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 9}, "max_tokens"),
        ("/generate", generate_body([5, 6, 7], 9), "sampling_params.max_tokens"),
    ],
)
async def test_max_tokens_limit(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    gw = await gateway_on(make_sim, make_gateway, max_tokens_limit=8)
    error = assert_error(await http.post(f"{gw.url}{path}", json=body), 400, param, "max_tokens_limit")
    assert "server.max_tokens_limit" in error["message"]
    assert await nothing_stored(redis)


@pytest.mark.parametrize(
    ("path", "param"), [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/messages", None)]
)
async def test_a_text_the_context_cannot_hold_is_refused_before_it_is_tokenized(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    path: str,
    param: str | None,
) -> None:
    """Issue 38 §10: a 15 MB prompt cost seconds of CPU and a GB of memory to tokenize before its 400; its length
    alone says it cannot fit, so nothing reaches the tokenizer (its worker threads take every long text)."""
    gw = await gateway_on(make_sim, make_gateway, max_body_bytes=32 * 1024 * 1024)
    text = "word " * 3_000_000  # 15 MB
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 400, response.text[:300]
    assert "cannot fit the context length" in response.text
    if param is not None:  # Anthropic's error shape names no field
        assert response.json()["error"]["param"] == param
    assert gw.services.turns.tokenizer.thread_encodes == 0
    assert await nothing_stored(redis)
    fits = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "word " * 900}]}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=fits)).status_code == 200


@pytest.mark.parametrize(("path", "param"), [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
async def test_a_text_within_the_length_bound_but_over_the_context_is_counted_in_chunks(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, path: str, param: str
) -> None:
    """Issue 38 §10, the rest: a text short enough for the length bound (the tiny vocabulary's longest token is 82
    bytes, so 300,000 characters might be 4,096 tokens) but far longer than the context is refused after counting
    its first chunk, not after tokenizing all of it."""
    gw = await gateway_on(make_sim, make_gateway)
    text = "word " * 60_000  # 300,000 characters, 120,000 tokens
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 400, response.text[:300]
    assert "counted up to the context length of 4096 tokens" in response.text
    assert response.json()["error"]["param"] == param
    assert gw.services.turns.tokenizer.thread_encodes == 1  # one chunk of 65,536 characters told it


async def test_concurrent_sessions_per_key(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw: RunningGateway = await gateway_on(
        make_sim, make_gateway, delay=0.005, api_keys=[AGENT_KEY, OTHER_KEY], max_sessions_per_key=1
    )
    mine, other = {"authorization": f"Bearer {AGENT_KEY}"}, {"authorization": f"Bearer {OTHER_KEY}"}
    long = generate_body([5, 6, 7], 300, session_id="first")
    first = asyncio.create_task(http.post(f"{gw.url}/generate", json=long, headers=mine))
    quota = gw.services.quota
    await wait_for(lambda: quota.in_flight() == 1, what="the first session")
    second = generate_body([5, 6, 7], 2, session_id="second")
    error = assert_error(
        await http.post(f"{gw.url}/generate", json=second, headers=mine), 429, None, "too_many_concurrent_sessions"
    )
    assert "server.max_sessions_per_key" in error["message"]
    chat = {"model": "tiny", "messages": USER, "max_tokens": 2}
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=chat, headers=mine)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    theirs = generate_body([5, 6, 7], 2, session_id="theirs")  # a session is its key's own (issue 38 §6)
    assert (await http.post(f"{gw.url}/generate", json=theirs, headers=other)).status_code == 200  # its own quota
    assert (await first).status_code == 200
    assert (await http.post(f"{gw.url}/generate", json=second, headers=mine)).status_code == 200  # slot freed
    stream = {"model": "tiny", "messages": USER, "max_tokens": 2, "stream": True}
    async with http.stream("POST", f"{gw.url}/v1/chat/completions", json=stream, headers=mine) as response:
        assert response.status_code == 200
        await response.aread()
    assert quota.in_flight() == 0  # every slot released, streamed or not


def test_session_quota_counts_sessions_not_requests() -> None:
    quota = SessionQuota(limit=2)
    same = [quota.acquire("key", "s1"), quota.acquire("key", "s1")]  # two turns in flight of one session: one slot
    alone = quota.acquire("key", None)  # a request without a session is a session of its own
    assert quota.in_flight("key") == 2
    with pytest.raises(Overloaded):
        quota.acquire("key", None)
    quota.acquire("other", None).release()  # another key has its own slots
    same[0].release()
    with pytest.raises(Overloaded):
        quota.acquire("key", "s2")  # s1 still has a request in flight
    same[1].release()
    same[1].release()  # idempotent
    alone.release()
    assert quota.in_flight() == 0
    later = {quota.acquire("key", None).session for _ in range(2)}
    assert len(later) == 2 and alone.session not in later  # never the slot of another request


async def test_agent_key_never_reaches_admin(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await gateway_on(make_sim, make_gateway, api_keys=[AGENT_KEY])
    agent = {"authorization": f"Bearer {AGENT_KEY}"}
    calls = [
        ("POST", "/admin/weights", {"version": 1, "path": "ckpt-1"}),
        ("POST", "/admin/pause", {}),
        ("POST", "/admin/resume", {"version": 1}),
        ("GET", "/admin/status", None),
        ("POST", "/admin/replicas", {"url": "http://127.0.0.1:9", "backend": "sim"}),
        ("DELETE", f"/admin/replicas/{gw.services.pool.all()[0].id}", None),
    ]
    for method, path, body in calls:
        for headers, status in ((agent, 403), ({}, 401), ({"authorization": f"Bearer {ADMIN_TOKEN}x"}, 403)):
            response = await http.request(method, f"{gw.url}{path}", json=body, headers=headers)
            assert_error(response, status, None, None)
    assert gw.services.weights.version == 0 and gw.services.weights.serving and len(gw.services.pool.all()) == 1
    admin_as_agent = await http.post(
        f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2}, headers=ADMIN
    )
    assert_error(admin_as_agent, 403, None, None)  # nor is the admin token an agent key


async def test_secrets_never_logged(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    gw = await gateway_on(make_sim, make_gateway, api_keys=[AGENT_KEY])
    api = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=AGENT_KEY, max_retries=0)
    await api.chat.completions.create(model="tiny", messages=USER, max_tokens=3)  # type: ignore[arg-type]
    wrong = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=AGENT_KEY[:-1] + "Z", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        await wrong.chat.completions.create(model="tiny", messages=USER, max_tokens=3)  # type: ignore[arg-type]
    await http.post(f"{gw.url}/admin/weights", json={"version": 1, "path": "ckpt-1"}, headers=ADMIN)
    await http.get(f"{gw.url}/admin/status", headers={"authorization": f"Bearer {ADMIN_TOKEN}-wrong"})
    monkeypatch.setenv("RG_SERVER__ADMIN_TOKEN", "")  # an invalid secret in the environment...
    monkeypatch.setenv("RG_SERVER__API_KEYS", orjson.dumps([AGENT_KEY, 7]).decode())
    with pytest.raises(ConfigError) as raised:
        load_config()
    logging.getLogger("test").error("%s", raised.value)  # ...is not echoed by the error a log would carry
    logging.getLogger("test").info("settings: %r %s", gw.services.settings, gw.services.settings)
    await api.close()
    await wrong.close()
    out, err = capfd.readouterr()
    everything = caplog.text + out + err + str(raised.value)
    assert "settings:" in caplog.text and "api_keys" in str(raised.value)
    for secret in (AGENT_KEY, AGENT_KEY[:-1] + "Z", ADMIN_TOKEN, f"{ADMIN_TOKEN}-wrong"):
        assert secret not in everything


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sessions", {"metadata": {"blob": "x" * 20_000}}),
        ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 2, "metadata": {"k": "x" * 20_000}}),
        ("/generate", generate_body([5, 6, 7], 2, session_id="m", metadata={"k": "x" * 20_000})),
    ],
)
async def test_metadata_has_its_own_size_limit(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    path: str,
    body: dict[str, Any],
) -> None:
    """Issue 38 §7: session metadata was bounded only by the body size (5 × 10 MiB kept 84 MB for a day)."""
    gw = await gateway_on(make_sim, make_gateway)
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("metadata"), response.text
    assert "16384 bytes" in response.json()["error"]["message"]
    assert await nothing_stored(redis)


async def test_a_sessions_metadata_has_a_bound_across_its_requests(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Issue 52 §6: metadata was bounded per request only: 40 turns of 15 KB each left 615 KB in one session, all
    delivered into its trajectory. The session's whole metadata is bounded (`store.max_session_metadata_bytes`,
    64 KiB by default): the turn, or the finish, that would pass it is a 400 naming `metadata`, and nothing of it is
    stored (the turn generates nothing)."""
    gw = await gateway_on(make_sim, make_gateway)
    headers = {"X-Session-ID": "much-metadata"}

    def turn(index: int) -> dict[str, Any]:
        return {"model": "tiny", "messages": USER, "max_tokens": 2, "metadata": {f"k{index}": "x" * 15_000}}

    for index in range(4):  # 4 × 15 KB: within 64 KiB
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=turn(index), headers=headers)).is_success
    session = (await http.get(f"{gw.url}/v1/sessions/much-metadata")).json()
    over = await http.post(f"{gw.url}/v1/chat/completions", json=turn(4), headers=headers)
    error = assert_error(over, 400, "metadata", "session_metadata_too_large")
    assert "65536 bytes" in error["message"] and "store.max_session_metadata_bytes" in error["message"]
    assert (await http.get(f"{gw.url}/v1/sessions/much-metadata")).json() == session  # no turn, no key
    finish = await http.post(
        f"{gw.url}/v1/sessions/much-metadata/finish", json={"reward": 1.0, "metadata": {"late": "y" * 6_000}}
    )
    assert_error(finish, 400, "metadata", "session_metadata_too_large")
    assert (await http.get(f"{gw.url}/v1/sessions/much-metadata")).json() == session  # still active, unchanged
    finished = await http.post(f"{gw.url}/v1/sessions/much-metadata/finish", json={"reward": 1.0})
    assert finished.status_code == 200 and finished.json()["delivered"]
    metadata = (await http.get(f"{gw.url}/v1/sessions/much-metadata")).json()["metadata"]
    assert sorted(metadata) == ["k0", "k1", "k2", "k3"]


async def test_the_session_metadata_bound_is_configured(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    """A session made with metadata over a lower `store.max_session_metadata_bytes` (within the per-request 16 KiB)
    is refused, nothing stored."""
    gw = await make_gateway([await make_sim("vllm")], store={"max_session_metadata_bytes": 1024})
    made = await http.post(f"{gw.url}/v1/sessions", json={"metadata": {"blob": "x" * 2_000}})
    assert "1024 bytes" in assert_error(made, 400, "metadata", "session_metadata_too_large")["message"]
    assert await nothing_stored(redis)
