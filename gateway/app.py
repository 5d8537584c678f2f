"""`create_app()`: the FastAPI application with its lifespan, routers and error handlers."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from gateway.api import observability
from gateway.api.admin import health
from gateway.api.admin import routes as admin
from gateway.api.anthropic import routes as anthropic
from gateway.api.errors import install_error_handlers
from gateway.api.generate import routes as generate
from gateway.api.limits import BodySizeLimit
from gateway.api.openai import routes as openai
from gateway.api.openapi import install_openapi
from gateway.api.responses import routes as responses
from gateway.api.sessions import routes as session_routes
from gateway.api.streaming import GatewayApp
from gateway.config import Settings
from gateway.fastpath.hot_routes import HotRoutes
from gateway.fastpath.one_pass_route import OnePassRoute
from gateway.fastpath.server_send import abort_connection
from gateway.gc_tuning import tune_gc
from gateway.services import BackendFactory, Services, default_backend_factory, open_services


def create_app(
    settings: Settings,
    backend_factory: BackendFactory = default_backend_factory,
    *,
    server_process: bool = False,
    on_started: Callable[[Services], None] | None = None,
) -> FastAPI:
    """The gateway app; its services start with the app's lifespan and close with it. `server_process`: this
    process serves only the gateway (`rollout-gateway serve`), so its garbage collector is tuned after startup
    (`gateway.gc_tuning`); an app embedded in another program leaves the collector alone. The fast path's parts
    on the app (`settings.fastpath`: one-pass routes, hot routes, streamed bodies past the middlewares) answer
    exactly as FastAPI alone does (tests compare the two). `on_started` is called once the services are up, before
    the first request (the `serve` command prints the Redis URL from it)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with open_services(settings, backend_factory) as services:
            app.state.services = services
            app.services = services
            if on_started is not None:
                on_started(services)
            if server_process:
                tune_gc()
            yield

    app = GatewayApp(title="rollout-gateway", version="0.1.0", lifespan=lifespan, **_no_otel_telemetry())
    if settings.fastpath.on("hot_routes"):
        app.shortcut_factory = HotRoutes.of
    if settings.fastpath.on("server_send"):
        app.abort_client = abort_connection
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(health.router)
    route_class = OnePassRoute if settings.fastpath.on("one_pass_routes") else APIRoute
    app.include_router(generate.create_router(route_class))
    app.include_router(openai.create_router(route_class))
    app.include_router(openai.create_session_router())
    app.include_router(anthropic.create_router())
    app.include_router(anthropic.create_session_router())
    app.include_router(responses.create_router(route_class))
    app.include_router(responses.create_session_router())
    app.include_router(session_routes.router)
    app.include_router(admin.router)
    app.include_router(observability.router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(observability.RequestMetrics)  # outermost: counts the 413s of the body limit too
    return app


def _no_otel_telemetry() -> dict[str, Any]:
    """Turn off FastAPI's built-in OpenTelemetry hooks where the installed FastAPI has them (newer releases): they
    look up providers and environment variables on every request, and the gateway exports its own Prometheus
    metrics (`/metrics`). An app that wants OpenTelemetry can wrap the ASGI app with its own instrumentation."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
