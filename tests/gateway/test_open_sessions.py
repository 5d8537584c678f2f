"""Open sessions per API key, across gateway processes (`server.max_open_sessions_per_key`, issue 38 §7): counted in
Redis, freed by a finish or once the session expires idle; distinct from the per-process in-flight limit."""

from __future__ import annotations

from typing import Any

import httpx

from gateway.server import RunningGateway
from gateway.session.quotas import key_id
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
