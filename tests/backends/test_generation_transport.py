"""`AiohttpTransport`, the generation transport on aiohttp's public API (what replicas use with the fast path off),
against the engine simulator: whole and streamed answers, the deadline, a path prefix, and closing under a read."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from backends.generation_transport import AiohttpTransport
from backends.sim.engine import EngineSettings
from tests.conftest import SimFactory


def transport(url: str) -> AiohttpTransport:
    return AiohttpTransport(url, 8, connect_timeout_s=5, pool_timeout_s=5, read_timeout_s=30)


def body(max_tokens: int, stream: bool) -> bytes:
    return orjson.dumps(
        {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    )


async def test_a_whole_answer_and_a_streamed_one(make_sim: SimFactory) -> None:
    sim = await make_sim("vllm")
    client = transport(sim.url)
    try:
        status, content = await client.post("/v1/completions", body(4, stream=False))
        assert status == 200 and orjson.loads(content)["choices"][0]["finish_reason"] == "length"
        async with client.stream("/v1/completions", body(4, stream=True)) as answer:
            assert answer.status == 200 and answer.transport is not None
            data = b""
            while piece := await answer.read():
                data += piece
        assert data.rstrip().endswith(b"data: [DONE]")
    finally:
        await client.aclose()


async def test_a_deadline_already_past_is_a_timeout_not_an_unbounded_wait(make_sim: SimFactory) -> None:
    sim = await make_sim("vllm")
    client = transport(sim.url)
    try:
        with pytest.raises(TimeoutError):
            await client.post("/v1/completions", body(4, stream=False), asyncio.get_running_loop().time() - 1)
        slow = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.05))
        late = transport(slow.url)
        with pytest.raises(TimeoutError):
            await late.post("/v1/completions", body(100, stream=False), asyncio.get_running_loop().time() + 0.2)
        await late.aclose()
    finally:
        await client.aclose()


async def test_a_path_in_the_url_prefixes_every_request(make_sim: SimFactory) -> None:
    sim = await make_sim("vllm")
    client = transport(sim.url + "/nowhere")
    try:
        status, _ = await client.post("/v1/completions", body(2, stream=False))
        assert status == 404  # the prefix was sent: the simulator serves no /nowhere/...
    finally:
        await client.aclose()


async def test_closing_fails_a_stream_being_read_at_once(make_sim: SimFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.01))
    client = transport(sim.url)
    async with client.stream("/v1/completions", body(2000, stream=True)) as answer:
        assert await answer.read()
        await client.aclose()
        with pytest.raises(ConnectionError, match="closed"):
            while await answer.read():
                pass
    with pytest.raises(ConnectionError, match="closed"):
        await client.post("/v1/completions", body(2, stream=False))
