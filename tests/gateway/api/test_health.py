"""Liveness and readiness over real HTTP (`gateway.api.admin.health`): `/ready` says whether a turn could be served now,
the trajectory store included (issue 38 §13: with Redis down the gateway answered `/ready` 200 while every session
request got a 503 naming Redis's host and port)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx

from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.server import serve_gateway
from tests.conftest import ADMIN_TOKEN, SimFactory
from tests.sim_helpers import wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_ready_follows_the_store_and_a_503_for_it_names_no_host(
    make_sim: SimFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = await make_sim("vllm")
    async with EmbeddedRedis(data_dir=tmp_path) as redis:
        settings = Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            redis={"url": redis.url, "retry_budget_s": 0.5, "socket_timeout_s": 0.5},
            replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")],
        )
        async with serve_gateway(settings) as gw:
            ready = await http.get(f"{gw.url}/ready")
            assert ready.status_code == 200 and ready.json() == {"ready": True, "replicas": True, "store": True}
            redis.kill()
            down = await http.get(f"{gw.url}/ready")
            assert down.status_code == 503 and down.json()["store"] is False
            assert down.headers["retry-after"] == "1"
            turn = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
            assert turn.status_code == 503 and turn.headers["retry-after"] == "1"
            assert turn.json()["error"]["type"] == "store_unavailable"
            assert str(redis.port) not in turn.text and "127.0.0.1" not in turn.text
            await redis.arestart()

            async def ready_again() -> bool:
                return (await http.get(f"{gw.url}/ready")).status_code == 200

            await wait_for(ready_again, what="/ready once Redis is back")


async def test_a_turn_waits_out_a_short_redis_outage_within_the_retry_budget(
    make_sim: SimFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Issue 38 §13: a turn's session read failed after ~2.5 s with a 503 while `redis.retry_budget_s` said 30 s; it
    is retried with backoff, so a Redis restart costs the agent a wait, not an error."""
    sim = await make_sim("vllm")
    async with EmbeddedRedis(data_dir=tmp_path) as redis:
        settings = Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            redis={"url": redis.url, "retry_budget_s": 20, "socket_timeout_s": 0.5},
            replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")],
        )
        async with serve_gateway(settings) as gw:
            headers = {"X-Session-ID": "outage"}
            assert (await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
            gw.services.turns.sessions.forget("outage")  # the next turn reads the session from Redis
            redis.kill()
            turn = asyncio.create_task(http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers))
            await asyncio.sleep(3.0)  # longer than a read used to survive; the outage itself, not a wait on a result
            assert not turn.done()
            await redis.arestart()
            answer = await turn
            assert answer.status_code == 200, answer.text


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_an_unreachable_cluster_is_a_503_as_a_single_server_is(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    """Issue 52 §9: with a `redis+cluster://` URL no node answers, `/ready` was a 500 with a traceback on every probe
    (redis-py's cluster client raises `RedisClusterException`, no `RedisError`): now the single server's 503 with a
    Retry-After, and a turn the store's 503."""
    sim = await make_sim("vllm")
    settings = Settings(
        server={"port": 0, "admin_token": ADMIN_TOKEN},
        redis={"url": f"redis+cluster://127.0.0.1:{unused_port()}", "retry_budget_s": 0.5, "socket_timeout_s": 0.5},
        replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")],
    )
    async with serve_gateway(settings) as gw:
        for _ in range(2):  # every probe, not the first only
            down = await http.get(f"{gw.url}/ready")
            assert down.status_code == 503, down.text
            assert down.json()["store"] is False and down.headers["retry-after"] == "1"
        turn = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        assert turn.status_code == 503 and turn.headers["retry-after"] == "1", turn.text
        assert turn.json()["error"]["type"] == "store_unavailable"
