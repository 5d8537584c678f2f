"""LoRA adapters on the simulated engine, loaded and unloaded by name at run time as the real engines do (vLLM
`POST /v1/load_lora_adapter` with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, SGLang `POST /load_lora_adapter`), named per
request (vLLM's `model`, SGLang's `lora_path`) and listed by `GET /v1/models` with their `parent`.

An adapter changes what the engine samples: its key (from its path, `adapter_key`) is mixed into the weights' key
of every token a request under it samples, and it partitions the prefix cache, since the real engines key cached
blocks by adapter. On with `EngineSettings.max_loras` > 0 (vLLM `--enable-lora --max-loras`, SGLang
`--enable-lora --max-loras-per-batch`); then a request naming a model that is neither the engine's nor a loaded
adapter's is refused, as vLLM refuses it (404). Any number may be loaded, as on vLLM (which keeps the ones beyond its
`--max-loras` batch slots in host memory and swaps them in); the simulator models no slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from common.hashing import mix64, string_key

__all__ = ["AdapterError", "Adapters", "adapter_key", "install_adapter_routes"]


def adapter_key(path: str) -> int:
    """What an adapter loaded from `path` mixes into the weights' key (never 0: 0 is "no adapter")."""
    return mix64(string_key(f"lora:{path}")) or 1


class AdapterError(ValueError):
    """A refused adapter call or request; `status` is what the engine answers."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Adapters:
    """The adapters one engine holds: name → path."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.loaded: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def load(self, name: str, path: str) -> None:
        if name in self.loaded:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.", 400)
        self.loaded[name] = path

    def unload(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)

    def key(self, name: str | None) -> int:
        """The sampling key of a request under adapter `name` (None: the base model, 0)."""
        if name is None:
            return 0
        path = self.loaded.get(name)
        if path is None:
            raise AdapterError(f"The model `{name}` does not exist.", 404)
        return adapter_key(path)

    def of_model(self, model: str | None, base: str) -> str | None:
        """vLLM: the adapter a request's `model` names (None: the base model). With adapters off, any name is the
        base model (the simulator does not check it); with them on, an unknown one is refused."""
        if not self.enabled or model is None or model == base:
            return None
        if model not in self.loaded:
            raise AdapterError(f"The model `{model}` does not exist.", 404)
        return model

    def cards(self, base: str, owner: str = "vllm") -> list[dict[str, Any]]:
        """`GET /v1/models` entries of the loaded adapters."""
        return [
            {"id": name, "object": "model", "owned_by": owner, "root": path, "parent": base}
            for name, path in self.loaded.items()
        ]


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


def _adapters(raw: Request) -> Adapters:
    adapters: Adapters = raw.app.state.dialect.engine.adapters
    return adapters


def _vllm_error(exc: AdapterError) -> Response:
    kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
    return JSONResponse({"error": {"message": str(exc), "type": kind, "param": None, "code": exc.status}}, exc.status)


vllm_router = APIRouter()
sglang_router = APIRouter()


@vllm_router.post("/v1/load_lora_adapter")
async def vllm_load(body: LoadAdapter, raw: Request) -> Response:
    try:
        _adapters(raw).load(body.lora_name, body.lora_path)
    except AdapterError as exc:
        return _vllm_error(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@vllm_router.post("/v1/unload_lora_adapter")
async def vllm_unload(body: UnloadAdapter, raw: Request) -> Response:
    try:
        _adapters(raw).unload(body.lora_name)
    except AdapterError as exc:
        return _vllm_error(exc)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _sglang_update(raw: Request, call: Any) -> Response:
    adapters = _adapters(raw)
    try:
        call(adapters)
    except AdapterError as exc:
        return JSONResponse({"success": False, "error_message": str(exc), "loaded_adapters": None}, 400)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": dict(adapters.loaded)})


sglang_models_router = APIRouter()


@sglang_models_router.get("/v1/models")
async def sglang_models(raw: Request) -> dict[str, Any]:
    """SGLang's model list: the served model, then each loaded adapter with its `parent`."""
    engine = raw.app.state.dialect.engine
    name = engine.settings.model_name
    base = {"id": name, "object": "model", "owned_by": "sglang", "root": name, "parent": None}
    return {"object": "list", "data": [base, *engine.adapters.cards(name, owner="sglang")]}


@sglang_router.post("/load_lora_adapter")
async def sglang_load(body: LoadAdapter, raw: Request) -> Response:
    return await _sglang_update(raw, lambda adapters: adapters.load(body.lora_name, body.lora_path))


@sglang_router.post("/unload_lora_adapter")
async def sglang_unload(body: UnloadAdapter, raw: Request) -> Response:
    return await _sglang_update(raw, lambda adapters: adapters.unload(body.lora_name))


def install_adapter_routes(app: Any, dialect: str, max_loras: int, error: Callable[[str, int], Response]) -> None:
    """The dialect's adapter routes, where the engine runs with adapters (as the real ones mount them), and its
    answer to a request under an adapter it does not hold (`error`: the dialect's error response)."""
    if max_loras > 0:
        app.include_router(vllm_router if dialect == "vllm" else sglang_router)
    if dialect == "sglang":
        app.include_router(sglang_models_router)

    async def refused(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, AdapterError)
        return error(str(exc), exc.status if dialect == "vllm" else 400)

    app.add_exception_handler(AdapterError, refused)
