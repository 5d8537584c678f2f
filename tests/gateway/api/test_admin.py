"""The admin API (`gateway.api.admin.routes`) over real HTTP: its credentials, version conflicts, and
`/admin/status`."""

from __future__ import annotations

import httpx
from redis.asyncio import Redis

from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.server import serve_gateway
from tests.conftest import ADMIN, ADMIN_TOKEN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    generate_body,
)


async def test_admin_auth_and_conflicts(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    body = {"version": 1, "path": "ckpt-1"}
    missing = await http.post(f"{gw.url}/admin/weights", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = await http.post(f"{gw.url}/admin/weights", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 403
    assert gw.services.weights.version == 0  # no state change
    assert (await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN)).status_code == 200
    again = await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"]["param"] == "version"
    older = await http.post(f"{gw.url}/admin/weights", json={"version": 0, "source": "external"}, headers=ADMIN)
    assert older.status_code == 409
    bad = await http.post(f"{gw.url}/admin/weights", json={"version": "x"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "version"
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 5}, headers=ADMIN)).status_code == 409


async def test_admin_status_shows_the_redis_url_without_credentials(
    make_sim: SimFactory, redis_server: EmbeddedRedis, redis: Redis, http: httpx.AsyncClient
) -> None:
    """A trainer finds the gateway's Redis in `/admin/status`; a password in the configured URL is not shown."""
    await redis.execute_command("ACL", "SETUSER", "rg-status-test", "on", ">s3cret-pw", "~*", "&*", "+@all")
    try:
        url = f"redis://rg-status-test:s3cret-pw@127.0.0.1:{redis_server.port}/0"
        sim = await make_sim("vllm")
        settings = Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            redis={"url": url},
            replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")],
        )
        async with serve_gateway(settings) as gw:
            # The credentials work: the gateway stores a session through them.
            assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2))).status_code == 200
            response = await http.get(f"{gw.url}/admin/status", headers=ADMIN)
        assert response.json()["redis_url"] == f"redis://127.0.0.1:{redis_server.port}/0"
        assert "s3cret-pw" not in response.text and "rg-status-test" not in response.text
    finally:
        await redis.execute_command("ACL", "DELUSER", "rg-status-test")


async def test_a_percent_encoded_admin_path_is_no_route(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Issue 38 §14: `/admin%2Fstatus` and `/%61dmin/status` reached the admin routes (a proxy that filters the raw
    path lets them through); an admin path is matched only as sent."""
    gw = await make_gateway([await make_sim("vllm")])
    for path in ("/admin%2Fstatus", "/%61dmin/status", "/admin/%73tatus"):
        response = await http.get(f"{gw.url}{path}", headers=ADMIN)
        assert response.status_code == 404, (path, response.text)
    assert (await http.get(f"{gw.url}/admin/status?x=%20", headers=ADMIN)).status_code == 200
