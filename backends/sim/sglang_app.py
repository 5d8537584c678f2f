"""The SGLang dialect of the simulator: `/generate` and the native control routes of an SGLang 0.5.23 server.

Field names, encodings and status codes follow ../shared/contracts (SGLang 0.5.23 source, 0.5.23 observed on CPU):
a strict `/generate` schema, cumulative stream chunks, `finish_reason` objects, partial output on abort with HTTP
200, new requests that block while paused, weight updates that wait for in-flight requests (the writer lock) unless
the server is paused, and routed experts as base64 raw int32.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.routed_experts import ExpertArray, RoutedExpertsFormatError, decode_int32_b64, encode_int32_b64
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
from backends.sim.engine import SHUTDOWN_MESSAGE, EngineStopped, SamplingSpec, SimEngine, SimRequest, SimRequestError
from backends.sim.scoring import sglang_input_logprobs
from backends.sim.sglang_load import SglangMetrics, load_sections, loads_as_prometheus, rank_load
from backends.sim.sglang_models import (
    AbortReq,
    ContinueGenerationReqInput,
    ContractError,
    GenerateReqInput,
    GenerateReqInputWithReplay,
    PauseGenerationReqInput,
    SamplingParams,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
    check_known_fields,
    validation_message,
)
from backends.sim.transfer_routes import install, sglang_router

T = TypeVar("T")

SGLANG_VERSION = "0.5.23+sim"
_FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Call /flush_cache once they have finished."
)


def error_body(message: str, status: int) -> bytes:
    """SGLang's error shape (`_create_error_response`): `{"error": {"message": ...}}`; the status rides on HTTP."""
    del status  # SGLang puts the status on the response only
    return orjson.dumps({"error": {"message": message}})


def error_response(message: str, status: int) -> Response:
    return Response(error_body(message, status), status_code=status, media_type="application/json")


# -- the dialect ------------------------------------------------------------------------------------------------


