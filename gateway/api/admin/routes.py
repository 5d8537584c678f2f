"""Admin routes: weight updates, out-of-band pause/resume, status, replicas. Bearer admin token required."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from backends.base import GROUP_BACKENDS, PauseMode, TensorMeta, TransferBackend
from gateway.api.bounds import INTEGRAL
from gateway.api.deps import ServicesDep, require_admin
from gateway.config import ReplicaConfig, without_credentials
from gateway.errors import InvalidRequest, NotFound
from gateway.routing import Engine, Replica
from gateway.trajectory import MAX_VERSION
from gateway.weights import UpdateReport
from gateway.weights.transfer import TransferSpec

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


TorchDtype = Literal[
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
]


class TensorEntry(BaseModel):
    """One tensor of a transfer's manifest, as the engine receives it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=1024, description="Its checkpoint name.")
    dtype: TorchDtype = Field(description="Its torch dtype, as the trainer broadcasts it.")
    shape: list[Annotated[int, Field(ge=0, le=2**40), INTEGRAL]] = Field(max_length=16)


class TransferRequest(BaseModel):
    """An in-memory transfer: the trainer pushes the tensors into the engines itself. `nccl` (and `gloo`, vLLM's CPU
    build): one process group per engine, the trainer its rank 0, hosting engine i's rendezvous at
    `master_address:(master_port + i)`; `tensor`: the tensors go inline in SGLang's `/update_weights_from_tensor`
    (no group). `manifest` (group backends): the chunks the trainer will broadcast, in order; the gateway then makes
    each engine's receiving call per chunk itself, and the trainer only broadcasts (it needs no route to the
    engines' HTTP ports)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    backend: TransferBackend = Field(description="nccl | gloo | tensor")
    master_address: str | None = Field(None, min_length=1, description="nccl, gloo: the trainer's rendezvous host.")
    master_port: Annotated[int, Field(ge=1, le=65535), INTEGRAL] | None = Field(
        None, description="nccl, gloo: engine 0's rendezvous port."
    )
    manifest: list[Annotated[list[TensorEntry], Field(min_length=1, max_length=100_000)]] | None = Field(
        None,
        max_length=100_000,
        description="nccl, gloo: the chunks the trainer broadcasts, in order, each a list of its tensors; the "
        "gateway fans the engines' receiving calls out (none: the trainer calls them itself).",
    )

    def spec(self) -> TransferSpec:
        if self.backend in GROUP_BACKENDS and (self.master_address is None or self.master_port is None):
            raise InvalidRequest(
                f'a "{self.backend}" transfer needs "master_address" and "master_port" (the rendezvous the trainer '
                "hosts)",
                param="transfer",
            )
        if self.manifest is not None and self.backend not in GROUP_BACKENDS:
            raise InvalidRequest(
                f'a "{self.backend}" transfer takes no "manifest": its tensors go inline, the trainer\'s own calls',
                param="transfer.manifest",
            )
        manifest = None
        if self.manifest is not None:
            manifest = tuple(
                tuple(TensorMeta(t.name, t.dtype, tuple(t.shape)) for t in chunk) for chunk in self.manifest
            )
        return TransferSpec(self.backend, self.master_address, self.master_port, manifest)


_POOL = "The pool's model (`pools:`); required where there are several pools."
PoolModel = Annotated[str | None, Query(min_length=1, description=_POOL)]


class WeightsUpdate(BaseModel):
    """Exactly one of `path` (the engines load that checkpoint), `source: "external"` (the weights were synced into
    the engines out of band; they are only relabelled `version`) and `transfer` (the two-phase in-memory update,
    committed by `POST /admin/weights/{version}/commit`): a relabel must never happen by omission."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: Annotated[int, Field(ge=0, le=MAX_VERSION), INTEGRAL] = Field(
        description="The new weight version (the trainer's step); must increase."
    )
    path: str | None = Field(None, min_length=1, description="Checkpoint path every engine can read and loads.")
    source: Literal["external"] | None = Field(
        None,
        description='"external": the weights are in the engines already (NCCL, checkpoint engine); only relabel them.',
    )
    transfer: TransferRequest | None = Field(
        None, description="An in-memory transfer the trainer pushes, then commits (answered 202 with the layout)."
    )
    mode: PauseMode | None = Field(None, description="abort | keep | wait; default weights.pause_mode.")
    model: str | None = Field(None, min_length=1, description=_POOL)

    def checked_path(self) -> str | None:
        """The path to load, or None to relabel or transfer; a body with none or several is a 400 saying which."""
        given = [name for name in ("path", "source", "transfer") if getattr(self, name) is not None]
        if not given:
            raise InvalidRequest(
                'give "path" (a checkpoint the engines load), "source": "external" (the weights were synced into '
                'the engines out of band; they are only relabelled) or "transfer" (an in-memory transfer)',
                param="path",
            )
        if len(given) > 1:
            raise InvalidRequest(
                'give exactly one of "path" (the engines load it), "source": "external" (relabel only) and '
                f'"transfer" (in memory), not both {given[0]!r} and {given[1]!r}',
                param=given[1],
            )
        return self.path


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: PauseMode | None = None
    model: str | None = Field(None, min_length=1, description=_POOL)


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Annotated[int, Field(ge=0, le=MAX_VERSION), INTEGRAL] = Field(
        description="The version the out-of-band sync loaded; must increase."
    )
    model: str | None = Field(None, min_length=1, description=_POOL)


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
        "transfer_backends": sorted(engine.backend.capabilities.transfer_backends),  # in-memory updates it takes
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
    207 `partial`; 502 when it loaded nowhere (raised by the coordinator after its rollback). With `transfer`: 202
    at once with the layout; the pause and the engines' sides follow (`GET /admin/weights/{version}` says when
    they are open), the commit ends it."""
    path = body.checked_path()
    svc = svc.for_model(body.model)
    if svc.settings.model.base_model is not None:
        _check_adapter_update(body, svc.settings.model.name)
    if body.transfer is not None:
        held = await svc.weights.transfers.begin(body.version, body.transfer.spec(), body.mode)
        return JSONResponse(held.layout(), status_code=202)
    return _answer(await svc.weights.update(body.version, path, body.mode))


def _check_adapter_update(body: WeightsUpdate, adapter: str) -> None:
    """A LoRA policy's version is an adapter the engines load from a path, beside the versions in flight."""
    if body.path is None:
        raise InvalidRequest(f"`{adapter}` is a LoRA adapter: its versions load from a path", param="path")
    if body.mode not in (None, "keep"):
        raise InvalidRequest(
            f"`{adapter}` is a LoRA adapter: a new version loads beside the one in flight, without a pause "
            f"(mode keep, not {body.mode!r})",
            param="mode",
        )


