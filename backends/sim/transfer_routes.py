"""The weight-transfer routes of both dialects over `backends.sim.transfer.TransferSide`, with the real engines'
request and response shapes and rules.

vLLM (dev mode, and only with `--weight-transfer-config`: the simulator's `weight_transfer`):
`/init_weight_transfer_engine {init_info}` → `/start_weight_update` → `/update_weights {update_info: {names,
dtype_names, shapes}}` … → `/finish_weight_update {weight_version?}`; `/shutdown_weight_transfer_engine`;
`GET /get_world_size`. The worker's `RuntimeError`s (update before start, start twice, finish without start, shutdown
mid-update) come back through `collective_rpc` as 500s; successes answer `{"message": ...}`.

SGLang: `/init_weights_update_group`, `/destroy_weights_update_group`, `/update_weights_from_distributed`,
`/update_weights_from_tensor`, each update between `/begin_weight_update` and `/end_weight_update` (required: an
update outside them is refused); every answer `{"success", "message"}`, 400 where `success` is false. An update's
`weight_version` labels the weights at once; `flush_cache` (default true) flushes the radix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from backends.sim.common import json_response
from backends.sim.inline_tensors import decode_inline
from backends.sim.transfer import TransferError, TransferSide

vllm_router = APIRouter()
sglang_router = APIRouter()


def _side(raw: Request) -> TransferSide:
    side: TransferSide = raw.app.state.transfer
    return side


def install(app: FastAPI, router: APIRouter) -> None:
    """The dialect's transfer routes, over the replica's `TransferSide` (`app.state.transfer`, made by `build_app`)."""
    app.include_router(router)


def vllm_errors(app: FastAPI, error_body: Callable[[str, int], bytes], configured: str | None) -> None:
    """A refused call is the worker's RuntimeError, answered 500 by vLLM's server; without a transfer config every
    call is refused so (vLLM's `_check_weight_transfer_engine`)."""
    app.state.weight_transfer = configured

    async def on_error(_: Request, exc: Exception) -> Response:
        return Response(error_body(str(exc), 500), status_code=500, media_type="application/json")

    app.add_exception_handler(TransferError, on_error)


def _vllm_side(raw: Request) -> TransferSide:
    if raw.app.state.weight_transfer is None:
        raise TransferError("Weight transfer not configured. Please set --weight-transfer-config to enable it.")
    return _side(raw)


# -- vLLM ---------------------------------------------------------------------------------------------------------


@vllm_router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(
    raw: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]
) -> dict[str, str]:
    side = _vllm_side(raw)
    try:
        address, port = str(init_info["master_address"]), int(init_info["master_port"])
        rank_offset, world_size = int(init_info["rank_offset"]), int(init_info["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"invalid init_info for backend {raw.app.state.weight_transfer!r}: {exc!r}") from exc
    await side.init_group(address, port, rank_offset, world_size)
    return {"message": "Weight transfer initialized"}


@vllm_router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(raw: Request) -> dict[str, str]:
    side = _vllm_side(raw)
    if side.active:
        raise TransferError("Cannot release a trainer connection during a weight update")
    if side.group is not None:
        await side.destroy_group()
    return {"message": "Weight transfer shut down"}


@vllm_router.post("/start_weight_update")
async def start_weight_update(raw: Request) -> dict[str, str]:
    side = _vllm_side(raw)
    if side.active:
        raise TransferError(
            "start_weight_update called while a weight update is already active. Call finish_weight_update first."
        )
    side.start()
    return {"message": "Weight update started"}


class VllmUpdateInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@vllm_router.post("/update_weights")
async def update_weights(raw: Request, update_info: Annotated[VllmUpdateInfo, Body(embed=True)]) -> dict[str, str]:
    side = _vllm_side(raw)
    if not side.active:
        raise TransferError("start_weight_update must be called before update_weights.")
    try:
        await side.receive(update_info.names, update_info.dtype_names, update_info.shapes)
    except TransferError:
        side.active = False  # the worker resets the session on a failed chunk
        raise
    return {"message": "Weights updated"}


@vllm_router.post("/finish_weight_update")
async def finish_weight_update(
    raw: Request, weight_version: Annotated[str | None, Body(embed=True)] = None
) -> dict[str, str]:
    side = _vllm_side(raw)
    if not side.active:
        raise TransferError("finish_weight_update called without a matching start_weight_update.")
    side.finish()
    if weight_version is not None:
        side.engine.set_version(weight_version)
    return {"message": "Weight update finished"}


@vllm_router.get("/get_world_size")
async def get_world_size(raw: Request, include_dp: bool = True) -> dict[str, int]:
    """One simulated worker per data-parallel rank (no tensor or pipeline parallelism)."""
    return {"world_size": len(_side(raw).engine.ranks) if include_dp else 1}


# -- SGLang -------------------------------------------------------------------------------------------------------


_BRACKET = "must run between begin_weight_update() and end_weight_update()"


def _answer(success: bool, message: str) -> Response:
    return json_response({"success": success, "message": message}, 200 if success else 400)


class InitGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_name: str = "weight_update_group"


class _Update(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class FromDistributed(_Update):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class FromTensor(_Update):
    serialized_named_tensors: list[str]


class Begin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    selector: Literal["target", "draft", "all"] = "all"


@sglang_router.post("/init_weights_update_group")
async def init_weights_update_group(raw: Request, body: InitGroup) -> Response:
    try:
        await _side(raw).init_group(body.master_address, body.master_port, body.rank_offset, body.world_size)
    except TransferError as exc:
        return _answer(False, f"Failed to initialize custom process group: {exc}.")
    return _answer(True, "Succeeded to initialize custom process group.")


@sglang_router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(raw: Request, body: DestroyGroup) -> Response:
    try:
        await _side(raw).destroy_group()
    except TransferError as exc:
        return _answer(False, f"Failed to destroy group {body.group_name!r}: {exc}")
    return _answer(True, "Succeeded to destroy custom process group.")


@sglang_router.post("/begin_weight_update")
async def begin_weight_update(raw: Request, body: Begin) -> Response:
    side = _side(raw)
    if side.active:
        return _answer(False, "a weight-update session is already open; call end_weight_update() first")
    side.start()
    return _answer(True, "Success")


@sglang_router.post("/end_weight_update")
async def end_weight_update(raw: Request) -> Response:
    side = _side(raw)
    if not side.active:
        return _answer(False, "no weight-update session is open; call begin_weight_update() first")
    side.finish()
    return _answer(True, "Success")


def _after_update(raw: Request, side: TransferSide, body: _Update) -> Response:
    if body.weight_version is not None:
        side.engine.set_version(body.weight_version)
        raw.app.state.dialect.reported_version = body.weight_version
    if body.flush_cache and not side.engine.flush_cache():
        return _answer(False, "Failed to flush cache after weight update.")
    return _answer(True, "Succeeded to update parameter online.")


@sglang_router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(raw: Request, body: FromDistributed) -> Response:
    side = _side(raw)
    if not side.active:
        return _answer(False, f"update_weights_from_distributed {_BRACKET}")
    try:
        if body.abort_all_requests:
            side.engine.abort_all()
        await side.receive(body.names, body.dtypes, body.shapes)
    except TransferError as exc:
        return _answer(False, f"Failed to receive weights: {exc}")
    return _after_update(raw, side, body)


@sglang_router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(raw: Request, body: FromTensor) -> Response:
    side = _side(raw)
    if not side.active:
        return _answer(False, f"update_weights_from_tensor {_BRACKET}")
    try:
        identity = decode_inline(body.serialized_named_tensors)
    except TransferError as exc:
        return _answer(False, str(exc))
    if body.abort_all_requests:
        side.engine.abort_all()
    if identity is not None:
        side.apply(identity)
    return _after_update(raw, side, body)
