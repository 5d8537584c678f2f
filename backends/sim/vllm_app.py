"""The vLLM dialect of the simulator: `/v1/completions`, `/inference/v1/generate` and the dev-mode RL routes.

Field names, encodings and status codes follow ../shared/contracts (vLLM 0.33 source, vLLM 0.32 observed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.base import version_tuple
from backends.routed_experts import decode_npy_b64, encode_npy_b64
from backends.sim.adapters import install_adapter_routes
from backends.sim.common import (
    SSE_DONE,
    SimServerSettings,
    TextDecoder,
    build_app,
    count_transport,
    faults_of,
    json_response,
    sse,
    unless_disconnected,
    watch_disconnect,
)
from backends.sim.engine import (
    SHUTDOWN_MESSAGE,
    EnginePaused,
    EngineStopped,
    PauseMode,
    SamplingSpec,
    SimEngine,
    SimRequest,
    SimRequestError,
)
from backends.sim.scoring import vllm_prompt_logprobs
from backends.sim.transfer_routes import install, vllm_errors, vllm_router
from backends.sim.vllm_metrics import VllmMetrics
from backends.sim.vllm_models import (
    AbortRequests,
    CollectiveRpc,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightVersion,
)

_ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int) -> bytes:
    import orjson

    return orjson.dumps(
        {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": None, "code": status}}
    )


def error_response(message: str, status: int) -> Response:
    return Response(error_body(message, status), status_code=status, media_type="application/json")


DP_RANK_HEADER = "X-data-parallel-rank"
"""The request header that pins a request to one data-parallel rank (vLLM's API server)."""

_SAMPLING = set(
    "max_tokens temperature top_p top_k seed stop_token_ids ignore_eos min_tokens logprobs min_p presence_penalty "
    "frequency_penalty".split()
)
"""The sampling fields of a request (`SimEngine.sampling_log`); a completion's `n` and `stop` too."""


def _spec(
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    ignore_eos: bool,
    stop_token_ids: list[int] | None,
    min_tokens: int,
    logprobs: int | None,
    default_max: int,
) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=default_max if max_tokens is None else max_tokens,
        temperature=1.0 if temperature is None else temperature,
        seed=seed,
        ignore_eos=ignore_eos,
        stop_token_ids=frozenset(stop_token_ids or ()),
        min_tokens=min_tokens,
        num_logprobs=None if logprobs is None else max(1, logprobs),
    )


