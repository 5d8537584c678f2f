"""Open sessions per API key, across gateway processes (`server.max_open_sessions_per_key`, issue 38 §7): counted in
Redis, freed by a finish or once the session expires idle; distinct from the per-process in-flight limit. On by
default, sessions without a key sharing one count, and a warning where a gateway open to other hosts has neither
keys nor the bound (issue 52 §7)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.config.server import DEFAULT_MAX_OPEN_SESSIONS
from gateway.server import RunningGateway
from gateway.session.quotas import ANONYMOUS, key_id
from gateway.store import Keys, OpenSessions, connect
from tests.conftest import GatewayFactory, SimFactory
from tests.sim_helpers import wait_for

K1 = {"authorization": "Bearer key-one"}
K2 = {"authorization": "Bearer key-two"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def two_gateways(make_sim: SimFactory, make_gateway: GatewayFactory, **store: Any) -> list[RunningGateway]:
    sim = await make_sim("vllm")
    server = {"api_keys": ["key-one", "key-two"], "max_open_sessions_per_key": 2}
    return [await make_gateway([sim], server=server, store=store) for _ in range(2)]


async def create(http: httpx.AsyncClient, gw: RunningGateway, session: str, key: dict[str, str]) -> httpx.Response:
    return await http.post(f"{gw.url}/v1/sessions", json={"session_id": session}, headers=key)


async def chat(http: httpx.AsyncClient, gw: RunningGateway, session: str | None, key: dict[str, str]) -> httpx.Response:
    headers = key | ({"x-session-id": session} if session else {})
    return await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers)


def refused(response: httpx.Response) -> bool:
    code = response.json()["error"]["code"]
    return response.status_code == 429 and code == "too_many_open_sessions" and "retry-after" in response.headers


async def test_open_sessions_per_key_are_counted_across_two_gateways(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    a, b = await two_gateways(make_sim, make_gateway)
    assert (await create(http, a, "s1", K1)).status_code == 201
    assert (await chat(http, b, "s2", K1)).status_code == 200  # a turn naming a new session creates it
    # The key's third open session is refused on either gateway, however it would be made; nothing is stored.
    assert refused(await create(http, a, "s3", K1))
    assert refused(await chat(http, b, "s3", K1))
    assert (await http.get(f"{a.url}/v1/sessions/s3", headers=K1)).status_code == 404
    # Open sessions go on; another key has slots of its own; a request naming no session is not an open one.
    assert (await chat(http, a, "s1", K1)).status_code == 200
    assert (await create(http, b, "s1", K1)).status_code == 201  # the key's own session again: not a new one
    assert (await create(http, b, "t1", K2)).status_code == 201
    assert (await chat(http, a, None, K1)).status_code == 200
    # A finish on one gateway frees the slot for the other.
    assert (await http.post(f"{b.url}/v1/sessions/s1/finish", json={"reward": 1.0}, headers=K1)).status_code == 200
    assert (await chat(http, a, "s3", K1)).status_code == 200
    assert refused(await create(http, b, "s4", K1))
    # A creation refused for another reason (a finished session's id) gives its slot back.
    assert (await http.post(f"{a.url}/v1/sessions/t1/finish", json={"reward": 0.0}, headers=K2)).status_code == 200
    assert (await create(http, b, "t1", K2)).status_code == 409
    opened = a.services.open_sessions
    assert opened is not None and await opened.count(key_id("key-two")) == 0
    assert await opened.count(key_id("key-one")) == 2


async def test_an_abandoned_session_frees_its_slot_once_it_expires_idle(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    a, b = await two_gateways(make_sim, make_gateway, session_idle_ttl_s=1)
    assert (await create(http, a, "gone-1", K1)).status_code == 201
    assert (await create(http, b, "gone-2", K1)).status_code == 201
    assert refused(await create(http, a, "new-1", K1))
    opened = a.services.open_sessions
    assert opened is not None

    async def expired() -> bool:
        return await opened.count(key_id("key-one")) == 0

    await wait_for(expired, timeout=10, what="the abandoned sessions leave the count")
    assert (await create(http, b, "new-1", K1)).status_code == 201
    assert (await create(http, a, "new-2", K1)).status_code == 201


async def test_a_gateway_without_api_keys_bounds_its_open_sessions_by_default(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    opened = gw.services.open_sessions
    assert opened is not None and opened.limit == DEFAULT_MAX_OPEN_SESSIONS
    assert (await http.post(f"{gw.url}/v1/sessions", json={"session_id": "kept"})).status_code == 201
    assert (await chat(http, gw, "chatty", {})).status_code == 200
    assert await opened.count(ANONYMOUS) == 2  # every session without a key in the one count


async def test_sessions_without_api_keys_share_one_bound_across_gateways(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    a, b = [await make_gateway([sim], server={"max_open_sessions_per_key": 2}) for _ in range(2)]
    assert (await create(http, a, "s1", {})).status_code == 201
    assert (await chat(http, b, "s2", {})).status_code == 200
    for response in (await create(http, b, "s3", {}), await chat(http, a, "s3", {})):
        assert refused(response)
        message = response.json()["error"]["message"]
        assert "server.max_open_sessions_per_key (2)" in message and "without an API key" in message
    assert (await http.get(f"{a.url}/v1/sessions/s3")).status_code == 404  # nothing stored
    # Nothing open is lost: both sessions go on, and a finish frees a slot for a new one.
    assert (await chat(http, a, "s1", {})).status_code == 200
    assert (await chat(http, b, "s2", {})).status_code == 200
    assert (await http.get(f"{b.url}/v1/sessions/s1")).json()["status"] == "active"
    assert (await http.post(f"{b.url}/v1/sessions/s1/finish", json={"reward": 1.0})).status_code == 200
    assert (await create(http, a, "s3", {})).status_code == 201


OPEN_TO_ANYONE = "server.max_open_sessions_per_key off"


@pytest.mark.parametrize(
    ("server", "warned"),
    [
        ({"host": "0.0.0.0", "max_open_sessions_per_key": 0}, True),
        ({"host": "0.0.0.0", "max_open_sessions_per_key": None}, True),
        ({"host": "0.0.0.0"}, False),  # the default bound
        ({"host": "0.0.0.0", "max_open_sessions_per_key": 0, "api_keys": ["key-one"]}, False),
        ({"host": "127.0.0.1", "max_open_sessions_per_key": 0}, False),
    ],
)
async def test_a_gateway_open_to_other_hosts_without_limits_warns_once_at_start(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    server: dict[str, Any],
    warned: bool,
) -> None:
    """The warning reads the configured `server.host` (the test gateway itself listens on loopback)."""
    with caplog.at_level(logging.WARNING, logger="gateway.services"):
        await make_gateway([await make_sim("vllm")], server=server)
    warnings = [r.getMessage() for r in caplog.records if OPEN_TO_ANYONE in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert "server.api_keys" in warnings[0] and "'0.0.0.0'" in warnings[0]


async def test_a_process_pushes_a_sessions_expiry_on_once_per_margin_and_keeps_it_counted(redis: Redis) -> None:
    """Turns within an eighth of the idle TTL of this process's last push cost no round trip; the score stays more
    than the idle TTL ahead of every turn, so a session in use is never trimmed before the sweeper abandons it."""
    opened = OpenSessions(redis, Keys(), limit=5, idle_ttl_s=8)
    key = Keys().open_sessions(ANONYMOUS)
    await opened.claim(ANONYMOUS, "s")
    claimed = await redis.zscore(key, "s")
    now = await redis.time()
    assert claimed is not None and claimed >= now[0] + now[1] / 1e6 + 8  # the idle TTL and the margin ahead
    await opened.touch(ANONYMOUS, "s")
    assert await redis.zscore(key, "s") == claimed  # within the margin: not sent
    await asyncio.sleep(1.1)
    await opened.touch(ANONYMOUS, "s")
    pushed = await redis.zscore(key, "s")
    assert pushed is not None and pushed > claimed
    await opened.release(ANONYMOUS, "s")
    assert await opened.count(ANONYMOUS) == 0


async def test_a_turn_goes_on_when_redis_does_not_take_its_sessions_expiry(caplog: pytest.LogCaptureFixture) -> None:
    """Pushing a session's expiry on is bookkeeping: where Redis does not answer (a failover; the load-balancer soak
    saw a turn answered 503 by it) the turn goes on, and the next one pushes again."""
    away = connect("redis://127.0.0.1:1", socket_timeout_s=0.5)  # nothing listens there
    try:
        opened = OpenSessions(away, Keys(), limit=5, idle_ttl_s=8)
        with caplog.at_level(logging.WARNING, logger="gateway.store.open_sessions"):
            await opened.touch(ANONYMOUS, "s")
            await opened.touch(ANONYMOUS, "s")  # not remembered as pushed: tried again
        assert [r.getMessage().startswith("open-session expiry not pushed on") for r in caplog.records] == [True] * 2
    finally:
        await away.aclose()
