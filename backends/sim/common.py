"""Pieces both simulator dialects share: server settings, faults, the control routes, text, SSE, disconnects."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.sim.engine import EngineSettings, SimEngine
from backends.sim.transfer import TransferSide
from common.asgi import ClientDisconnected, disconnected_response, unless_disconnected, watch_disconnect

Dialect = Literal["vllm", "sglang"]

__all__ = ["unless_disconnected", "watch_disconnect"]  # re-exported for the dialects

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/generate"})
PAUSE_PATHS = frozenset({"/pause", "/pause_generation"})  # vLLM's and SGLang's
LOAD_PATHS = frozenset({"/collective_rpc", "/update_weights_from_disk"})  # vLLM's (reload_weights) and SGLang's


@dataclass(frozen=True, slots=True)
class SimServerSettings:
    """Everything one simulated replica is started with."""

    dialect: Dialect = "vllm"
    engine: EngineSettings = field(default_factory=EngineSettings)
    dev_mode: bool = True
    enable_scale_out: bool = False
    enable_prompt_tokens_details: bool = False
    # The vLLM release the dialect imitates: 0.32 (observed on CPU) has no `return_weight_versions` on
    # /v1/completions (spans only on /inference/v1/generate); 0.33 (read from source) has it.
    vllm_version: str = "0.33.0"
    incremental_streaming_output: bool = False
    tokenizer_path: str | None = None
    startup_delay_s: float = 0.0
    error_rate: float = 0.0
    fault_seed: int = 0
    allow_crash: bool = False
    # A weight load from a path that is not on disk fails as on a real engine (vLLM answers 500, SGLang 400 and
    # rolls back), keeping the weights and the label. Off by default: tests and the demo load made-up paths.
    weights_must_exist: bool = False
    # vLLM: the backend of `--weight-transfer-config` (None: none, and every transfer route is refused).
    weight_transfer: str | None = None
    # How long an engine's side of a transfer waits for the trainer to join its rendezvous, seconds.
    transfer_join_timeout_s: float = 30.0


class FaultState:
    """Faults switched at start or at run time through `POST /sim/faults`."""

    def __init__(self, settings: SimServerSettings, engine: SimEngine) -> None:
        self.engine = engine
        self.error_rate = settings.error_rate
        self.allow_crash = settings.allow_crash
        self.ready_at = time.monotonic() + settings.startup_delay_s
        self.rng = random.Random(settings.fault_seed)
        self.weights_must_exist = settings.weights_must_exist
        self.hang = False
        self.pause_delay_s = 0.0  # a pause answered this late (an engine finishing its step on a busy host)
        self.load_delay_s = 0.0  # a weight load begun this late (a large checkpoint on a slow disk)
        self._unhung = asyncio.Event()
        self._unhung.set()

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def set_hang(self, hang: bool) -> None:
        self.hang = hang
        if hang:
            self._unhung.clear()
        else:
            self._unhung.set()
        self.engine.set_stalled(hang)

    async def wait_unhung(self) -> None:
        await self._unhung.wait()

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self.rng.random() < self.error_rate

    def apply(self, update: FaultsUpdate) -> None:
        """Switch the faults `update` names (crash and abort_all are actions, taken by the route)."""
        if update.hang is not None:
            self.set_hang(update.hang)
        if update.stall is not None:
            self.engine.set_stalled(update.stall)
        if update.error_rate is not None:
            self.error_rate = update.error_rate
        if update.ready is not None:
            self.ready_at = 0.0 if update.ready else float("inf")
        if update.weights_must_exist is not None:
            self.weights_must_exist = update.weights_must_exist
        if update.pause_delay is not None:
            self.pause_delay_s = update.pause_delay
        if update.load_delay is not None:
            self.load_delay_s = update.load_delay

    def load_fails(self, path: str) -> bool:
        """Whether a weight load from `path` must fail (`weights_must_exist` and nothing there)."""
        return self.weights_must_exist and not Path(path).exists()


class FaultMiddleware:
    """Applies slow start, hang and error-rate faults before the dialect sees a request (ASGI middleware)."""

    def __init__(self, app: ASGIApp, faults: FaultState, error_body: Callable[[str, int], bytes]) -> None:
        self.app = app
        self.faults = faults
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith("/sim/"):
            await self.app(scope, receive, send)
            return
        if not self.faults.ready:
            await _send_json(send, 503, self.error_body("server is starting", 503))
            return
        if self.faults.hang:
            await self.faults.wait_unhung()  # accept, never answer (until the fault is cleared)
        if path in PAUSE_PATHS and self.faults.pause_delay_s:
            await asyncio.sleep(self.faults.pause_delay_s)
        if path in LOAD_PATHS and self.faults.load_delay_s:
            await asyncio.sleep(self.faults.load_delay_s)
        if path in GENERATION_PATHS and self.faults.should_fail():
            await _send_json(send, 500, self.error_body("injected fault: internal server error", 500))
            return
        await self.app(scope, receive, send)


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class FaultsUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    crash: bool = False
    hang: bool | None = None  # accept requests, answer none (/health included)
    stall: bool | None = None  # decode nothing; every route still answers (a wedged scheduler behind a live server)
    error_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    abort_all: bool = False
    ready: bool | None = None
    pause_delay: float | None = Field(default=None, ge=0.0)
    load_delay: float | None = Field(default=None, ge=0.0)
    weights_must_exist: bool | None = None


class SpeedUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_delay: float | None = Field(default=None, ge=0.0)
    prefill_delay: float | None = Field(default=None, ge=0.0)


class PromptLogUpdate(BaseModel):
    """Start (head > 0) or stop (head = 0) recording submitted prompts; either way the log is emptied."""

    model_config = ConfigDict(extra="forbid")

    head: int = Field(ge=0, le=64)


class ScriptRequest(BaseModel):
    """A scripted reply: prompts ending in `prompt_suffix` get `output`, then EOS."""

    model_config = ConfigDict(extra="forbid")

    prompt_suffix: list[int] = Field(min_length=1)
    output: list[int] = Field(min_length=1)


def control_router(engine: SimEngine, faults: FaultState) -> APIRouter:
    """`/sim/*`: the simulator's own control surface (not part of any real engine's API)."""
    router = APIRouter(prefix="/sim")

    @router.get("/state")
    async def state() -> dict[str, Any]:
        return {
            "weights": engine.weights,
            "version": engine.version,
            "paused": engine.paused,
            "pause_mode": engine.pause_mode,
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "held": engine.held,
            "admission_closed": engine.admission_closed,
            "hang": faults.hang,
            "error_rate": faults.error_rate,
            "pause_delay": faults.pause_delay_s,
            "load_delay": faults.load_delay_s,
            "ready": faults.ready,
            "weights_must_exist": faults.weights_must_exist,
            "counters": dict(engine.total_counters()),
            "ranks": [
                {
                    "running": rank.num_running,
                    "waiting": rank.num_waiting,
                    "kv_usage": rank.kv_usage(),
                    "busy_s": rank.busy_s,
                    "counters": dict(rank.counters),
                }
                for rank in engine.ranks
            ],
        }

    @router.post("/faults")
    async def set_faults(update: FaultsUpdate) -> Response:
        if update.crash and not faults.allow_crash:
            return json_response({"error": "crash needs a replica running in its own process"}, 409)
        faults.apply(update)
        aborted = engine.abort_all("injected fault: abort everything") if update.abort_all else 0
        if update.crash:
            # Answer first, then die like a crashed engine: the process exits and its connections reset.
            return json_response({"status": "crashing"}, 200, background=BackgroundTask(os._exit, 1))
        return json_response({"status": "ok", "aborted": aborted})

    @router.post("/speed")
    async def set_speed(update: SpeedUpdate) -> dict[str, float]:
        engine.set_speed(update.token_delay, update.prefill_delay)
        return {
            "token_delay": engine.settings.token_delay_s,
            "prefill_delay": engine.settings.prefill_delay_s_per_token,
        }

    @router.post("/prompt_log")
    async def set_prompt_log(update: PromptLogUpdate) -> dict[str, int]:
        engine.prompt_log_head = update.head
        engine.prompt_log = []
        return {"head": update.head}

    @router.get("/prompt_log")
    async def prompt_log() -> dict[str, Any]:
        """Each recorded request as [first `head` prompt tokens, prompt length, monotonic time], in arrival order."""
        return {"head": engine.prompt_log_head, "requests": [[list(h), n, t] for h, n, t in engine.prompt_log]}

    @router.get("/sampling_log")
    async def sampling_log() -> dict[str, Any]:
        """The sampling fields of the latest requests, as received, oldest first (`SimEngine.sampling_log`)."""
        return {"requests": list(engine.sampling_log)}

    @router.post("/script")
    async def script(body: ScriptRequest) -> dict[str, str]:
        engine.add_script(body.prompt_suffix, body.output)
        return {"status": "ok"}

    @router.post("/reset")
    async def reset() -> dict[str, str]:
        faults.set_hang(False)
        faults.error_rate = 0.0
        faults.pause_delay_s = 0.0
        faults.ready_at = 0.0
        faults.weights_must_exist = False
        engine.reset()
        return {"status": "ok"}

    return router


class TextDecoder:
    """Token text for the dialects' `text` fields; empty strings when no tokenizer is configured."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self._tokenizer: Any = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            path = Path(tokenizer_path)
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer is None or not ids:
            return ""
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def encode(self, text: str) -> list[int] | None:
        if self._tokenizer is None:
            return None
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def faults_of(raw: Request) -> FaultState:
    """The replica's `FaultState` (for the routes that apply a fault themselves, like a failing weight load)."""
    faults: FaultState = raw.app.state.faults
    return faults


