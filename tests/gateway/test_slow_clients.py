"""Streaming clients that read slowly or not at all (issue 38 §2): the generation runs at engine speed whatever the
client's pace, so its engine request ends, a `wait` weight update drains it and the turn is recorded, while the
answer waits for the client; a client past `server.stream_buffer_bytes` queued, or `server.slow_client_timeout_s`
without progress, is cut, its turn kept as cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from gateway.store import Keys, TrajectoryStore
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import publish, slow
from tests.sim_helpers import wait_for

LONG = 32768  # the context length of these tests' replicas: long answers


def chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 20,
    }


@contextlib.contextmanager
def stalled_stream(url: str, session: str, max_tokens: int) -> Iterator[socket.socket]:
    """A streamed chat turn of `session` from a client that never reads its answer. Each token's event carries 20
    top logprobs (~2 kB), so the answer outgrows what the kernel buffers for a connection (~2 MB on loopback)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    try:
        sock.connect((host, int(port)))
        payload = orjson.dumps(chat(max_tokens))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"x-session-id: {session}\r\n"
        )
        sock.sendall(f"{head}content-length: {len(payload)}\r\n\r\n".encode() + payload)
        yield sock
    finally:
        sock.close()


async def test_a_client_that_stops_reading_does_not_hold_a_wait_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis: Redis
) -> None:
    # SGLang has no native `wait`: the coordinator drains the gateway's own in-flight requests, then pauses.
    sim = await make_sim(*slow("sglang", delay=0.0005, max_model_len=LONG), incremental_streaming_output=True)
    gw = await make_gateway([sim], model={"max_model_len": LONG})
    total = 2500  # ~1.3 s of generation; its events (~5 MB) far exceed what the connection buffers (~2 MB)
    pool = gw.services.pool
    async with httpx.AsyncClient(timeout=60) as http:
        with stalled_stream(gw.url, "stalled", total):
            await wait_for(lambda: sum(r.in_flight for r in pool.all()) == 1, what="the stalled stream in flight")
            started = time.monotonic()
            async with asyncio.timeout(60):  # held until the socket closed before the fix
                response = await publish(http, gw.url, 1, mode="wait")
            took = time.monotonic() - started
            assert response.status_code == 200, response.text
            logging.getLogger(__name__).info("wait update over a stalled client: %.1fs", took)
            assert (await http.get(f"{gw.url}/ready")).status_code == 200
            store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)

            async def recorded() -> bool:
                return bool(await store.load_samples("stalled"))

            await wait_for(recorded, what="the turn recorded while its answer waits for the client")
            [sample] = await store.load_samples("stalled")
            assert not sample.cancelled and int(sample.loss_mask.sum()) == total
            assert sample.versions.tolist() == [0] * total  # drained, never aborted


@pytest.mark.parametrize(
    "limit",
    [({"stream_buffer_bytes": 4096}, "bytes of the answer wait"), ({"slow_client_timeout_s": 1.0}, "no progress")],
    ids=["stream_buffer_bytes", "slow_client_timeout_s"],
)
async def test_a_client_past_a_limit_is_cut_and_its_turn_kept_as_cancelled(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    redis: Redis,
    limit: tuple[dict[str, float], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, why = limit
    sim = await make_sim(*slow("vllm", delay=0.001, max_model_len=LONG))
    gw = await make_gateway([sim], server=server, model={"max_model_len": LONG})
    total = 20000  # 20 s of generation: cut long before
    pool = gw.services.pool
    with stalled_stream(gw.url, "cut", total) as sock:
        await wait_for(lambda: sum(r.in_flight for r in pool.all()) == 1, what="the stalled stream in flight")
        await wait_for(lambda: sum(r.in_flight for r in pool.all()) == 0, what="the engine request stopped", timeout=20)
        sock.setblocking(False)
        store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)

        async def recorded() -> bool:
            return bool(await store.load_samples("cut"))

        await wait_for(recorded, what="the cut turn recorded")
        [sample] = await store.load_samples("cut")
        assert sample.cancelled and 0 < int(sample.loss_mask.sum()) < total
        assert any(why in r.getMessage() for r in caplog.records if r.name == "gateway.api.streaming")
        # The connection was closed: reading what arrived ends (EOF or a reset), it never blocks.
        async with asyncio.timeout(10):
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                    continue
                except ConnectionResetError:
                    break
                if not data:
                    break
