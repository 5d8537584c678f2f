"""Session ids are restricted to a safe charset (issue 38 §12: a session id with a newline forged a log line):
whichever way a request names its session, an id outside `A-Z a-z 0-9 _ . : @ -` (1 to 256 characters) is a 400
naming where it came from, and nothing is created. Real simulator, real gateway, real Redis."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FORGED = "s1\nINFO gateway: admin token accepted"


@pytest.mark.parametrize(
    ("where", "param"),
    [
        ("header", "x-session-id"),
        ("body", "session_id"),
        ("user", "user"),
        ("path", "session_id"),
        ("generate", "session_id"),
        ("create", "session_id"),
    ],
)
async def test_a_session_id_outside_the_charset_is_a_400_naming_its_source(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, where: str, param: str
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    url, body, headers = f"{gw.url}/v1/chat/completions", dict(CHAT), {}
    if where == "header":
        headers = {"X-Session-ID": "s1\tforged"}  # a header value cannot hold a newline: a tab
    elif where == "body":
        body["session_id"] = FORGED
    elif where == "user":
        body["user"] = FORGED
    elif where == "path":
        url = f"{gw.url}/sessions/s1%0Aforged/v1/chat/completions"
    elif where == "generate":
        url, body = f"{gw.url}/generate", generate_body([1, 2, 3], 2, session_id=FORGED)
    else:
        url, body = f"{gw.url}/v1/sessions", {"session_id": FORGED}
    response = await http.post(url, json=body, headers=headers)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["param"] == param, error
    async with Redis.from_url(gw.services.redis_url) as redis:
        assert not await redis.keys("*s1*")  # nothing created


async def test_every_safe_character_is_a_session_id(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    session = "Agent_7.run-3:grp@host" + "x" * 234  # 256 characters
    response = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session})
    assert response.status_code == 200 and response.json()["rollout"]["session_id"] == session
    too_long = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session + "y"})
    assert too_long.status_code == 400


@pytest.mark.parametrize("session", [".", ".."])
@pytest.mark.parametrize(
    ("where", "param"),
    [("header", "x-session-id"), ("body", "session_id"), ("path", "session_id"), ("create", "session_id")],
)
async def test_a_dot_segment_is_no_session_id(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, where: str, param: str, session: str
) -> None:
    """Issue 52 §12: `.` and `..` were taken as session ids, which no URL reaches (clients and browsers drop or
    resolve the segment: `/sessions/../v1/...`, the dashboard's link). A 400 naming the source; `...` and `.a` stay
    ids."""
    gw = await make_gateway([await make_sim("vllm")])
    url, body, headers = f"{gw.url}/v1/chat/completions", dict(CHAT), {}
    if where == "header":
        headers = {"X-Session-ID": session}
    elif where == "body":
        body["session_id"] = session
    elif where == "path":  # percent-encoded, as a client that does not normalise sends it
        url = f"{gw.url}/sessions/{session.replace('.', '%2E')}/v1/chat/completions"
    else:
        url, body = f"{gw.url}/v1/sessions", {"session_id": session}
    response = await http.post(url, json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    for fine in ("...", ".a"):
        assert (await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": fine})).is_success
