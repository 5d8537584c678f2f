"""One answer path for streamed and whole answers: both adapters read either through `answer_batches`, give the same
tokens, and give up at the request's deadline, which each transport enforces on its own timer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from backends.base import Chunk, EngineBackend, ReplicaSpec, SamplingParams
from backends.errors import BackendTimeout
from backends.factory import Dialect, create_backend
from backends.sim.engine import EngineSettings
from tests.conftest import SimFactory
from tests.sim_helpers import gateway_transport

PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
DIALECTS: list[Dialect] = ["vllm", "sglang"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@contextlib.asynccontextmanager
async def backend_for(
    make_sim: SimFactory, dialect: Dialect, token_delay_s: float = 0.0
) -> AsyncIterator[EngineBackend]:
    sim = await make_sim(dialect, engine=EngineSettings(token_delay_s=token_delay_s, block_size=1))
    backend = create_backend(dialect, ReplicaSpec(id="r0", url=sim.url, generation_transport=gateway_transport()))
    try:
        yield backend
    finally:
        await backend.aclose()


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_whole_answer_is_one_finished_chunk_with_the_streams_tokens(
    make_sim: SimFactory, dialect: Dialect
) -> None:
    async with backend_for(make_sim, dialect) as backend:
        streamed = await collect(backend.generate(PROMPT, greedy(12), "s"))
        whole = await collect(backend.generate(PROMPT, greedy(12), "w", stream=False))
    assert len(whole) == 1 and whole[0].finish_reason == streamed[-1].finish_reason == "length"
    assert whole[0].token_ids == [t for chunk in streamed for t in chunk.token_ids]
    assert whole[0].logprobs == [lp for chunk in streamed for lp in chunk.logprobs]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_the_deadline_bounds_an_answer_that_keeps_coming(
    make_sim: SimFactory, dialect: Dialect, stream: bool
) -> None:
    """Tokens arrive far within the read timeout, but the request's deadline passes first: `BackendTimeout` at the
    deadline, streamed (the stream's read-gap watch) or whole (the connection's timer)."""
    async with backend_for(make_sim, dialect, token_delay_s=0.01) as backend:
        deadline = asyncio.get_running_loop().time() + 0.3
        started = time.monotonic()
        received: list[int] = []
        with pytest.raises(BackendTimeout, match="r0"):
            async for chunk in backend.generate(PROMPT, greedy(2000), "d", stream=stream, deadline=deadline):
                received += chunk.token_ids
        waited = time.monotonic() - started
    assert 0.25 <= waited < 5.0
    assert bool(received) is stream  # a stream brought tokens before its deadline; a whole answer none
