"""Paced stream reads (`backends.read_pacing`) over real simulator replicas and real sockets: fewer reads, the
same tokens, nothing held while few streams run or while a weight update is under way."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from backends.base import Chunk, ReplicaSpec, SamplingParams, StreamPacing
from backends.errors import BackendUnavailable
from backends.read_pacing import ReadPacer
from backends.sglang import SglangBackend
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from backends.vllm import VllmBackend
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import expected_tokens, generate_body, publish, scrape, stream_generate, value
from tests.sim_helpers import gateway_transport, wait_for

PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
REFERENCE = ("init", "default")
Backend = VllmBackend | SglangBackend
BACKENDS: dict[str, Callable[[ReplicaSpec], Backend]] = {"vllm": VllmBackend, "sglang": SglangBackend}
#: Longer than any test waits: a stream held this long would fail its test's bound instead of finishing.
FOREVER_S = 60.0

BackendFor = Callable[..., Backend]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def backend_for() -> AsyncIterator[BackendFor]:
    """`backend_for(dialect, url, interval_s, min_streams)`: an engine backend with paced reads, closed after."""
    backends: list[Backend] = []

    def make(dialect: str, url: str, interval_s: float, min_streams: int = 1) -> Backend:
        spec = ReplicaSpec(
            id="r0",
            url=url,
            stream_pacing=StreamPacing(interval_s, min_streams),
            generation_transport=gateway_transport(),
        )
        backend = BACKENDS[dialect](spec)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        await backend.aclose()


def pacer_of(backend: Backend) -> ReadPacer:
    return backend._client.pacer


def expected(n: int) -> list[int]:
    return reference_tokens(ModelShape(), PROMPT, REFERENCE, n, ignore_eos=True)


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def engine(dialect: str, token_delay_s: float) -> EngineSettings:
    return EngineSettings(token_delay_s=token_delay_s, block_size=16 if dialect == "vllm" else 1)


async def generate(backend: Backend, max_tokens: int, request_id: str) -> list[Chunk]:
    return [chunk async for chunk in backend.generate(PROMPT, greedy(max_tokens), request_id)]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_paced_stream_comes_in_fewer_reads_with_every_token(
    make_sim: SimFactory, backend_for: BackendFor, dialect: str
) -> None:
    # 60 tokens 5 ms apart (about 0.3 s) read at most every 0.1 s: a handful of deltas instead of one per token.
    # The bound follows the stream's own duration, so a slow machine (a slower simulator) cannot fail it.
    sim = await make_sim(dialect, engine=engine(dialect, 0.005))
    backend = backend_for(dialect, sim.url, 0.1)
    started = time.monotonic()
    chunks = await generate(backend, 60, "paced")
    ticks = (time.monotonic() - started) / 0.1
    assert tokens_of(chunks) == expected(60)
    assert all(len(c.token_ids) == len(c.logprobs) for c in chunks)
    assert chunks[-1].finish_reason == "length"
    # One delta per tick at most, plus the first read (never held) and the final chunk (held back by the adapter).
    assert len(chunks) <= ticks + 3, (ticks, [len(c.token_ids) for c in chunks])
    assert pacer_of(backend).streams == 0 and pacer_of(backend).held == 0


async def test_fewer_streams_than_the_threshold_are_not_held(make_sim: SimFactory, backend_for: BackendFor) -> None:
    sim = await make_sim("vllm", engine=engine("vllm", 0.002))
    backend = backend_for("vllm", sim.url, FOREVER_S, min_streams=3)
    # Two streams at once: under the threshold, so neither waits for the (minute-long) tick.
    first, second = await asyncio.wait_for(
        asyncio.gather(generate(backend, 40, "a"), generate(backend, 40, "b")), timeout=20
    )
    assert tokens_of(first) == tokens_of(second) == expected(40)
    assert pacer_of(backend).held == 0


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_pause_reads_held_streams_at_once_and_the_resume_holds_again(
    make_sim: SimFactory, backend_for: BackendFor, dialect: str
) -> None:
    sim = await make_sim(dialect, engine=engine(dialect, 0.002))
    backend = backend_for(dialect, sim.url, FOREVER_S)
    pacer = pacer_of(backend)
    chunks: list[Chunk] = []

    async def consume(request_id: str) -> None:
        async for chunk in backend.generate(PROMPT, greedy(500), request_id):
            chunks.append(chunk)

    task = asyncio.create_task(consume("held"))
    await wait_for(lambda: pacer.held == 1, what="the stream held after its first read")
    await backend.pause("abort")
    await asyncio.wait_for(task, timeout=20)  # the abort's answer is read now, not at the tick a minute away
    assert chunks[-1].finish_reason == "abort" and pacer.held == 0
    partial = tokens_of(chunks)
    assert 0 < len(partial) < 500
    assert partial == expected(len(partial))

    await backend.resume()
    chunks.clear()
    task = asyncio.create_task(consume("held-again"))
    try:
        await wait_for(lambda: pacer.held == 1, what="a stream held again after the resume")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert pacer.streams == 0


async def test_closing_the_backend_fails_held_streams_at_once(make_sim: SimFactory, backend_for: BackendFor) -> None:
    sim = await make_sim("vllm", engine=engine("vllm", 0.002))
    backend = backend_for("vllm", sim.url, FOREVER_S)
    task = asyncio.create_task(generate(backend, 500, "closing"))
    await wait_for(lambda: pacer_of(backend).held == 1, what="the stream held")
    await backend.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        await asyncio.wait_for(task, timeout=20)
    assert pacer_of(backend).held == 0 and pacer_of(backend).streams == 0


def test_a_pacer_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ReadPacer(-0.1)
    with pytest.raises(ValueError, match="min_streams"):
        ReadPacer(0.1, min_streams=0)


async def test_an_interval_of_zero_holds_nothing() -> None:
    opened = asyncio.Event()

    async def keep_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.set()
        await reader.read()  # until the test's side closes
        writer.close()

    server = await asyncio.start_server(keep_open, "127.0.0.1", 0)
    async with server:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        await opened.wait()
        transport: Any = writer.transport
        held = ReadPacer(0.1)
        held.streams = 1
        held.hold(transport)
        assert held.held == 1 and not transport.is_reading()  # the same socket is held by a pacer with an interval
        held.suspend()
        assert held.held == 0 and transport.is_reading()
        never = ReadPacer(0.0)
        never.streams = 5
        never.hold(transport)
        never.restore()
        never.hold(transport)
        assert never.held == 0 and transport.is_reading()
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_paced_gateway_streams_across_updates_lose_nothing(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    sim = await make_sim(dialect, engine=engine(dialect, 0.002))
    gw = await make_gateway([sim], generation={"stream_pacing_s": 0.05, "stream_pacing_min_streams": 1})
    total, n = 200, 4
    progress = [0]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as streams:
        prompts = [[7, i, 3] for i in range(n)]
        tasks = [
            asyncio.create_task(stream_generate(streams, gw.url, generate_body(p, total, session_id=f"p{i}"), progress))
            for i, p in enumerate(prompts)
        ]
        for version in (1, 2):
            await wait_for(lambda v=version: progress[0] >= v * n * total // 3, what=f"progress before v{version}")
            assert (await publish(http, gw.url, version)).status_code == 200
        results = await asyncio.gather(*tasks)
    for prompt, result in zip(prompts, results, strict=True):
        final = result.final
        assert result.error is None and final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens(prompt, final["versions"], total)
        assert len(result.logprobs) == total
        assert final["versions"] == sorted(final["versions"]) and final["num_resumes"] >= 1
    # Every stream was paced (threshold 1), each held read after a read of one event or more.
    replica = sim.url.removeprefix("http://")
    held = value(await scrape(http, gw.url), "rollout_gateway_paced_reads_total", replica=replica)
    assert n <= held < n * total


async def test_unpaced_streams_report_no_paced_reads(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm", engine=engine("vllm", 0.001))
    gw = await make_gateway([sim])  # the default threshold (32 streams) is far above one stream
    result = await stream_generate(http, gw.url, generate_body([7, 1, 3], 50))
    assert result.error is None and len(result.output_ids) == 50
    samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_paced_reads_total", replica=sim.url.removeprefix("http://")) == 0