class VllmDialect:
    """Request handling for the vLLM dialect, bound to one engine."""

    def __init__(self, settings: SimServerSettings, engine: SimEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.text = TextDecoder(settings.tokenizer_path)
        self.completion_spans = version_tuple(settings.vllm_version) >= (0, 33)

    # -- shared helpers ------------------------------------------------------------------------

    def _usage(self, request: SimRequest) -> dict[str, Any]:
        prompt, completion = len(request.prompt), len(request.output_ids)
        details = {"cached_tokens": request.cached_tokens} if self.settings.enable_prompt_tokens_details else None
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    def _experts_b64(self, request: SimRequest, start: int) -> str | None:
        if not self.settings.engine.routed_experts_output or not request.forward_wkeys:
            return None
        return encode_npy_b64(self.engine.routed_experts(request, start))

    def _replay(self, payload: str | None) -> Any:
        if payload is None or not self.settings.engine.routed_experts_input:
            return None  # vLLM ignores fields it does not know
        return decode_npy_b64(payload)

    async def _submit(
        self, raw: Request, engine_id: str, prompt: list[int], spec: SamplingSpec, replay: Any, body: Any
    ) -> Any:
        """Submit under the request's `model`: the engine's, or a LoRA adapter it holds (`backends.sim.adapters`)."""
        adapter = self.engine.adapters.of_model(body.model, self.settings.engine.model_name)
        return await unless_disconnected(
            raw,
            self.engine.submit(engine_id, prompt, spec, replay, body.cache_salt, self._dp_rank(raw), adapter),
            lambda: self.engine.abort(engine_id),
        )

    def _dp_rank(self, raw: Request) -> int | None:
        """The rank the `X-data-parallel-rank` header pins (vLLM ignores one that is not an integer)."""
        header = raw.headers.get(DP_RANK_HEADER)
        if header is None:
            return None
        try:
            rank = int(header)
        except ValueError:
            return None
        ranks = len(self.engine.ranks)
        if not 0 <= rank < ranks:
            raise SimRequestError(f"data_parallel_rank {rank} is out of range [0, {ranks}).")
        return rank

    async def _finished(self, raw: Request, request: SimRequest) -> None:
        async def wait() -> None:
            while not request.finished:
                request.updated.clear()
                await request.updated.wait()

        await unless_disconnected(
            raw, wait(), lambda: self.engine.abort(request.engine_id, "client disconnected", only=request)
        )

    async def _deltas(self, raw: Request, request: SimRequest) -> AsyncIterator[tuple[int, int, bool]]:
        """Yield (start, end, finished) over the output as it grows; aborts the request if the client leaves."""
        watcher = asyncio.create_task(
            watch_disconnect(raw, lambda: self.engine.abort(request.engine_id, "client disconnected", only=request))
        )
        sent = 0
        try:
            while True:
                done = request.finished
                if done and request.abort_message == SHUTDOWN_MESSAGE:
                    raise EngineStopped(request.engine_id)
                end = len(request.output_ids)
                if end > sent or done:
                    yield sent, end, done
                    sent = end
                if done:
                    return
                request.updated.clear()
                if len(request.output_ids) == end and not request.finished:
                    await request.updated.wait()
        finally:
            self.engine.abort(request.engine_id, "client disconnected", only=request)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    # -- /v1/completions -----------------------------------------------------------------------

    def _completion_logprobs(self, request: SimRequest, start: int, end: int, as_ids: bool) -> dict[str, Any]:
        def label(token: int) -> str:
            return f"token_id:{token}" if as_ids else self.text.decode([token])

        tokens = [label(t) for t in request.output_ids[start:end]]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": request.logprobs[start:end],
            "tokens": tokens,
            "top_logprobs": [{label(t): lp for t, lp in top} for top in request.top_logprobs[start:end]],
        }

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, str):
            ids = self.text.encode(prompt)
            if ids is None:
                raise SimRequestError("this simulator replica has no tokenizer: send token-id prompts")
            return ids
        if prompt and isinstance(prompt[0], list | str):
            raise SimRequestError("the simulator takes one prompt per request (no batched prompts)")
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        if body.n != 1:
            raise SimRequestError("the simulator supports n=1 only")
        prompt = self._completion_prompt(body)
        self.engine.sampling_log.append(body.model_dump(include=_SAMPLING | {"n", "stop"}))
        spec = _spec(
            body.max_tokens,
            body.temperature,
            body.seed,
            body.ignore_eos,
            body.stop_token_ids,
            body.min_tokens,
            body.logprobs,
            16,
        )
        base_id = raw.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex[:16]
        response_id = f"cmpl-{base_id}"
        replay = self._replay(body.replay_routed_experts)
        request = await self._submit(raw, f"{response_id}-0", prompt, spec, replay, body)
        count_transport(self.engine, body.stream)
        if body.stream:
            return StreamingResponse(
                self._completion_stream(body, raw, request, response_id), media_type="text/event-stream"
            )
        await self._finished(raw, request)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.text.decode(request.output_ids),
            "logprobs": None,
            "finish_reason": request.finish_reason,
            "stop_reason": request.stop_reason,
            "token_ids": list(request.output_ids) if body.return_token_ids else None,
            "prompt_logprobs": vllm_prompt_logprobs(
                self.engine, request.prompt, request.adapter_key, body.prompt_logprobs
            ),
            "prompt_token_ids": list(request.prompt) if body.return_token_ids else None,
            "routed_experts": self._experts_b64(request, body.routed_experts_prompt_start),
        }
        if body.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(
                request, 0, len(request.output_ids), bool(body.return_tokens_as_token_ids)
            )
        if body.return_weight_versions and self.completion_spans:
            choice["weight_versions"] = request.weight_version_spans()
        return json_response(
            {
                "id": response_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.engine.settings.model_name,
                "choices": [choice],
                "usage": self._usage(request),
                "system_fingerprint": "rollout-gateway-sim",
            }
        )

    async def _completion_stream(
        self, body: CompletionRequest, raw: Request, request: SimRequest, response_id: str
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.engine.settings.model_name
        first = True
        async for start, end, done in self._deltas(raw, request):
            choice: dict[str, Any] = {
                "index": 0,
                "text": self.text.decode(request.output_ids[start:end]),
                "logprobs": None,
                "finish_reason": request.finish_reason if done else None,
                "stop_reason": request.stop_reason if done else None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs(
                    request, start, end, bool(body.return_tokens_as_token_ids)
                )
            if body.return_token_ids:
                choice["prompt_token_ids"] = list(request.prompt) if first else None
                choice["token_ids"] = request.output_ids[start:end]
            if done and body.return_weight_versions and self.completion_spans:
                choice["weight_versions"] = request.weight_version_spans()
            first = False
            yield sse(
                {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
            )
        if body.stream_options and body.stream_options.include_usage:
            yield sse(
                {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(request),
                }
            )
        yield SSE_DONE

    # -- /inference/v1/generate ----------------------------------------------------------------

    def _generate_logprobs(self, request: SimRequest, start: int, end: int) -> dict[str, Any]:
        content = []
        for token, lp, top in zip(
            request.output_ids[start:end], request.logprobs[start:end], request.top_logprobs[start:end], strict=True
        ):
            content.append(
                {
                    "token_id": token,
                    "logprob": lp,
                    "rank": 1,
                    "top_logprobs": [{"token_id": t, "logprob": v, "rank": r + 1} for r, (t, v) in enumerate(top)],
                }
            )
        return {"content": content}

    async def generate(self, body: GenerateRequest, raw: Request) -> Response:
        if not self.settings.enable_scale_out:
            return error_response(
                "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.", 403
            )
        sp = body.sampling_params
        self.engine.sampling_log.append(sp.model_dump(include=_SAMPLING))
        spec = _spec(
            sp.max_tokens, sp.temperature, sp.seed, sp.ignore_eos, sp.stop_token_ids, sp.min_tokens, sp.logprobs, 16
        )
        engine_id = f"generate-tokens-{body.request_id or uuid.uuid4().hex[:16]}"
        replay = self._replay(body.replay_routed_experts)
        request = await self._submit(raw, engine_id, body.token_ids, spec, replay, body)
        count_transport(self.engine, body.stream)
        if body.stream:
            return StreamingResponse(self._generate_stream(body, raw, request), media_type="text/event-stream")
        await self._finished(raw, request)
        n = len(request.output_ids)
        return json_response(
            {
                "request_id": engine_id,
                "model": self.engine.settings.model_name,
                "usage": self._usage(request),
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": list(request.prompt) if body.return_token_ids else None,
                "mm_placeholders": None,
                "output_mode": body.output_mode,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": request.finish_reason,
                        "stop_reason": request.stop_reason,
                        "token_ids": list(request.output_ids),
                        "routed_experts": self._experts_b64(request, sp.routed_experts_prompt_start),
                        "sampling_mask": None,
                        "weight_versions": request.weight_version_spans(),
                        "logprobs": self._generate_logprobs(request, 0, n) if sp.logprobs is not None else None,
                    }
                ],
            }
        )

    async def _generate_stream(self, body: GenerateRequest, raw: Request, request: SimRequest) -> AsyncIterator[bytes]:
        logprobs = body.sampling_params.logprobs is not None
        start_experts = body.sampling_params.routed_experts_prompt_start
        async for start, end, done in self._deltas(raw, request):
            choice = {
                "index": 0,
                "finish_reason": request.finish_reason if done else None,
                "stop_reason": request.stop_reason if done else None,
                "token_ids": request.output_ids[start:end],
                "routed_experts": self._experts_b64(request, start_experts) if done else None,
                "weight_versions": request.weight_version_spans() if done else None,
                "logprobs": self._generate_logprobs(request, start, end) if logprobs else None,
            }
            yield sse(
                {"request_id": request.engine_id, "usage": None, "output_mode": body.output_mode, "choices": [choice]}
            )
        if body.stream_options and body.stream_options.include_usage:
            yield sse({"request_id": request.engine_id, "usage": self._usage(request), "choices": []})
        yield SSE_DONE


def _dialect(raw: Request) -> VllmDialect:
    dialect: VllmDialect = raw.app.state.dialect
    return dialect


def _engine(raw: Request) -> SimEngine:
    return _dialect(raw).engine


router = APIRouter()
dev_router = APIRouter()  # a real vLLM mounts these only with VLLM_SERVER_DEV_MODE=1 (otherwise 404)
scale_out_router = APIRouter()  # only with --enable-scale-out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await _dialect(raw).completions(body, raw)


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, raw: Request) -> Response:
    return await _dialect(raw).generate(body, raw)


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/version")
async def version(raw: Request) -> dict[str, str]:
    return {"version": f"{_dialect(raw).settings.vllm_version}+sim"}


