"""The floor of the gateway's own stack: a pass-through relay on uvicorn (httptools, uvloop) and the gateway's engine
client, nothing more.

    python benchmarks/python_relay.py --port 8100 --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002

`benchmarks/compare.py --targets python-relay ...` runs it like the Rust routers (same flags). It forwards each POST's
body to the replica picked by a hash of `X-Session-ID` through that replica's `KeepAlivePool` (the client the gateway
sends its generation requests with, `gateway.fastpath.engine_client`) and relays the answer's bytes as they come: no
parsing, no validation, no token bookkeeping, no Redis. Other methods go through one pooled aiohttp session, as the
gateway's control calls do. Whatever the gateway costs above this row is the gateway's own work; what this row costs
above the Rust routers is the price of the stack (a Python event loop, uvicorn's server, the engine client), which no
change inside the gateway's request handling can remove.

The pool keeps no answer headers: an answer whose body starts as an event stream (`data:`, `event:`, `:`) is relayed
as `text/event-stream`, any other as `application/json` (what the engines send on these routes).
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp
import uvicorn

from gateway.fastpath.engine_client import KeepAlivePool

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_EVENT_STREAM_STARTS = (b"data:", b"event:", b":")


class Relay:
    """The ASGI app: a kept-alive pool per replica for POSTs, one aiohttp session for the rest; both opened and
    closed with the server's lifespan."""

    def __init__(self, worker_urls: Sequence[str]) -> None:
        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.pools: list[KeepAlivePool] = []
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.relay(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.pools = [KeepAlivePool(url, 4096, 10.0, 60.0, 600.0) for url in self.worker_urls]
                connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
                self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for pool in self.pools:
                    await pool.aclose()
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def relay(self, scope: Message, receive: Receive, send: Send) -> None:
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = dict(scope["headers"])
        index = zlib.crc32(headers.get(b"x-session-id", b"")) % len(self.worker_urls)
        path = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        if scope["method"] == "POST":
            await self.relay_post(self.pools[index], path, body, send)
        else:
            await self.relay_other(scope["method"], self.worker_urls[index] + path, body, headers, send)

    async def relay_post(self, pool: KeepAlivePool, path: str, body: bytes, send: Send) -> None:
        async with pool.stream(path, body) as answer:
            data = await answer.read()
            answer_type = b"text/event-stream" if data.startswith(_EVENT_STREAM_STARTS) else b"application/json"
            await send(
                {"type": "http.response.start", "status": answer.status, "headers": [(b"content-type", answer_type)]}
            )
            while data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                data = await answer.read()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def relay_other(self, method: str, url: str, body: bytes, headers: dict[bytes, bytes], send: Send) -> None:
        assert self.session is not None
        content_type = headers.get(b"content-type", b"application/json").decode()
        async with self.session.request(method, url, data=body, headers={"content-type": content_type}) as answer:
            answer_type = answer.headers.get("content-type", "application/json").encode()
            await send(
                {"type": "http.response.start", "status": answer.status, "headers": [(b"content-type", answer_type)]}
            )
            async for data in answer.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prometheus-port", type=int, default=None, help="accepted like the routers', unused")
    parser.add_argument("--worker-urls", nargs="+", required=True)
    args = parser.parse_args()
    uvicorn.run(
        Relay(args.worker_urls),
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