def json_response(content: Any, status_code: int = 200, background: BackgroundTask | None = None) -> Response:
    return Response(
        orjson.dumps(content), status_code=status_code, media_type="application/json", background=background
    )


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def count_transport(engine: SimEngine, stream: bool) -> None:
    """Count a generation request by how it is answered (`counters` of `GET /sim/state`: `requests_streamed`,
    `requests_whole`), so that tests see which transport a client chose."""
    engine.counters["requests_streamed" if stream else "requests_whole"] += 1


def build_app(
    title: str,
    settings: SimServerSettings,
    engine: SimEngine,
    dialect: object,
    metrics: object,
    error_body: Callable[[str, int], bytes],
    routers: list[APIRouter],
) -> FastAPI:
    """Assemble one simulated replica: engine lifespan, dialect state, metrics, routers, control routes, faults.

    Dialects register their own exception handlers on the returned app."""

    transfer = TransferSide(engine, settings.transfer_join_timeout_s)  # the weight-transfer routes' state

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await transfer.aclose()
            await engine.stop()

    app = FastAPI(lifespan=lifespan, title=title)
    app.state.transfer = transfer
    faults = FaultState(settings, engine)
    app.state.dialect = dialect
    app.state.faults = faults
    app.state.registry = CollectorRegistry(auto_describe=True)
    app.state.registry.register(metrics)
    for router in routers:
        app.include_router(router)
    app.include_router(control_router(engine, faults))
    app.add_exception_handler(ClientDisconnected, disconnected_response)
    app.add_middleware(FaultMiddleware, faults=faults, error_body=error_body)
    return app
