"""`GuardedStreamingResponse`: a `LastChunk` is the end of the body (one ASGI message, so one socket write with the
chunked terminator), the generator still runs to its own end, and the streamed routes end that way over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from starlette.types import Message

from gateway.api.streaming import GuardedStreamingResponse, LastChunk
from tests.conftest import GatewayFactory, SimFactory

SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/x", "headers": [], "app": None}


async def respond(chunks: list[bytes]) -> tuple[list[Message], list[str]]:
    """Run a response over `chunks` on a recording ASGI server: (the messages it sent, what happened after)."""
    sent: list[Message] = []
    trail: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for chunk in chunks:
                yield chunk
        finally:
            trail.append("generator ended")

    async def on_close() -> None:
        trail.append("closed")

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await GuardedStreamingResponse(body(), on_close, media_type="text/event-stream")(dict(SCOPE), receive, send)
    return sent, trail


def bodies(sent: list[Message]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]


async def test_a_last_chunk_ends_the_body_in_the_same_message() -> None:
    sent, trail = await respond([b"data: 1\n\n", LastChunk(b"data: [DONE]\n\n")])
    assert sent[0]["type"] == "http.response.start"
    assert bodies(sent) == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]  # no empty terminator message
    assert trail == ["generator ended", "closed"]  # the generator ran to its end before the response closed


async def test_without_a_last_chunk_the_body_ends_with_an_empty_message() -> None:
    sent, _ = await respond([b"data: 1\n\n", b"data: 2\n\n"])
    # Chunks the generator queued while the client's writer waited go out together (`gateway.api.client_writer`).
    assert bodies(sent) == [(b"data: 1\n\ndata: 2\n\n", True), (b"", False)]


async def test_a_chunk_after_a_last_chunk_keeps_the_order() -> None:
    sent, _ = await respond([LastChunk(b"a"), b"b"])
    assert bodies(sent) == [(b"ab", True), (b"", False)]


async def test_streamed_routes_end_with_their_summary_and_done(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Over real HTTP: every event of a streamed turn arrives, the last two being the usage and [DONE] (OpenAI)
    or the summary and [DONE] (/generate), and the chunked body is well formed (httpx reads it to its end)."""
    sim = await make_sim("vllm")
    gateway = await make_gateway([sim])
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        completion = {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "stream": True, "ignore_eos": True}
        completion["stream_options"] = {"include_usage": True}
        events = await sse_events(client, "/v1/completions", completion)
        assert events[-1] == "[DONE]"
        assert '"usage"' in events[-2] and '"finish_reason":"length"' in events[-3]
        generate = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5, "ignore_eos": True}, "stream": True}
        events = await sse_events(client, "/generate", generate)
        assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
        assert sum(e.count("output_ids") for e in events) >= 1


async def sse_events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        text = (await response.aread()).decode()
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def test_every_choice_of_a_streamed_turn_ends_once(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    """n choices finish at different times: each one's end arrives once, the usage after the last, then [DONE]."""
    sim = await make_sim("vllm")
    gateway = await make_gateway([sim])
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sample"}]}),
            ("/v1/completions", {"prompt": "sample"}),
        ):
            body |= {"model": "tiny", "n": 3, "max_tokens": 8, "temperature": 1.0, "stream": True}
            body["stream_options"] = {"include_usage": True}
            events = await sse_events(client, path, body)
            assert events[-1] == "[DONE]" and '"usage"' in events[-2]
            ends = [
                choice["index"]
                for event in events[:-1]
                for choice in orjson.loads(event)["choices"]
                if choice["finish_reason"] is not None
            ]
            assert sorted(ends) == [0, 1, 2], (path, events)
