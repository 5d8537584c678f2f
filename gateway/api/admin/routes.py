"""Admin routes: weight updates, out-of-band pause/resume, status, replicas. Bearer admin token required."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from backends.base import PauseMode
from gateway.api.bounds import INTEGRAL
from gateway.api.deps import ServicesDep, require_admin
from gateway.config import ReplicaConfig, without_credentials
from gateway.errors import InvalidRequest, NotFound
from gateway.routing import Engine, Replica
from gateway.trajectory import MAX_VERSION
from gateway.weights import UpdateReport

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class WeightsUpdate(BaseModel):
    """Exactly one of `path` (the engines load that checkpoint) and `source: "external"` (the weights were synced
    into the engines out of band; they are only relabelled `version`): a relabel must never happen by omission."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: Annotated[int, Field(ge=0, le=MAX_VERSION), INTEGRAL] = Field(
        description="The new weight version (the trainer's step); must increase."
    )
    path: str | None = Field(None, min_length=1, description="Checkpoint path every engine can read and loads.")
    source: Literal["external"] | None = Field(
        None,
        description='"external": the weights are in the engines already (NCCL, checkpoint engine); only relabel them.',
    )
    mode: PauseMode | None = Field(None, description="abort | keep | wait; default weights.pause_mode.")

    def checked_path(self) -> str | None:
        """The path to load, or None to relabel only; a body with neither or both is a 400 saying which to give."""
        if self.path is None and self.source is None:
            raise InvalidRequest(
                'give "path" (a checkpoint the engines load) or "source": "external" (the weights were synced into '
                "the engines out of band; they are only relabelled)",
                param="path",
            )
        if self.path is not None and self.source is not None:
            raise InvalidRequest(
                'give either "path" (the engines load it) or "source": "external" (relabel only), not both',
                param="source",
            )
        return self.path


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: PauseMode | None = None


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Annotated[int, Field(ge=0, le=MAX_VERSION), INTEGRAL] = Field(
        description="The version the out-of-band sync loaded; must increase."
    )


def _report(report: UpdateReport) -> dict[str, Any]:
    return {
        "status": report.status,
        "version": report.version,
        "mode": report.mode,
        "updated": report.updated,
        "stale": report.stale,
        "errors": report.errors,
        "flush_pending": report.flush_pending,
        "duration_s": round(report.duration_s, 4),
    }


def replica_status(replica: Replica) -> dict[str, Any]:
    """One routing target: a replica, or one data-parallel rank of it (`rank`; None for a whole replica)."""
    return {
        "id": replica.id,
        "url": replica.backend.url,
        "rank": replica.rank,
        "healthy": replica.healthy,
        "stale": replica.stale,
        "draining": replica.draining,
        "in_flight": replica.in_flight,
        "version": replica.version,
        "consecutive_failures": replica.consecutive_failures,
    }


def engine_status(engine: Engine) -> dict[str, Any]:
    """One replica as added: its engine, and the ids of the routing targets it is."""
    return {
        "id": engine.id,
        "url": engine.backend.url,
        "targets": [target.id for target in engine.targets],
        "healthy": engine.healthy,
        "stale": engine.stale,
        "draining": engine.draining,
        "in_flight": engine.in_flight,
        "version": engine.version,
    }


@router.post(
    "/weights",
    responses={
        207: {
            "description": 'Some replicas loaded the version, the others are stale: `"status": "partial"`.',
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        502: {"description": "No replica loaded it: the previous version serves on (per-replica `errors`)."},
    },
)
async def update_weights(body: WeightsUpdate, svc: ServicesDep) -> Response:
    """Pause, load `path` on every replica (or relabel, with `source: external`), verify, resume. 200 `updated`;
    207 `partial`; 502 when it loaded nowhere (raised by the coordinator after its rollback)."""
    report = await svc.weights.update(body.version, body.checked_path(), body.mode)
    return JSONResponse(_report(report), status_code=207 if report.status == "partial" else 200)


@router.post("/pause")
async def pause(body: PauseRequest, svc: ServicesDep) -> dict[str, Any]:
    await svc.weights.pause(body.mode)
    return {"status": "paused", "version": svc.weights.version}


@router.post("/resume")
async def resume(body: ResumeRequest, svc: ServicesDep) -> dict[str, Any]:
    return _report(await svc.weights.resume(body.version))


@router.get("/status")
async def status(svc: ServicesDep) -> dict[str, Any]:
    await svc.metrics.refresh()  # the pending count, read from Redis with a short timeout
    return {
        "pid": os.getpid(),  # which gateway process answered (`serve --workers N` runs several on one port)
        # Where the trainer reads trajectories (the embedded server's too), credentials removed.
        "redis_url": without_credentials(svc.redis_url),
        "version": svc.weights.version,
        "state": svc.weights.state,
        "updates": svc.weights.updates,
        "replicas": [replica_status(r) for r in svc.pool.all()],
        "affinity_ratio": svc.pool.affinity.ratio,
        "resumes_total": svc.generator.resumes_total,
        "preemptions_total": svc.generator.preemptions_total,
        "store_pending": svc.metrics.store_pending,
        "tokens": {"prompt": svc.generator.prompt_tokens_total, "completion": svc.generator.completion_tokens_total},
    }


@router.post("/replicas", status_code=201)
async def add_replica(body: ReplicaConfig, svc: ServicesDep) -> dict[str, Any]:
    return engine_status(await svc.add_replica(body))


@router.delete("/replicas/{replica_id}", status_code=204)
async def remove_replica(replica_id: str, svc: ServicesDep) -> Response:
    if svc.pool.engine(replica_id) is None:
        raise NotFound(f"no replica {replica_id!r}", param="replica_id")
    await svc.remove_replica(replica_id)
    return Response(status_code=204)
