"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from gateway.api.deps import ServicesDep

router = APIRouter(tags=["health"])


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
    """200 when a request could be served now; 503 while no replica can serve or an update is under way."""
    serving = bool(svc.pool.candidates()) and svc.weights.serving
    response.status_code = 200 if serving else 503
    return {"ready": serving}
