"""Serving the gateway: in this process on a free port (tests, the demo) or as the production server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import Settings
from gateway.connection_limits import ConnectionLimits, derived_max_connections
from gateway.fastpath.server_protocol import protocol_class
from gateway.services import BackendFactory, Services, default_backend_factory


@dataclass
class RunningGateway:
    url: str
    app: FastAPI
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    async def stop(self) -> None:
        """Shut down gracefully now (also what leaving `serve_gateway` does; a second call is a no-op)."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def connection_limits(settings: Settings) -> ConnectionLimits:
    """The client connection limits of `settings.server` (the connection cap derived from the fd limit if unset)."""
    server = settings.server
    cap = server.max_connections or derived_max_connections(settings.redis.max_connections)
    return ConnectionLimits(
        max_header_bytes=server.max_header_bytes,
        header_timeout_s=server.header_timeout_s,
        max_connections=cap,
        body_timeout_s=server.body_timeout_s,
        min_body_rate_bytes_s=server.min_body_rate_bytes_s,
        silent_timeout_near_cap_s=server.silent_timeout_near_cap_s,
    )


def uvicorn_config(
    app: FastAPI,
    settings: Settings,
    *,
    log_level: str = "warning",
    in_process: bool = True,
) -> uvicorn.Config:
    """httptools with the connection limits of `settings.server`: with the fast path's `server_protocol` where bytes
    arrive, letting go of a lost connection at once (gateway/fastpath/server_protocol.py); without it, uvicorn's
    `limit_concurrency` caps the connections alone. Graceful shutdown (uvicorn's stages): stop accepting, let
    in-flight requests run for at most `server.shutdown_timeout_s`, cancel the rest (their turns record what they
    generated), then close the services."""
    limits = connection_limits(settings)
    own_protocol = settings.fastpath.on("server_protocol")
    return uvicorn.Config(
        app,
        loop="none" if in_process else "uvloop",
        http=protocol_class(limits) if own_protocol else "httptools",
        limit_concurrency=None if own_protocol else limits.max_connections,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        # No client sits behind a proxy whose X-Forwarded-* the gateway would need (it logs no client addresses),
        # and no answer needs to name the server: one ASGI layer and a header less on every request.
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=max(1, round(settings.server.shutdown_timeout_s)),
    )


@contextlib.asynccontextmanager
async def serve_gateway(
    settings: Settings,
    backend_factory: BackendFactory = default_backend_factory,
    host: str = "127.0.0.1",
) -> AsyncIterator[RunningGateway]:
    """Run the gateway on the current event loop on a free port until the block exits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the listener says TCP;
    # without it every JSON answer (headers, then body) waits ~40 ms for the peer's delayed ACK.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, settings.server.port))
    app = create_app(settings, backend_factory)
    config = uvicorn_config(app, settings)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="gateway")
    running = RunningGateway(f"http://{host}:{sock.getsockname()[1]}", app, server, task)
    try:
        while not server.started:
            if task.done():
                task.result()  # startup failed: raise its error
                raise RuntimeError("gateway stopped during startup")
            await asyncio.sleep(0.01)  # uvicorn exposes no startup event; bounded by the task ending
        yield running
    finally:
        await running.stop()
        sock.close()
