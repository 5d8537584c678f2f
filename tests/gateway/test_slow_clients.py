"""Streaming clients that read slowly or not at all (issue 38 §2): the generation runs at engine speed whatever the
client's pace, so its engine request ends, a `wait` weight update drains it and the turn is recorded, while the
answer waits for the client; a client past `server.stream_buffer_bytes` queued, or `server.slow_client_timeout_s`
without progress, is cut, its turn kept as cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from gateway.api.client_writer import CUT_CAUSES, ClientWriter
from gateway.store import Keys, TrajectoryStore
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import publish, scrape, slow, value
from tests.sim_helpers import sse_events, wait_for

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
    [
        ({"stream_buffer_bytes": 4096}, "bytes of the answer wait", "buffer"),
        ({"slow_client_timeout_s": 1.0}, "no progress", "stalled"),
    ],
    ids=["stream_buffer_bytes", "slow_client_timeout_s"],
)
async def test_a_client_past_a_limit_is_cut_and_its_turn_kept_as_cancelled(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    redis: Redis,
    limit: tuple[dict[str, float], str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, why, cause = limit
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
        assert gw.services.stream_buffers.cuts == dict.fromkeys(CUT_CAUSES, 0) | {cause: 1}
        await closed(sock)  # reading what arrived ends (EOF or a reset), it never blocks


async def read_stream(url: str, session: str, max_tokens: int, cut_seen: Callable[[], bool]) -> tuple[int, bool]:
    """A streamed chat turn read as it comes: the tokens it carried, and whether a cut happened while it streamed."""
    tokens, during = 0, False
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream(
            "POST", f"{url}/v1/chat/completions", json=chat(max_tokens), headers={"x-session-id": session}
        ) as response,
    ):
        assert response.status_code == 200
        async for event in sse_events(response):
            for choice in event["choices"]:
                tokens += len((choice.get("logprobs") or {}).get("content") or [])
            during = during or cut_seen()
    return tokens, during


async def closed(sock: socket.socket) -> None:
    """Read what arrived on `sock` until it ends (EOF or a reset): the gateway closed the connection."""
    sock.setblocking(False)
    async with asyncio.timeout(10):
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                await asyncio.sleep(0.01)
                continue
            except ConnectionResetError:
                return
            if not data:
                return


async def test_the_process_budget_cuts_the_slowest_readers_and_spares_one_that_reads(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Each client may queue far more than its share of the budget: only the process-wide budget cuts here.
    budget = 1024 * 1024
    server = {"stream_buffer_budget_bytes": budget, "stream_buffer_bytes": 64 * budget}
    sim = await make_sim(*slow("vllm", delay=0.001, max_model_len=LONG))
    gw = await make_gateway([sim], server=server, model={"max_model_len": LONG})
    buffers = gw.services.stream_buffers
    stalled, total, read = 4, 30000, 6000  # the stalled answers: 30 s of generation, cut long before
    pool = gw.services.pool
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(stalled_stream(gw.url, f"stalled{i}", total)) for i in range(stalled)]
        await wait_for(lambda: sum(r.in_flight for r in pool.all()) == stalled, what="the stalled streams in flight")
        reader = asyncio.create_task(read_stream(gw.url, "reader", read, lambda: buffers.cuts["budget"] > 0))

        async def all_cut() -> bool:
            samples = [await store.load_samples(f"stalled{i}") for i in range(stalled)]
            return all(samples)

        await wait_for(all_cut, what="every stalled turn cut and recorded", timeout=20)
        for i in range(stalled):
            [sample] = await store.load_samples(f"stalled{i}")
            assert sample.cancelled and 0 < int(sample.loss_mask.sum()) < total  # as a per-stream cut keeps it
        for sock in socks:
            await closed(sock)
        tokens, during = await asyncio.wait_for(reader, 60)
    assert tokens == read and during  # streamed in full while the others were cut
    [sample] = await store.load_samples("reader")
    assert not sample.cancelled and int(sample.loss_mask.sum()) == read
    assert buffers.cuts == {"buffer": 0, "stalled": 0, "budget": stalled}
    logged = [r.getMessage() for r in caplog.records if r.name == "gateway.api.streaming"]
    assert len(logged) == stalled and all("stream_buffer_budget_bytes" in message for message in logged)
    # Every stream closed: nothing is counted, and no writer (nor its chunks) is kept.
    await wait_for(lambda: buffers.queued_bytes == 0 and buffers.streams == 0, what="the accounting back to 0")
    async with httpx.AsyncClient(timeout=10) as http:
        samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_stream_queued_bytes") == 0
    assert value(samples, "rollout_gateway_slow_clients_cut_total", cause="budget") == stalled
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is ClientWriter]


async def test_an_answer_generated_in_full_is_cut_when_it_holds_the_most(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis: Redis
) -> None:
    # The first answer ends its generation (its turn recorded in full) holding megabytes for its client; the second
    # then takes the process past the budget while it holds less: the first is cut, though no chunk of its own came.
    budget = 6 * 1024 * 1024
    server = {"stream_buffer_budget_bytes": budget, "stream_buffer_bytes": 8 * budget}
    sim = await make_sim(*slow("vllm", delay=0.001, max_model_len=LONG))
    gw = await make_gateway([sim], server=server, model={"max_model_len": LONG})
    buffers = gw.services.stream_buffers
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    done, total = 4000, 8000

    async def recorded(session: str) -> bool:
        return bool(await store.load_samples(session))

    with stalled_stream(gw.url, "done", done) as first:
        await wait_for(lambda: recorded("done"), what="the first answer generated and recorded", timeout=20)
        if buffers.queued_bytes <= budget // 2:  # the second would be the bigger when the budget is passed
            pytest.skip(f"the connection's buffers took most of the first answer ({buffers.queued_bytes} left)")
        with stalled_stream(gw.url, "long", total):
            await wait_for(lambda: buffers.cuts["budget"] == 1, what="a cut", timeout=20)
            assert buffers.queued_bytes < budget // 2  # the first's bytes dropped: it was the one cut
            await closed(first)  # while its generation is over
        # The second's client left: its generation stops, its turn is kept as cancelled.
        await wait_for(lambda: recorded("long"), what="the second answer ended and recorded", timeout=20)
    [sample] = await store.load_samples("done")
    assert not sample.cancelled and int(sample.loss_mask.sum()) == done  # recorded before the cut, kept so
    await wait_for(lambda: buffers.queued_bytes == 0 and buffers.streams == 0, what="the accounting back to 0")
