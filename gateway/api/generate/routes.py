"""`POST /generate`: token-in/token-out over the resume loop (docs/architecture.md §12), for trainer-side agent loops.

Without `session_id` a request is a one-shot: nothing is recorded (no session, nothing in Redis, no Redis round
trip), which keeps the route as lean as the engines' own (benchmarks, evaluation, a caller that records itself).

With `session_id` it is a turn of that session, prepared, relayed and recorded as every protocol's turn
(`gateway.api.turn_http.serve_turn`, with a checked `TokenPrompt`): the session is created on first use (a finished
one is a 409), and `input_ids` are the prompt as the caller gives them (token-in/token-out: the caller owns the ids).
Where they extend one of the session's samples (its prompt + response ids, then more), the turn continues that sample
with the extension as an environment span (loss mask 0); else a new sample starts in the session. The sampled tokens
get loss mask 1, their logprobs and versions. The response adds `sample_index` and `new_sample`. The turn is stored
before the response (or a stream's last event), so a `POST /v1/sessions/{id}/finish` right after it delivers the
trajectory with this turn.
`metadata` (str → str) goes to the session as on the OpenAI routes (`gateway.turns.runner`); without a session it
is a 400.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from backends.base import SamplingParams
from backends.routed_experts import ExpertArray, encode_npy_b64
from common.asgi import ClientDisconnected, relay_until_disconnected, unless_disconnected
from common.errors import GatewayError
from gateway.api.bounds import Budget, Count, IntegralItems, Seed, TopK, TopLogprobs
from gateway.api.context import ApiServices
from gateway.api.deps import ServicesDep, agent_key, pool_for, require_agent
from gateway.api.errors import stream_error
from gateway.api.json_answer import json_answer
from gateway.api.openai.models import TextMetadata
from gateway.api.sampling import GENERATE_FIELDS, governed_sampling
from gateway.api.streaming import DISCONNECT_WATCH_AFTER_S, GuardedStreamingResponse, LastChunk
from gateway.api.turn_http import TurnAnswer, serve_turn
from gateway.errors import InvalidRequest
from gateway.generation import GenerationRequest, GenerationState
from gateway.request_ids import new_request_id
from gateway.session.identity import SESSION_ID_PATTERN
from gateway.tokenization import make_stop_checker
from gateway.tokenization.token_ids import TokenId, first_outside
from gateway.turns.prepared import PreparedTurn
from gateway.turns.request import Sampling, TokenPrompt, TurnRequest


class GenerateSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: Budget = Field(description="Budget of the whole completion, across resumes.")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TopK | None = None
    seed: Seed | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024), IntegralItems()] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: Count = 0
    top_logprobs: TopLogprobs = 0
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="The pool's model (`pools:`); required where there are several.")
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    input_ids: Annotated[list[TokenId], Field(min_length=1), IntegralItems()]
    sampling_params: GenerateSampling
    stream: bool = False
    return_routed_experts: bool = False
    metadata: TextMetadata | None = Field(None, description="The session's metadata (needs `session_id`).")


def _validate(body: GenerateBody, sampling: Sampling, vocab_size: int, max_model_len: int) -> None:
    """The ids within the vocabulary, the budget (`sampling`'s: as the policy has it) within the context."""
    if body.metadata is not None and body.session_id is None:
        raise InvalidRequest("metadata goes to a session: name one with session_id", param="metadata")
    bad = first_outside(body.input_ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(
            f"input_ids[{bad}] = {body.input_ids[bad]} is outside the vocabulary (size {vocab_size})",
            param="input_ids",
        )
    stop_ids = list(sampling.stop_token_ids)
    bad = first_outside(stop_ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(
            f"stop token id {stop_ids[bad]} is outside the vocabulary", param="sampling_params.stop_token_ids"
        )
    budget = sampling.max_tokens or 0  # always set: the body requires it
    total = len(body.input_ids) + budget
    if total > max_model_len:
        raise InvalidRequest(
            f"{len(body.input_ids)} input tokens + max_tokens {budget} = {total} "
            f"exceeds the context length {max_model_len}",
            param="sampling_params.max_tokens",
        )


def _sampling(body: GenerateBody) -> Sampling:
    """What the body asks to sample with (before the caller's policy, `governed_sampling`)."""
    s = body.sampling_params
    return Sampling(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        top_logprobs=s.top_logprobs,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )


def _request(body: GenerateBody, s: Sampling, svc: ApiServices) -> GenerationRequest:
    """A one-shot's generation (stop strings only where a policy pins them: the body has none)."""
    sampling = SamplingParams(
        max_tokens=s.max_tokens or 0,  # always set: the body requires it
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        top_logprobs=s.top_logprobs,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )
    return GenerationRequest(
        request_id=new_request_id("gen"),
        prompt_ids=body.input_ids,  # pydantic made the list for this request; nothing changes it
        sampling=sampling,
        session_id=body.session_id,
        want_routed_experts=body.return_routed_experts,
        stop=make_stop_checker(svc.turns.tokenizer, s.stop),
        stop_strings=s.stop,
        stream=body.stream,
    )


def _nothing() -> None:
    """What a disconnect needs besides the cancellation of the request: nothing (the generation aborts its engine
    request when cancelled)."""


def _final(state: GenerationState, body: GenerateBody) -> dict[str, Any]:
    out: dict[str, Any] = {
        "session_id": body.session_id,
        "request_id": state.request.request_id,
        "finish_reason": state.finish_reason,
        "versions": state.versions,
        "num_resumes": state.num_resumes,
        "replicas": state.replica_ids,
    }
    if body.return_routed_experts:
        experts = _all_experts(state)
        out["routed_experts"] = encode_npy_b64(experts) if experts is not None else None
    return out


def _all_experts(state: GenerationState) -> ExpertArray | None:
    """The routed experts of every position of `input_ids + output_ids` but the last. A turn that continues a
    session's sample fetched only its new positions' (`GenerationRequest.experts_start`): the sample's come first."""
    experts = state.routed_experts if state.routed_experts_complete else None
    earlier = state.request.routed_experts
    if experts is None or earlier is None or state.routed_experts_start == 0:
        return experts
    return np.concatenate([earlier, experts.astype(earlier.dtype)])


def _in_session(prepared: PreparedTurn) -> dict[str, Any]:
    turn = prepared.choices[0].turn
    return {"sample_index": turn.stored_index, "new_sample": turn.new_sample}


def create_router(route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The router of `POST /generate`, made per app so that `create_app` chooses its route class."""
    router = APIRouter(tags=["generate"], dependencies=[Depends(require_agent)], route_class=route_class)
    router.add_api_route("/generate", generate, methods=["POST"])
    return router


async def generate(body: GenerateBody, raw: Request, svc: ServicesDep) -> Response:
    """Token-in/token-out. Without `session_id`, a one-shot that records nothing; with it, a recorded turn of that
    session (see the module docstring)."""
    svc = pool_for(svc, raw, body.model)
    fields = GENERATE_FIELDS
    sampling = governed_sampling(
        raw, svc.settings, _sampling(body), body.sampling_params, fields, "max_tokens", "sampling_params."
    )
    _validate(body, sampling, svc.vocab.vocab_size, svc.settings.model.max_model_len)
    if body.session_id is not None:
        return await _session_turn(body, sampling, body.session_id, raw, svc)
    request = _request(body, sampling, svc)
    lease = svc.quota.acquire(agent_key(raw), body.session_id)
    if body.stream:
        chunks = _stream(raw, svc.generator.stream, request, body)

        async def release() -> None:
            lease.release()

        return GuardedStreamingResponse(chunks, release, media_type="text/event-stream")
    state = GenerationState(request)
    try:
        await unless_disconnected(raw, svc.generator.complete(request, state), _nothing, DISCONNECT_WATCH_AFTER_S)
    finally:
        lease.release()
    result = _final(state, body)
    result["output_ids"] = state.output_ids
    result["logprobs"] = state.logprobs
    return json_answer(result)


async def _stream(raw: Request, stream: Any, request: GenerationRequest, body: GenerateBody) -> AsyncIterator[bytes]:
    state = GenerationState(request)
    try:
        relayed = relay_until_disconnected(raw, stream(request, state), DISCONNECT_WATCH_AFTER_S)
        async with contextlib.aclosing(relayed):
            async for delta in relayed:
                yield b"data: " + orjson.dumps({"output_ids": delta.token_ids, "logprobs": delta.logprobs}) + b"\n\n"
    except ClientDisconnected:
        raise
    except Exception as exc:  # the answer started (200): the error can only be an event
        yield _error_event(stream_error(exc))
        return
    if state.finish_reason is not None:  # the summary and [DONE] in one write, with the body's end
        yield LastChunk(b"data: " + orjson.dumps(_final(state, body)) + b"\n\ndata: [DONE]\n\n")


# -- a turn of a session -------------------------------------------------------------------------------------


async def _session_turn(
    body: GenerateBody, sampling: Sampling, session_id: str, raw: Request, svc: ApiServices
) -> Response:
    request = TurnRequest(
        TokenPrompt(body.input_ids, checked=True),  # checked by `_validate`: taken as they are
        sampling,
        stream=body.stream,
        metadata=body.metadata,
        want_routed_experts=body.return_routed_experts,
    )
    return await serve_turn(raw, svc.turns, request, session_id, partial(_session_answer, svc, body))


def _session_answer(svc: ApiServices, body: GenerateBody, prepared: PreparedTurn) -> TurnAnswer:
    """How a turn of a session is answered: as a one-shot is, with `sample_index` and `new_sample`; streamed, the
    summary and `[DONE]` are the last event, sent once the turn is recorded."""
    choice = prepared.choices[0]

    async def whole() -> Response:
        result = _final(choice.state, body) | _in_session(prepared)
        result["output_ids"] = choice.state.output_ids
        result["logprobs"] = choice.state.logprobs
        return json_answer(result)

    async def chunks() -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(svc.generator.stream(choice.request, choice.state)) as stream:
            async for delta in stream:
                yield b"data: " + orjson.dumps({"output_ids": delta.token_ids, "logprobs": delta.logprobs}) + b"\n\n"

    async def last() -> bytes:
        if choice.state.finish_reason is None:
            return b""
        final = _final(choice.state, body) | _in_session(prepared)
        return b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n"

    return TurnAnswer(whole, chunks, last, _error_event)


def _error_event(exc: GatewayError) -> bytes:
    error = {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.status_code}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n"
