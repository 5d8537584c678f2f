"""Streamed bodies through the server's own `send` (`server_send` under `fastpath:`): past the middlewares, and a
slow client's connection aborted at once.

Every ASGI middleware wraps `send` and so adds a Python call to every message; for an SSE relay that is one call
per middleware per event (per token on RL-shaped streams). The gateway's middlewares (Starlette's error handling,
FastAPI's, the request metrics, the body limit) only ever look at `http.response.start`, so with this part on,
`GatewayApp` keeps the server's `send` in the scope and `GuardedStreamingResponse` sends body chunks straight to it
once the head went through the middlewares (`gateway.api.streaming`).

A client cut for reading too slowly (`gateway.api.client_writer.SlowClient`) has its connection aborted here, the
bytes queued for it dropped: ASGI has no message for that, so `abort_connection` reaches the transport through
uvicorn's `send`, a method of its request cycle (`send.__self__.transport`; uvicorn is pinned in pyproject.toml and
`tests/gateway/fastpath/test_taken.py` fails when the transport is no longer found). With the part off, body chunks
pass through every middleware, and a cut client's response returns without its end: uvicorn then closes the
connection once the bytes it already buffered are sent (a client that never reads keeps its socket until the
kernel gives up on it).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import Send

__all__ = ["abort_connection", "server_transport"]


def server_transport(send: Send) -> asyncio.BaseTransport | None:
    """The transport of the connection uvicorn's `send` answers on, or None for any other `send`."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    return transport if isinstance(transport, asyncio.BaseTransport) else None


def abort_connection(send: Send) -> None:
    """Close the connection of the server's `send` at once, queued bytes dropped (nothing for another `send`)."""
    transport = server_transport(send)
    if isinstance(transport, asyncio.WriteTransport):
        with contextlib.suppress(Exception):
            transport.abort()
