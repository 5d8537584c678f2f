"""A vLLM-style `POST /v1/chat/completions` for the simulator replicas, which serve `/v1/completions` only.

    python benchmarks/chat_front.py --port 8100 --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002

`benchmarks/compare.py` puts it between LiteLLM's proxy and the replicas: LiteLLM fronts an OpenAI-compatible engine
through that engine's chat route (its `text-completion-openai` provider sends a conversation as a batch of prompts,
one per message, which no engine reads as a conversation). `/r{i}/v1/chat/completions` serves replica `i`: the
messages rendered with the gateway's tiny tokenizer's chat template (as vLLM renders them), sent as token ids to the
replica's `/v1/completions`, the answer rewritten as a chat completion (whole or chunk by chunk, with the replica's
usage always in the last chunk, so LiteLLM counts the engine's tokens instead of estimating them). It runs in a
process of its own beside the replicas, so what it costs is never counted as LiteLLM's.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp
import orjson
import uvicorn

from gateway.config import DEFAULT_TOKENIZER

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_FORWARDED = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "min_tokens")


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict))


class ChatFront:
    """The ASGI app: one aiohttp session for the replicas, opened and closed with the server's lifespan."""

    def __init__(self, worker_urls: Sequence[str]) -> None:
        from transformers import AutoTokenizer

        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER))
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
                    self.session = aiohttp.ClientSession(connector=connector)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.session is not None:
                        await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            await self.serve(scope, receive, send)

    async def serve(self, scope: Message, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        replica, _, route = scope["path"].removeprefix("/r").partition("/")
        if scope["method"] != "POST" or route != "v1/chat/completions" or not replica.isdigit():
            await _answer(send, 404, {"error": {"message": f"no route {scope['method']} {scope['path']}"}})
            return
        if int(replica) >= len(self.worker_urls):
            await _answer(send, 404, {"error": {"message": f"no replica {replica}"}})
            return
        await self.chat(self.worker_urls[int(replica)], orjson.loads(body), send)

    def completion_body(self, chat: dict[str, Any]) -> dict[str, Any]:
        messages = [{**m, "content": _text(m.get("content"))} for m in chat["messages"]]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        body = {k: chat[k] for k in _FORWARDED if chat.get(k) is not None}
        if "max_tokens" not in body and chat.get("max_completion_tokens") is not None:
            body["max_tokens"] = chat["max_completion_tokens"]
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        return {**body, "model": chat["model"], "prompt": prompt, "stream": bool(chat.get("stream"))} | (
            {"stream_options": {"include_usage": True}} if chat.get("stream") else {}
        )

    async def chat(self, url: str, chat: dict[str, Any], send: Send) -> None:
        assert self.session is not None
        body = self.completion_body(chat)
        async with self.session.post(f"{url}/v1/completions", json=body) as answer:
            if answer.status != 200 or not body["stream"]:
                data = await answer.json(loads=orjson.loads)
                await _answer(send, answer.status, data if answer.status != 200 else _chat_answer(data))
                return
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            async for event in _chat_chunks(answer.content):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _chat_answer(completion: dict[str, Any]) -> dict[str, Any]:
    choice = completion["choices"][0]
    message = {"role": "assistant", "content": choice["text"]}
    return {
        "id": completion["id"].replace("cmpl-", "chatcmpl-", 1),
        "object": "chat.completion",
        "created": completion["created"],
        "model": completion["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": choice["finish_reason"]}],
        "usage": completion["usage"],
    }


async def _chat_chunks(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The replica's completion events, each rewritten as a chat chunk (the first carries the role)."""
    first = True
    async for line in content:
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            yield b"data: [DONE]\n\n"
            return
        event = orjson.loads(line[6:])
        choices = []
        for choice in event["choices"]:
            delta = {"role": "assistant", "content": choice["text"]} if first else {"content": choice["text"]}
            choices.append({"index": 0, "delta": delta, "finish_reason": choice["finish_reason"]})
            first = False
        chunk = {**event, "id": event["id"].replace("cmpl-", "chatcmpl-", 1), "object": "chat.completion.chunk"}
        chunk["choices"] = choices
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": orjson.dumps(payload), "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    args = parser.parse_args()
    uvicorn.run(
        ChatFront(args.worker_urls),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