class SglangDialect:
    """Request handling for the SGLang dialect, bound to one engine."""

    def __init__(self, settings: SimServerSettings, engine: SimEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.text = TextDecoder(settings.tokenizer_path)
        self.load_format = "auto"
        # The tokenizer manager's copy of the label (what /model_info reports). Observed on 0.5.23: after the
        # 400 "cache was not flushed" the scheduler runs the new version, but this copy keeps the old one
        # (it is only updated on success, or by /update_weight_version).
        self.reported_version = engine.version
        self.request_model: type[GenerateReqInput] = (
            GenerateReqInputWithReplay if settings.engine.routed_experts_input else GenerateReqInput
        )

    # -- /generate: parsing ----------------------------------------------------------------------------------

    async def _parse(self, raw: Request) -> GenerateReqInput:
        try:
            payload = orjson.loads(await raw.body())
        except orjson.JSONDecodeError as exc:
            raise ContractError(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise ContractError("the request body must be a JSON object")
        check_known_fields(payload, self.request_model)
        sampling = payload.get("sampling_params")
        if isinstance(sampling, dict):
            check_known_fields(sampling, SamplingParams, " in `sampling_params`")
        return self.request_model.model_validate(payload)

    def _prompt(self, body: GenerateReqInput) -> list[int]:
        text, ids = body.text, body.input_ids
        if ids is not None and text is None:
            if ids and isinstance(ids[0], list):
                raise ContractError("the simulator serves one prompt per request (no batched input_ids)")
            return [int(t) for t in ids]  # type: ignore[arg-type]  # the batch shape is rejected above
        if text is not None and ids is None:
            if not isinstance(text, str):
                raise ContractError("the simulator serves one prompt per request (no batched text)")
            encoded = self.text.encode(text)
            if encoded is None:
                raise ContractError("this replica has no tokenizer (skip_tokenizer_init): send input_ids")
            return encoded
        raise ContractError("Either text, input_ids or input_embeds should be provided.")

    def _spec(self, body: GenerateReqInput, prompt: list[int]) -> SamplingSpec:
        sp = body.sampling_params
        self.engine.sampling_log.append(sp.model_dump())
        if sp.n != 1:
            raise ContractError("the simulator supports n=1 only")
        if not 0 <= body.routed_experts_start_len <= len(prompt):
            raise ContractError(
                f"routed_experts_start_len must be in [0, {len(prompt)}] (the prompt length), "
                f"got {body.routed_experts_start_len}"
            )
        max_new = self.engine.settings.max_model_len - len(prompt) if sp.max_new_tokens is None else sp.max_new_tokens
        return SamplingSpec(
            max_tokens=max_new,
            temperature=sp.temperature,
            seed=sp.sampling_seed,
            ignore_eos=sp.ignore_eos,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            min_tokens=sp.min_new_tokens,
            num_logprobs=body.top_logprobs_num if body.return_logprob and body.top_logprobs_num > 0 else None,
        )

    def _replay(self, body: GenerateReqInput) -> ExpertArray | None:
        if not isinstance(body, GenerateReqInputWithReplay) or body.replay_routed_experts is None:
            return None
        shape = self.engine.settings.shape
        try:
            return decode_int32_b64(body.replay_routed_experts, shape.num_layers, shape.top_k)
        except RoutedExpertsFormatError as exc:
            raise ContractError(f"replay_routed_experts: {exc}") from exc

    def _dp_rank(self, body: GenerateReqInput) -> int | None:
        """The rank `routed_dp_rank` (or its deprecated alias `data_parallel_rank`) pins; rank 0 of a server without
        data parallelism is ignored, as SGLang does, and a rank it does not have is refused."""
        rank = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
        ranks = len(self.engine.ranks)
        if rank is None or (ranks == 1 and rank == 0):
            return None
        if not 0 <= rank < ranks:
            raise ContractError(f"routed_dp_rank={rank} out of range [0, {ranks})")
        return rank

    def _engine_id(self, body: GenerateReqInput) -> str:
        if isinstance(body.rid, list):
            raise ContractError("the simulator serves one request per call (rid must be a string)")
        return body.rid or uuid.uuid4().hex

    # -- /generate: responses --------------------------------------------------------------------------------

    def _finish_reason(self, request: SimRequest) -> dict[str, Any] | None:
        if request.finish_reason == "length":
            return {"type": "length", "length": len(request.output_ids)}
        if request.finish_reason == "stop":
            matched = request.stop_reason
            return {"type": "stop", "matched": self.engine.settings.shape.eos_token_id if matched is None else matched}
        if request.finish_reason == "abort":
            return {"type": "abort", "message": request.abort_message, "status_code": None, "err_type": None}
        return None

    def _logprobs(self, body: GenerateReqInput, request: SimRequest, start: int, end: int) -> dict[str, Any]:
        def entry(logprob: float, token: int) -> list[Any]:
            return [logprob, token, self.text.decode([token]) if body.return_text_in_logprobs else None]

        tokens = request.output_ids[start:end]
        out: dict[str, Any] = {
            "output_token_logprobs": [entry(lp, t) for lp, t in zip(request.logprobs[start:end], tokens, strict=True)],
            "output_token_logprobs_length": end,
        }
        if body.top_logprobs_num > 0:
            out["output_top_logprobs"] = [[entry(lp, t) for t, lp in top] for top in request.top_logprobs[start:end]]
        return out

    def _prefill_only(self, body: GenerateReqInput, prompt: list[int]) -> dict[str, Any]:
        """A request that generates nothing (`max_new_tokens: 0`): a teacher scoring `prompt` (`return_logprob`
        from `logprob_start_len`)."""
        meta: dict[str, Any] = {
            "id": self._engine_id(body),
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(prompt),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": self.engine.version,
        }
        if body.return_logprob:
            start = max(0, body.logprob_start_len)
            key = self.engine.adapters.key(body.lora_path)
            meta |= sglang_input_logprobs(self.engine, prompt, key, start, body.top_logprobs_num)
            meta |= {"output_token_logprobs": [], "output_token_logprobs_length": 0}
        return {"text": "", "output_ids": [], "meta_info": meta}

    def _routed_experts(self, body: GenerateReqInput, request: SimRequest) -> str | None:
        if not (body.return_routed_experts and self.settings.engine.routed_experts_output and request.forward_wkeys):
            return None
        return encode_int32_b64(self.engine.routed_experts(request, body.routed_experts_start_len))

    def _output(
        self, body: GenerateReqInput, request: SimRequest, started: float, span: tuple[int, int], final: bool
    ) -> dict[str, Any]:
        """One response (or stream chunk) over output tokens [start, end); `final` adds the end-of-request fields."""
        start, end = span
        meta: dict[str, Any] = {
            "id": request.engine_id,
            "finish_reason": self._finish_reason(request) if final else None,
            "prompt_tokens": len(request.prompt),
            "completion_tokens": end,
            "cached_tokens": request.cached_tokens,
            "reasoning_tokens": 0,
            # The version that sampled the newest token (SGLang: "the last version"), not the one loaded now.
            "weight_version": request.versions[end - 1] if end else self.engine.version,
            "num_retractions": request.num_retractions,
            "e2e_latency": time.monotonic() - started,
        }
        if body.return_logprob:
            meta.update(self._logprobs(body, request, start, end))
        if final:
            meta["weight_versions"] = request.weight_version_spans()
            experts = self._routed_experts(body, request)
            if experts is not None:
                meta["routed_experts"] = experts
        output = request.output_ids[start:end]
        out: dict[str, Any] = {"text": self.text.decode(output), "output_ids": output, "meta_info": meta}
        if body.return_prompt_token_ids:
            out["prompt_token_ids"] = list(request.prompt)
        return out

    # -- /generate: lifecycle --------------------------------------------------------------------------------

    def _abort_if_running(self, request: SimRequest, message: str) -> None:
        # Guarded by identity: after this request ends, a continuation may reuse its rid.
        if not request.finished and self.engine.requests.get(request.engine_id) is request:
            self.engine.abort(request.engine_id, message)

    async def generate(self, raw: Request) -> Response:
        started = time.monotonic()
        body = await self._parse(raw)
        prompt = self._prompt(body)
        if body.sampling_params.max_new_tokens == 0:
            return json_response(self._prefill_only(body, prompt))
        spec = self._spec(body, prompt)
        replay = self._replay(body)
        engine_id = self._engine_id(body)
        request = await unless_disconnected(
            raw,
            self.engine.submit(
                engine_id, prompt, spec, replay, _cache_partition(body), self._dp_rank(body), body.lora_path
            ),
            lambda: self.engine.abort(engine_id, "client disconnected"),
        )
        count_transport(self.engine, body.stream)
        if body.stream:
            return StreamingResponse(self._stream(body, raw, request, started), media_type="text/event-stream")
        await unless_disconnected(
            raw, self._wait_finished(request), lambda: self._abort_if_running(request, "client disconnected")
        )
        # Aborts come back as 200 with the partial output: SGLang only turns aborts with status_code >= 400
        # into HTTP errors, and the simulator's aborts (pause, abort_request, faults) carry none.
        return json_response(self._output(body, request, started, (0, len(request.output_ids)), True))

    @staticmethod
    async def _wait_finished(request: SimRequest) -> None:
        while not request.finished:
            request.updated.clear()
            await request.updated.wait()

    async def _progress(self, raw: Request, request: SimRequest) -> AsyncIterator[tuple[int, bool]]:
        """Yield (tokens so far, finished) as the output grows; the request is aborted if the client leaves."""
        watcher = asyncio.create_task(
            watch_disconnect(raw, lambda: self._abort_if_running(request, "client disconnected"))
        )
        sent = 0
        try:
            while True:
                done = request.finished
                if done and request.abort_message == SHUTDOWN_MESSAGE:
                    raise EngineStopped(request.engine_id)
                end = len(request.output_ids)
                if end > sent or done:
                    yield end, done
                    sent = end
                if done:
                    return
                request.updated.clear()
                if len(request.output_ids) == end and not request.finished:
                    await request.updated.wait()
        finally:
            self._abort_if_running(request, "client disconnected")
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _stream(
        self, body: GenerateReqInput, raw: Request, request: SimRequest, started: float
    ) -> AsyncIterator[bytes]:
        incremental = self.settings.incremental_streaming_output
        sent = 0
        async for end, done in self._progress(raw, request):
            yield sse(self._output(body, request, started, (sent if incremental else 0, end), done))
            sent = end
        yield SSE_DONE

    # -- weights ---------------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, body: UpdateWeightFromDiskReqInput, fails: bool = False) -> Response:
        """`fails`: the load fails (the `weights_must_exist` fault, on a path that is not there)."""
        engine = self.engine
        if body.abort_all_requests:
            engine.abort_all()
        if engine.paused:  # a paused server updates at once, without the writer lock
            return self._load(body, fails)
        await engine.drain()  # the writer lock: wait for in-flight requests, hold new ones
        try:
            return self._load(body, fails)
        finally:
            engine.release()

    def _load(self, body: UpdateWeightFromDiskReqInput, fails: bool) -> Response:
        engine = self.engine
        if fails:
            # SGLang's model runner: the weights iterator fails on the path before anything is loaded (a failure
            # later in the load rolls back to the original weights); the label is only changed on success.
            message = f"Failed to get weights iterator: no checkpoint at {body.model_path!r}."
            return json_response({"success": False, "message": message, "num_paused_requests": 0}, 400)
        engine.load_weights(body.model_path)
        if body.weight_version is not None:
            engine.set_version(body.weight_version)
        self.load_format = body.load_format or "auto"
        if body.flush_cache and not engine.flush_cache():
            # Observed on 0.5.23 after pause(in_place): weights and version switched, the radix cache kept.
            return json_response(
                {"success": False, "message": _FLUSH_REFUSED_AFTER_UPDATE, "num_paused_requests": 0}, 400
            )
        message = "Succeeded to update model weights."
        if body.weight_version is not None:
            self.reported_version = body.weight_version
            message += f" Weight version updated to {body.weight_version}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    # -- info ------------------------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "model_path": engine.weights,
            "tokenizer_path": self.settings.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.reported_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "served_model_name": engine.settings.model_name,
            "load_format": self.load_format,
        }

    def server_info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            **self.model_info(),
            "version": SGLANG_VERSION,
            "context_length": engine.settings.max_model_len,
            "page_size": engine.settings.block_size,
            "skip_tokenizer_init": self.settings.tokenizer_path is None,
            "enable_return_routed_experts": engine.settings.routed_experts_output,
            "incremental_streaming_output": self.settings.incremental_streaming_output,
            "internal_states": [
                {"dp_rank": rank.index, "num_running_reqs": rank.num_running, "num_waiting_reqs": rank.num_waiting}
                for rank in engine.ranks
            ],
            "dp_size": len(engine.ranks),
            "simulator": True,
        }

    def loads(self, dp_rank: int | None, include: str | None, prometheus: bool) -> Response:
        """`GET /v1/loads`: every rank's load, or only `dp_rank`'s (none for a rank the server does not have)."""
        sections = load_sections(include)
        ranks = self.engine.ranks
        if dp_rank is not None:
            ranks = [ranks[dp_rank]] if 0 <= dp_rank < len(ranks) else []
        loads = [rank_load(rank, sections) for rank in ranks]
        if prometheus:
            return Response(loads_as_prometheus(loads), media_type="text/plain; version=0.0.4; charset=utf-8")
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": loads,
            }
        )


