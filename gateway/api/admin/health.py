"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from gateway.api.deps import ServicesDep

router = APIRouter(tags=["health"])

READY_STORE_TIMEOUT_S = 1.0  # a probe answers within its own timeout (Kubernetes' default is 1 s)


@router.get("/health")
async def health(svc: ServicesDep) -> dict[str, Any]:
    """The process is up; says how many replicas can serve and which weight version runs."""
    serving = len(svc.pool.candidates())
    return {
        "status": "ok" if serving else "degraded",
        "version": svc.weights.version,
        "weights_state": svc.weights.state,
        "replicas": {"serving": serving, "total": len(svc.pool.all())},
    }


@router.get("/ready")
async def ready(response: Response, svc: ServicesDep) -> dict[str, Any]:
    """200 when a request could be served now; 503 (with a Retry-After) while no replica can serve, an update is
    under way, or the trajectory store (Redis) does not answer: a turn needs all three."""
    replicas = bool(svc.pool.candidates()) and svc.weights.serving
    store = await svc.store.reachable(READY_STORE_TIMEOUT_S)
    serving = replicas and store
    response.status_code = 200 if serving else 503
    if not serving:
        response.headers["Retry-After"] = "1"
    return {"ready": serving, "replicas": replicas, "store": store}
