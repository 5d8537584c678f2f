"""Observability routes: `GET /metrics` (Prometheus), `GET /dashboard` (a live status page) and its JSON feed.

They expose no secrets and no per-session data: counters, replica ids and health, the weight version, queue depth.
By default they are open, for a cluster network (Prometheus scrapers and an operator's browser rarely carry the
admin token). `server.metrics_token` puts `/metrics` and `/dashboard/state` behind a bearer token of their own
(401 without, 403 wrong); the page itself holds no data and sends the token it finds in its URL's fragment
(`/dashboard#token=...`: a fragment never reaches a server or its logs). Everything that changes state stays under
`/admin` with the admin token.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.deps import ServicesDep, require_metrics, services_of
from gateway.metrics import CONTENT_TYPE, UNMATCHED_ROUTE
from gateway.services import Services

logger = logging.getLogger(__name__)

router = APIRouter(tags=["observability"])

DISCONNECTED = 499  # the client left before a response started (nginx's convention)

# The page is self-contained; the policy makes the browser refuse anything from elsewhere.
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    ),
    "cache-control": "no-store",
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
    """Prometheus text exposition of this gateway process (see gateway/metrics.py for the names)."""
    await svc.metrics.refresh()
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE)


def replica_view(svc: Services) -> list[dict[str, Any]]:
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
async def dashboard_state(svc: ServicesDep, response: Response) -> dict[str, Any]:
    """What the status page shows: a read-only subset of `/admin/status` (no URLs, no tokens)."""
    await svc.metrics.refresh()
    response.headers["cache-control"] = "no-store"
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
    """A live status page: replicas, health, version, in-flight, queue depth; refreshes every second."""
    return HTMLResponse(DASHBOARD_HTML, headers=_PAGE_HEADERS)


# One file, no external assets: inline CSS and JS, data rendered with textContent (never as HTML).
DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rollout-gateway</title>
<style>
  :root { --bg: #f6f7f9; --card: #fff; --ink: #1c2430; --muted: #6b7583; --line: #e3e6ea;
          --ok: #1f9d55; --warn: #d08700; --bad: #d64545; }
  * { box-sizing: border-box; }
  body { margin: 0; padding: 24px 32px; background: var(--bg); color: var(--ink);
         font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
  header { display: flex; align-items: baseline; gap: 16px; margin-bottom: 20px; }
  h1 { font-size: 20px; margin: 0; }
  #status { color: var(--muted); }
  #status.error { color: var(--bad); font-weight: 600; }
  .cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px;
           margin-bottom: 20px; }
  .card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
  .card .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
  .card .value { font-size: 24px; font-weight: 600; margin-top: 4px; font-variant-numeric: tabular-nums; }
  table { width: 100%; border-collapse: collapse; background: var(--card); border: 1px solid var(--line);
          border-radius: 8px; overflow: hidden; }
  th, td { text-align: left; padding: 10px 14px; border-bottom: 1px solid var(--line); }
  th { background: #eef0f3; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
  td.num { font-variant-numeric: tabular-nums; }
  tr:last-child td { border-bottom: 0; }
  .pill { display: inline-block; padding: 2px 10px; border-radius: 999px; font-size: 12px; font-weight: 600;
          color: #fff; }
  .pill.ok { background: var(--ok); } .pill.warn { background: var(--warn); } .pill.bad { background: var(--bad); }
  .bar { display: inline-block; height: 8px; background: #4c7bd9; border-radius: 4px; vertical-align: middle;
         margin-left: 8px; }
</style>
</head>
<body>
<header><h1>rollout-gateway</h1><span id="status">connecting&hellip;</span></header>
<section class="cards">
  <div class="card"><div class="label">Weight version</div><div class="value" id="version">&ndash;</div></div>
  <div class="card"><div class="label">Weights</div><div class="value" id="state">&ndash;</div></div>
  <div class="card"><div class="label">Serving</div><div class="value" id="serving">&ndash;</div></div>
  <div class="card"><div class="label">In flight</div><div class="value" id="in_flight">&ndash;</div></div>
  <div class="card"><div class="label">Queue depth</div><div class="value" id="queue_depth">&ndash;</div></div>
  <div class="card"><div class="label">Resumes</div><div class="value" id="resumes">&ndash;</div></div>
  <div class="card"><div class="label">Affinity</div><div class="value" id="affinity">&ndash;</div></div>
</section>
<table>
  <thead><tr><th>Replica</th><th>Health</th><th>Version</th><th>In flight</th></tr></thead>
  <tbody id="replicas"></tbody>
</table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const show = (id, value) => { $(id).textContent = value === null || value === undefined ? "\\u2013" : value; };

function health(r) {
  if (!r.healthy) return ["down", "bad"];
  if (r.stale) return ["stale", "warn"];
  if (r.draining) return ["draining", "warn"];
  return ["healthy", "ok"];
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function render(s) {
  show("version", s.version);
  show("state", s.state);
  show("serving", s.serving_replicas + " / " + s.replicas.length);
  show("in_flight", s.in_flight);
  show("queue_depth", s.queue_depth);
  show("resumes", s.resumes_total);
  show("affinity", (100 * s.affinity_ratio).toFixed(1) + "%");
  const most = Math.max(1, ...s.replicas.map((r) => r.in_flight));
  const body = document.createElement("tbody");
  body.id = "replicas";
  for (const r of s.replicas) {
    const row = body.insertRow();
    row.dataset.replica = r.id;
    cell(row, r.id);
    const [label, tone] = health(r);
    const pill = document.createElement("span");
    pill.className = "pill " + tone;
    pill.textContent = label;
    row.insertCell().appendChild(pill);
    cell(row, r.version === null ? "?" : r.version, "num");
    const load = cell(row, r.in_flight, "num");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = Math.round(120 * r.in_flight / most) + "px";
    load.appendChild(bar);
  }
  $("replicas").replaceWith(body);
}

// The metrics token, if the gateway needs one, comes in the page's fragment (#token=...), which no server sees.
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? { authorization: "Bearer " + token } : {};

async function poll() {
  try {
    const response = await fetch("dashboard/state", { cache: "no-store", headers });
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    $("status").className = "";
    $("status").textContent = "live \\u00b7 updated " + new Date().toLocaleTimeString();
  } catch (err) {
    $("status").className = "error";
    $("status").textContent = "disconnected: " + err.message;
  } finally {
    setTimeout(poll, 1000);
  }
}
poll();
</script>
</body>
</html>
"""
