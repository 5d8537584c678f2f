"""HTTP/1.1 over raw sockets to a running gateway, for tests of what arrives on the wire and when."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from gateway.server import RunningGateway

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]

# The connection limits are the fast path's `server_protocol`'s: on whatever RG_FASTPATH__* says (CI's pass with the
# fast path off).
PART_ON = {"enabled": True, "server_protocol": True}


def address(gw: RunningGateway) -> tuple[str, int]:
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


@contextlib.asynccontextmanager
async def connected(gw: RunningGateway) -> AsyncIterator[Connection]:
    reader, writer = await asyncio.open_connection(*address(gw))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a content-length: status, headers (lower-case names), body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def get(path: str, **headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "host: gateway", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def send_ignoring_reset(writer: asyncio.StreamWriter, data: bytes) -> None:
    # The gateway may close a refused connection while the rest of what the client sends is still on its way.
    with contextlib.suppress(ConnectionError):
        writer.write(data)
        await writer.drain()
