"""`benchmarks/chat_front.py`: the chat route LiteLLM reaches the simulator replicas through, served in this process in
front of a real replica and driven by the official openai client (whole and streamed answers, the replica's usage,
the conversation rendered with the chat template, unknown routes refused)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.server import bind_socket
from benchmarks.chat_front import ChatFront
from gateway.config import DEFAULT_TOKENIZER
from tests.conftest import SimFactory

pytestmark = pytest.mark.timeout(60)

CONVERSATION = [
    {"role": "user", "content": "bench-2-0 hello there"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "more"}]},
]


@contextlib.asynccontextmanager
async def chat_front(replica_urls: list[str]) -> AsyncIterator[str]:
    sock = bind_socket()
    config = uvicorn.Config(ChatFront(replica_urls), loop="none", lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)  # uvicorn exposes no startup event; bounded by the test's timeout
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
async def front(make_sim: SimFactory) -> AsyncIterator[str]:
    engine = EngineSettings(block_size=16, shape=ModelShape(eos_prob=0.0))
    sim = await make_sim("vllm", engine=engine, tokenizer_path=str(DEFAULT_TOKENIZER))
    async with chat_front([sim.url]) as url:
        yield url


def prompt_tokens() -> int:
    """The conversation's prompt as vLLM renders it: the chat template, the generation prompt, token ids."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER))
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "and more"} for m in CONVERSATION]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


async def test_a_conversation_is_answered_as_a_chat_completion(front: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{front}/r0/v1", api_key="bench") as client:
        answer = await client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=5)
    assert answer.object == "chat.completion" and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens == 5
    assert answer.usage.prompt_tokens == prompt_tokens()


async def test_a_stream_carries_the_role_first_and_the_usage_last(front: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{front}/r0/v1", api_key="bench") as client:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=CONVERSATION,
            max_tokens=6,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    content = [c.choices[0].delta for c in chunks if c.choices]
    assert content[0].role == "assistant" and "".join(d.content or "" for d in content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage  # asked for or not: LiteLLM then counts the engine's tokens
    assert usage is not None and (usage.completion_tokens, usage.prompt_tokens) == (6, prompt_tokens())


async def test_unknown_routes_and_replicas_are_refused(front: str) -> None:
    async with httpx.AsyncClient() as client:
        for path in ("/r1/v1/chat/completions", "/r0/v1/completions", "/v1/chat/completions"):
            answer = await client.post(f"{front}{path}", json={"model": "tiny", "messages": CONVERSATION})
            assert answer.status_code == 404, path