def _dialect(raw: Request) -> SglangDialect:
    dialect: SglangDialect = raw.app.state.dialect
    return dialect


def _engine(raw: Request) -> SimEngine:
    return _dialect(raw).engine


router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(raw: Request) -> Response:
    # The body is parsed by the dialect, not FastAPI: which fields exist depends on the replica's settings.
    return await _dialect(raw).generate(raw)


@router.post("/abort_request")
async def abort_request(raw: Request, body: AbortReq) -> Response:
    engine = _engine(raw)
    if body.abort_all:
        engine.abort_all()
    elif body.rid:
        engine.abort(body.rid)
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(raw: Request, body: PauseGenerationReqInput | None = None) -> dict[str, str]:
    await _engine(raw).pause(body.mode if body else "abort")
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(raw: Request, body: ContinueGenerationReqInput | None = None) -> dict[str, str]:
    del body  # torch_empty_cache has nothing to free here
    _engine(raw).resume()
    return {"status": "ok"}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(raw: Request, body: UpdateWeightFromDiskReqInput) -> Response:
    return await _dialect(raw).update_weights_from_disk(body, faults_of(raw).load_fails(body.model_path))


@router.post("/update_weight_version")
async def update_weight_version(raw: Request, body: UpdateWeightVersionReqInput) -> dict[str, Any]:
    engine = _engine(raw)
    if body.abort_all_requests:
        engine.abort_all()
    engine.set_version(body.new_version)
    _dialect(raw).reported_version = body.new_version
    return {
        "success": True,
        "message": f"Weight version updated to {body.new_version}.",
        "new_version": body.new_version,
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(raw: Request) -> Response:
    flushed = _engine(raw).flush_cache()
    return Response(_FLUSH_MESSAGE, status_code=200 if flushed else 400, media_type="text/plain")


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(raw: Request) -> dict[str, Any]:
    return _dialect(raw).model_info()


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(raw: Request) -> dict[str, Any]:
    return _dialect(raw).server_info()


@router.get("/get_weight_version")
@router.get("/weight_version")
async def deprecated_weight_version() -> Response:
    return error_response("This endpoint is deprecated, use /model_info instead (it reports weight_version).", 404)


@router.get("/health")
@router.get("/health_generate")
async def health() -> Response:
    # /health_generate runs a 1-token generation on a real server; the simulated engine cannot fail one, so the
    # faults that matter (slow start, hang, error rate) are applied by FaultMiddleware before we get here.
    return Response(status_code=200)


@router.get("/ready")
async def ready(raw: Request) -> Response:
    return Response(status_code=503 if _engine(raw).paused else 200)


@router.get("/v1/loads")
async def loads(
    raw: Request, dp_rank: int | None = None, include: str | None = None, format: str | None = None
) -> Response:
    return _dialect(raw).loads(dp_rank, include, format == "prometheus")


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    """Gzipped where the client accepts gzip, as SGLang's (prometheus_client's ASGI app) answers."""
    body, headers = generate_latest(raw.app.state.registry), {}
    if "gzip" in raw.headers.get("accept-encoding", ""):
        body, headers = gzip.compress(body), {"content-encoding": "gzip"}
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8", headers=headers)


async def _on_validation(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(validation_message(exc.errors()), 400)


async def _on_bad_request(_: Request, exc: Exception) -> Response:
    return error_response(str(exc), 400)


async def _on_http(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(str(exc.detail), exc.status_code)


def create_sglang_app(settings: SimServerSettings) -> FastAPI:
    """A FastAPI app that behaves like an SGLang 0.5.23 server (`/generate` and native control routes)."""
    # SGLang always holds new requests while paused (`is_pause_cond.wait_for`); it never rejects them.
    # Unpinned requests go round robin over the ranks (SGLang's default `--load-balance-method`).
    engine_settings = dataclasses.replace(settings.engine, new_requests_while_paused="block", dp_balance="round_robin")
    engine = SimEngine(engine_settings)
    app = build_app(
        "rollout-gateway simulator (SGLang dialect)",
        settings,
        engine,
        SglangDialect(settings, engine),
        SglangMetrics(engine),
        error_body,
        [router],
    )
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(ValidationError, _on_validation)
    app.add_exception_handler(SimRequestError, _on_bad_request)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    install(app, sglang_router)
    install_adapter_routes(app, "sglang", settings.engine.max_loras, error_response)
    return app


def _cache_partition(body: GenerateReqInput) -> str | None:
    """The radix cache's partition of a request: SGLang keys prefixes by `extra_key` and `cache_salt` both."""
    if body.cache_salt is None:
        return body.extra_key
    return f"{body.extra_key or ''}\x00{body.cache_salt}"
