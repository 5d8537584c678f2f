"""The gateway's engine client side by side with aiohttp's: CPU per generation request, whole and streamed.

A raw HTTP/1.1 server in a child process answers at once (a fixed JSON answer; for streams, a chunked SSE answer
of `--events` events in one write), so what this process spends is the client's own work. Both clients run in
this process on uvloop, alternately, `--rounds` times each, with `--concurrency` callers over kept-alive
connections:

* `aiohttp`: one `ClientSession` with the settings the gateway used for its engine calls (base URL, no
  decompression, no User-Agent), `session.post(...)` then `read()` (whole) or `readany()` to the end (streamed);
* `KeepAlivePool` (`gateway.fastpath.engine_client`): `post` (whole) or `stream` with `read()` to the end (streamed).

The figure is this process's CPU (user + system) per request over the timed part, and the ratio of the pool's to
aiohttp's, per round and as the median; the load is the same, so the ratio is what the client costs.

    python -m benchmarks.engine_client
    python -m benchmarks.engine_client --requests 2000 --rounds 2     # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
import uvloop

from benchmarks._harness import free_port, machine_line, make_console, print_table
from gateway.fastpath.engine_client import KeepAlivePool

WHOLE = b'{"choices":[{"index":0,"token_ids":[5],"logprobs":{"token_logprobs":[-0.5]},"finish_reason":"length"}]}'
EVENT = b'data: {"choices":[{"index":0,"token_ids":[5],"logprobs":{"token_logprobs":[-0.5]},"finish_reason":null}]}\n\n'
BODY = b'{"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 8, "request_id": "bench-request-0"}'

SERVER = r"""
import asyncio, sys, uvloop
whole, event, events = sys.argv[2].encode(), sys.argv[3].encode(), int(sys.argv[4])
WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(whole), whole)
body = event * events + b"data: [DONE]\n\n"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
STREAM = HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)

class Answering(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(STREAM if head.startswith(b"post /stream") else WHOLE)

async def main():
    server = await asyncio.get_running_loop().create_server(Answering, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()
uvloop.run(main())
"""

Call = Callable[[], Awaitable[int]]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=6000, help="timed requests per client and round")
    parser.add_argument("--concurrency", type=int, default=32, help="callers at once")
    parser.add_argument("--events", type=int, default=16, help="events of each streamed answer")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per client and kind, alternating")
    return parser.parse_args(argv)


async def cpu_per_request(call: Call, requests: int, concurrency: int) -> float:
    """This process's CPU seconds per call of `call` (which returns the answer's length, checked non-zero)."""

    async def caller(count: int) -> None:
        for _ in range(count):
            if not await call():
                raise RuntimeError("an empty answer")

    await asyncio.gather(*(caller(20) for _ in range(concurrency)))  # warm: connections open, code paths run
    per_caller = max(1, requests // concurrency)
    started = time.process_time()
    await asyncio.gather(*(caller(per_caller) for _ in range(concurrency)))
    return (time.process_time() - started) / (per_caller * concurrency)


async def run(options: argparse.Namespace) -> list[list[str]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), WHOLE.decode(), EVENT.decode(), str(options.events)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the answering server did not start")
        session = aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        pool = KeepAlivePool(url, 1024, connect_timeout_s=5, pool_timeout_s=30, read_timeout_s=30)
        headers = {"content-type": "application/json"}
        sse_headers = {**headers, "accept": "text/event-stream"}

        async def aiohttp_whole() -> int:
            async with session.post("/whole", data=BODY, headers=headers) as response:
                return len(await response.read())

        async def pool_whole() -> int:
            return len((await pool.post("/whole", BODY))[1])

        async def aiohttp_stream() -> int:
            size = 0
            async with session.post("/stream", data=BODY, headers=sse_headers) as response:
                while data := await response.content.readany():
                    size += len(data)
            return size

        async def pool_stream() -> int:
            size = 0
            async with pool.stream("/stream", BODY) as answer:
                while data := await answer.read():
                    size += len(data)
            return size

        rows = []
        kinds = (("whole answer", aiohttp_whole, pool_whole), ("streamed answer", aiohttp_stream, pool_stream))
        for kind, by_aiohttp, by_pool in kinds:
            ratios, theirs, ours = [], [], []
            for _ in range(options.rounds):
                theirs.append(await cpu_per_request(by_aiohttp, options.requests, options.concurrency))
                ours.append(await cpu_per_request(by_pool, options.requests, options.concurrency))
                ratios.append(ours[-1] / theirs[-1])
            rows.append(
                [
                    kind,
                    f"{statistics.median(theirs) * 1e6:.1f}",
                    f"{statistics.median(ours) * 1e6:.1f}",
                    " ".join(f"{r:.2f}" for r in ratios),
                    f"{statistics.median(ratios):.2f}",
                ]
            )
        await session.close()
        await pool.aclose()
        return rows
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    console = make_console()
    rows = uvloop.run(run(options))
    print_table(
        console,
        f"Engine client: CPU µs per request, {options.concurrency} callers, kept-alive connections "
        f"(streams: {options.events} events each) — {machine_line()}",
        ["answer", "aiohttp", "KeepAlivePool", "pool ÷ aiohttp, each round", "median"],
        rows,
        "this process's user + system CPU per request over the timed part (the answering server is another "
        "process); the same requests through each client, alternately.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