def _answer(report: UpdateReport) -> Response:
    return JSONResponse(_report(report), status_code=207 if report.status == "partial" else 200)


@router.get("/weights/{version}")
async def transfer_status(
    version: int,
    svc: ServicesDep,
    wait_s: Annotated[float, Query(ge=0, le=600)] = 0.0,
    model: PoolModel = None,
) -> dict[str, Any]:
    """An in-memory transfer's layout and state (from any gateway process of the fleet); with `wait_s`, once every
    engine's side is open (or failed)."""
    return await svc.for_model(model).weights.transfers.status(version, wait_s)


@router.post("/weights/{version}/commit")
async def commit_transfer(version: int, svc: ServicesDep, model: PoolModel = None) -> Response:
    """The trainer pushed the tensors: finish every engine's transfer with `version`, verify, resume. 200 / 207 /
    502 as a path update."""
    return _answer(await svc.for_model(model).weights.transfers.commit(version))


@router.post("/pause")
async def pause(body: PauseRequest, svc: ServicesDep) -> dict[str, Any]:
    svc = svc.for_model(body.model)
    await svc.weights.pause(body.mode)
    return {"status": "paused", "version": svc.weights.version}


@router.post("/resume")
async def resume(body: ResumeRequest, svc: ServicesDep) -> dict[str, Any]:
    return _report(await svc.for_model(body.model).weights.resume(body.version))


@router.get("/status")
async def status(svc: ServicesDep, model: PoolModel = None) -> dict[str, Any]:
    """The pool of `model` (`pools:`; required where there are several): its version, replicas and counters."""
    svc = svc.for_model(model)
    await svc.metrics.refresh()  # the pending count, read from Redis with a short timeout
    return {
        "pid": os.getpid(),  # which gateway process answered (`serve --workers N` runs several on one port)
        "model": svc.settings.model.name,
        "models": svc.served_models(),  # every pool's (`pools:`)
        "store_prefix": svc.settings.store.prefix,  # its Redis keys' (a trainer's `TrajectoryConsumer(prefix=...)`)
        # Where the trainer reads trajectories (the embedded server's too), credentials removed.
        "redis_url": without_credentials(svc.redis_url),
        "version": svc.weights.version,
        "state": svc.weights.state,
        "updates": svc.weights.updates,
        "replicas": [replica_status(r) for r in svc.pool.all()],
        "engines": [engine_status(e) for e in svc.pool.engines()],  # the replicas as added (one per engine)
        "affinity_ratio": svc.pool.affinity.ratio,
        "resumes_total": svc.generator.resumes_total,
        "preemptions_total": svc.generator.preemptions_total,
        "store_pending": svc.metrics.store_pending,
        "tokens": {"prompt": svc.generator.prompt_tokens_total, "completion": svc.generator.completion_tokens_total},
    }


@router.post("/replicas", status_code=201)
async def add_replica(body: ReplicaConfig, svc: ServicesDep, model: PoolModel = None) -> dict[str, Any]:
    return engine_status(await svc.for_model(model).add_replica(body))


@router.delete("/replicas/{replica_id}", status_code=204)
async def remove_replica(replica_id: str, svc: ServicesDep, model: PoolModel = None) -> Response:
    svc = svc.for_model(model)
    if svc.pool.engine(replica_id) is None:
        raise NotFound(f"no replica {replica_id!r}", param="replica_id")
    await svc.remove_replica(replica_id)
    return Response(status_code=204)