@router.get("/load")
async def load(raw: Request) -> dict[str, int]:
    return {"server_load": len(_engine(raw).requests)}


@router.get("/v1/models")
async def models(raw: Request) -> dict[str, Any]:
    engine = _engine(raw)
    settings = engine.settings
    card = {"id": settings.model_name, "object": "model", "owned_by": "vllm", "root": settings.weights}
    base = {**card, "parent": None, "max_model_len": settings.max_model_len}
    return {"object": "list", "data": [base, *engine.adapters.cards(settings.model_name)]}


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(generate_latest(raw.app.state.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


@dev_router.post("/pause")
async def pause(raw: Request, mode: str = "abort", clear_cache: bool = True) -> Response:
    if mode not in ("abort", "wait", "keep"):
        return json_response({"error": f"Invalid mode {mode!r}; expected one of abort, wait, keep"}, 400)
    engine = _engine(raw)
    pause_mode: PauseMode = mode  # type: ignore[assignment]
    await engine.pause(pause_mode)
    if clear_cache:
        # vLLM 0.32 resets its caches as its docs say it does not for keep too: with `reset_running_requests`,
        # preempting the frozen requests (they recompute their KV on resume).
        engine.flush_cache(preempt_running=True)
    return json_response({"status": "paused"})


@dev_router.post("/resume")
async def resume(raw: Request) -> dict[str, str]:
    _engine(raw).resume()
    return {"status": "resumed"}


@dev_router.get("/is_paused")
async def is_paused(raw: Request) -> dict[str, bool]:
    return {"is_paused": _engine(raw).paused}


@dev_router.post("/abort_requests")
async def abort_requests(raw: Request, body: AbortRequests | None = None) -> dict[str, Any]:
    engine = _engine(raw)
    ids = body.request_ids if body else None
    if not ids:
        return {"status": "aborted", "aborted": engine.abort_all()}
    for engine_id in ids:
        engine.abort(engine_id)
    return {"status": "aborted", "aborted": len(ids)}  # like vLLM: the count is len(request_ids), matched or not


@scale_out_router.post("/inference/v1/abort_requests")
async def scale_out_abort(raw: Request, body: AbortRequests) -> Response:
    engine = _engine(raw)
    for engine_id in body.request_ids or []:
        engine.abort(engine_id)
    return Response(status_code=200)


@dev_router.post("/collective_rpc")
async def collective_rpc(raw: Request, body: CollectiveRpc) -> Response:
    engine = _engine(raw)
    if body.method != "reload_weights":
        return error_response(
            f"the simulator implements only collective_rpc 'reload_weights', not {body.method!r}", 400
        )
    path = body.call_kwargs.get("weights_path") or (body.args[0] if body.args else None)
    if path is not None and faults_of(raw).load_fails(str(path)):
        # vLLM's worker raises while it opens the checkpoint, before any weight changes; the RPC answers 500.
        return error_response(f"reload_weights failed: no checkpoint at {str(path)!r} (FileNotFoundError)", 500)
    engine.load_weights(str(path) if path is not None else f"{engine.weights}+reloaded")
    return json_response({"results": [None]})


@dev_router.post("/update_weight_version")
async def update_weight_version(raw: Request, body: UpdateWeightVersion) -> dict[str, Any]:
    engine = _engine(raw)
    engine.set_version(body.new_version)
    return {"status": "ok", "weight_version": engine.version}


@dev_router.get("/weight_info")
async def weight_info(raw: Request) -> dict[str, str]:
    return {"weight_version": _engine(raw).version}


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request, reset_running_requests: bool = False) -> dict[str, bool]:
    # Like vLLM: refused while running requests hold blocks, unless they are preempted (and recompute later).
    return {"success": _engine(raw).flush_cache(preempt_running=reset_running_requests)}


@dev_router.get("/is_sleeping")
async def is_sleeping() -> dict[str, bool]:
    return {"is_sleeping": False}


@dev_router.get("/server_info")
async def server_info(raw: Request) -> dict[str, Any]:
    engine = _engine(raw)
    return {"weight_version": engine.version, "model": engine.settings.model_name, "simulator": True}


async def _on_validation(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(str(exc.errors()), 400)


async def _on_bad_request(_: Request, exc: Exception) -> Response:
    return error_response(str(exc), 400)


async def _on_paused(_: Request, exc: Exception) -> Response:
    return error_response(str(exc), 503)


async def _on_http(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(str(exc.detail), exc.status_code)


def create_vllm_app(settings: SimServerSettings) -> FastAPI:
    """A FastAPI app that behaves like a vLLM OpenAI server (dev mode optional) over a `SimEngine`."""
    engine = SimEngine(settings.engine)
    routers = [router]
    if settings.dev_mode:
        routers.append(dev_router)
    if settings.enable_scale_out:
        routers.append(scale_out_router)
    app = build_app(
        "rollout-gateway simulator (vLLM dialect)",
        settings,
        engine,
        VllmDialect(settings, engine),
        VllmMetrics(engine),
        error_body,
        routers,
    )
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(SimRequestError, _on_bad_request)
    app.add_exception_handler(EnginePaused, _on_paused)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    if settings.dev_mode:
        install(app, vllm_router)
        vllm_errors(app, error_body, settings.weight_transfer)
    install_adapter_routes(app, "vllm", settings.engine.max_loras, error_response)
    return app
