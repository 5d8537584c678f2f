"""Observability routes: `GET /metrics` (Prometheus), `GET /dashboard` (a live status page) and its JSON feed.

They expose no secrets: counters, replica ids and health, the weight version, queue depth, time series; of
sessions only the ids of the busiest few (their contents stay behind `/v1/sessions`, which the page's session view
calls with the agents' auth). By default they are open, for a cluster network (Prometheus scrapers and an
operator's browser rarely carry the admin token). `server.metrics_token` puts `/metrics` and `/dashboard/state`
behind a bearer token of their own (401 without, 403 wrong); the page itself holds no data and sends the token it
finds in its URL's fragment (`/dashboard#token=...`: a fragment never reaches a server or its logs). Everything
that changes state stays under `/admin` with the admin token. The time series and how several processes share
them: `gateway.dashboard.sampler`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.context import ApiServices
from gateway.api.deps import ServicesDep, require_metrics, services_of
from gateway.dashboard.sampler import WINDOW_S
from gateway.errors import NotFound
from gateway.metrics import CONTENT_TYPE, UNMATCHED_ROUTE, render_pools

logger = logging.getLogger(__name__)

router = APIRouter(tags=["observability"])

DISCONNECTED = 499  # the client left before a response started (nginx's convention)

# The page and its assets (gateway/assets/dashboard/, uPlot vendored by scripts/vendor_uplot.sh) come from the
# gateway itself; the policy makes the browser refuse anything from elsewhere, inline scripts included. Inline
# styles stay allowed: uPlot sizes its elements with style attributes.
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    ),
    "cache-control": "no-store",
}
_ASSETS = resources.files("gateway.assets").joinpath("dashboard")
# Every file the page loads, by the name it asks for: nothing else under the folder is served (no path lookup).
_ASSET_FILES = {
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
    "uPlot.LICENSE": ("vendor/uPlot.LICENSE", "text/plain; charset=utf-8"),
}


class RequestMetrics:
    """ASGI middleware: counts each HTTP request once, by route template (never the raw URL) and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def tracking(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            status = status or 500
            raise
        finally:
            count_request(scope, status or DISCONNECTED)


def count_request(scope: Scope, status: int) -> None:
    """Count one request of `scope` (its app and matched route set) with `status`, as `RequestMetrics` does."""
    # The services appear with the lifespan; a request served without one (a bare ASGI test) is not counted.
    services = services_of(scope["app"])
    if services is None:
        return
    route = scope.get("route")  # set by the router on the shared scope; absent if nothing matched
    services.metrics.observe_request(route.path if isinstance(route, Route) else UNMATCHED_ROUTE, status)


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(require_metrics)])
async def metrics(svc: ServicesDep) -> Response:
    """Prometheus text exposition of this gateway process (see gateway/metrics.py for the names); with several
    pools, each series labelled with its pool (`render_pools`)."""
    pools = {name: svc.for_model(name).metrics for name in svc.served_models()}
    await asyncio.gather(*(metrics.refresh() for metrics in pools.values()))
    return Response(render_pools(pools), media_type=CONTENT_TYPE)


def replica_view(svc: ApiServices) -> list[dict[str, Any]]:
    return [
        {
            "id": r.id,
            "healthy": r.healthy,
            "stale": r.stale,
            "draining": r.draining,
            "in_flight": r.in_flight,
            "version": r.version,
        }
        for r in svc.pool.all()
    ]


@router.get("/dashboard/state", dependencies=[Depends(require_metrics)])
async def dashboard_state(
    svc: ServicesDep,
    window_s: int = Query(WINDOW_S, ge=10, le=WINDOW_S),
    since: int | None = Query(None, ge=0, description="the first second of the series to send (Unix time)"),
) -> Response:
    """What the status page shows: a read-only subset of `/admin/status` (no URLs, no tokens), and the time
    series of the last `window_s` seconds of the whole cluster (`gateway.dashboard.sampler`); `since`: only the seconds
    from that one on (the page asks for the newest few once it has the rest). Encoded by orjson directly: a whole
    window is hundreds of kilobytes, which FastAPI's generic encoder takes tens of milliseconds to walk."""
    await svc.metrics.refresh()
    feed = svc.dashboard.feed(window_s, since) if svc.dashboard is not None else {}
    return Response(
        orjson.dumps(feed | _cards(svc)), media_type="application/json", headers={"cache-control": "no-store"}
    )


def _cards(svc: ApiServices) -> dict[str, Any]:
    g, w = svc.generator, svc.weights
    return {
        "version": w.version,
        "state": w.state,
        "updates": w.updates,
        "replicas": replica_view(svc),
        "serving_replicas": len(svc.pool.candidates()),
        "in_flight": sum(r.in_flight for r in svc.pool.all()),
        "queue_depth": svc.metrics.store_pending,
        "resumes_total": g.resumes_total,
        "preemptions_total": g.preemptions_total,
        "affinity_ratio": svc.pool.affinity.ratio,
        "tokens": {"prompt": g.prompt_tokens_total, "completion": g.completion_tokens_total},
    }


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live dashboard: throughput, latency, weight versions, trainer backlog, rewards, replicas."""
    return HTMLResponse(_read("index.html"), headers=_PAGE_HEADERS)


@router.get("/dashboard/assets/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    """The page's scripts and styles, served by the gateway so that the page works without any network."""
    found = _ASSET_FILES.get(name)
    if found is None:
        raise NotFound(f"no dashboard asset {name!r}", param="name")
    path, media_type = found
    return Response(_read(path), media_type=media_type, headers={"cache-control": "no-cache"})


@functools.cache
def _read(path: str) -> bytes:
    return _ASSETS.joinpath(path).read_bytes()
