"""OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, and the same under a session
prefix, `/sessions/{session_id}/v1/...` (the session named by the path: `gateway.session.identity`).

Standard clients work unchanged; what only a rollout needs (session id, sample index, per-token versions,
resumes) travels under the vendor key `rollout`, which they ignore.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from common.errors import GatewayError
from gateway.api.deps import ServicesDep, pool_for, require_agent, session_in_path
from gateway.api.json_answer import json_answer
from gateway.api.limits import check_messages
from gateway.api.openai.models import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.turn import chat_request, completion_request
from gateway.api.sampling import CHAT_FIELDS, COMPLETION_FIELDS, governed_sampling
from gateway.api.turn_http import TurnAnswer, openai_sse, rollout_field, serve_turn, session_of
from gateway.request_ids import new_request_id
from gateway.turns.prepared import ChoiceEvent, PreparedTurn, assistant_message
from gateway.turns.runner import TurnRunner


def create_router(route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The router of the OpenAI-compatible routes, made per app so that `create_app` chooses its route class."""
    router = APIRouter(tags=["openai"], dependencies=[Depends(require_agent)], route_class=route_class)
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    return router


def create_session_router() -> APIRouter:
    """The same routes under `/sessions/{session_id}`, for agents that set only a base URL: the endpoints read the
    session from the path (`turn_session`). FastAPI's route class: these are not the hot routes."""
    dependencies = [Depends(require_agent), Depends(session_in_path)]
    router = APIRouter(prefix="/sessions/{session_id}", tags=["openai"], dependencies=dependencies)
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    return router


async def models(svc: ServicesDep) -> dict[str, Any]:
    """The models agents may call (`pools:`' policies, not their teachers), in the configuration's order."""
    cards = []
    for name in svc.agent_models():
        model = svc.for_model(name).settings.model
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": "rollout-gateway"}
        cards.append({**card, "max_model_len": model.max_model_len})
    return {"object": "list", "data": cards}


async def _envelope(
    kind: str,
    completion_id: str,
    runner: TurnRunner,
    prepared: PreparedTurn,
    choices_of: Callable[[TurnRunner, PreparedTurn], list[Any]],
) -> Response:
    """The whole answer of a recorded turn, its choices as `choices_of` shapes them."""
    choices = choices_of(runner, prepared)
    return json_answer(
        {
            "id": completion_id,
            "object": kind,
            "created": int(time.time()),
            "model": runner.model_name,
            "choices": choices,
            "usage": _usage(prepared),
            "rollout": rollout_field(prepared, prepared.choices),
        }
    )


# -- chat ----------------------------------------------------------------------------------------------


def _token_logprob(runner: TurnRunner, token: int, logprob: float) -> dict[str, Any]:
    text = runner.tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _chat_logprobs(runner: TurnRunner, ids: list[int], logprobs: list[float], tops: list[Any] | None) -> list[Any]:
    entries = []
    for i, (token, logprob) in enumerate(zip(ids, logprobs, strict=True)):
        entry = _token_logprob(runner, token, logprob)
        entry["top_logprobs"] = [_token_logprob(runner, t, lp) for t, lp in (tops[i] if tops else [])]
        entries.append(entry)
    return entries


async def chat_completions(body: ChatCompletionRequest, raw: Request, svc: ServicesDep) -> Response:
    check_messages(len(body.messages), svc.settings.server)
    session, metadata = session_of(raw, body.session_id, body.user, body.metadata, group=body.group)
    svc = pool_for(svc, raw, body.model)  # after the session's identity: its 401 comes first
    runner = svc.turns
    request = chat_request(body, metadata)
    request.sampling = governed_sampling(raw, svc.settings, request.sampling, body, CHAT_FIELDS, "max_tokens")
    completion_id = new_request_id("chatcmpl")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def answer(prepared: PreparedTurn) -> TurnAnswer:
        return TurnAnswer(
            partial(_envelope, "chat.completion", completion_id, runner, prepared, partial(_chat_choices, body)),
            partial(_chat_chunks, runner, prepared, completion_id, body.logprobs, include_usage),
            _done,
            _error_event,
        )

    return await serve_turn(raw, runner, request, session, answer)


def _chat_choices(body: ChatCompletionRequest, runner: TurnRunner, prepared: PreparedTurn) -> list[Any]:
    choices = []
    for c in prepared.choices:
        logprobs = None
        if body.logprobs:
            s = c.state
            logprobs = {"content": _chat_logprobs(runner, s.output_ids, s.logprobs, s.top_logprobs or None)}
        message = assistant_message(c)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return choices


def _chat_chunks(
    runner: TurnRunner, prepared: PreparedTurn, completion_id: str, logprobs: bool, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    head = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": runner.model_name,
    }
    role = {"role": "assistant", "content": ""}
    roles = b"".join(
        openai_sse({**head, "choices": [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}]})
        for c in prepared.choices
    )
    tool_index: dict[int, int] = {}

    def delta_of(event: ChoiceEvent) -> dict[str, Any] | None:
        return _chat_delta(runner, event, logprobs, tool_index)

    return _turn_chunks(runner, prepared, head, include_usage, delta_of, {"delta": {}}, opening=roles)


async def _turn_chunks(
    runner: TurnRunner,
    prepared: PreparedTurn,
    head: dict[str, Any],
    include_usage: bool,
    delta_of: Callable[[ChoiceEvent], dict[str, Any] | None],
    no_content: dict[str, Any],
    opening: bytes = b"",
) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of a streamed turn: `opening` (chat's role deltas) before the generation starts, each event's
    choice delta (`delta_of`, None for none), each choice's end (with `no_content`: an empty delta or text) and its
    rollout, then the usage if asked. The last choice to finish ends the stream, so its last events go out with the
    usage in one chunk (and `serve_turn` sends [DONE] as the end of the body): one socket write where they come back to
    back, instead of one per event."""
    if opening:
        yield opening
    unfinished = len(prepared.choices)
    last = b""
    async with contextlib.aclosing(runner.events(prepared)) as events:  # closed before the turn is recorded
        async for event in events:
            out = b""
            delta = delta_of(event)
            if delta is not None:
                out += openai_sse({**head, "choices": [delta]})
            if event.finished:
                end = {
                    "index": event.choice.index,
                    **no_content,
                    "logprobs": None,
                    "finish_reason": event.choice.finish_reason,
                }
                out += openai_sse({**head, "choices": [end], "rollout": rollout_field(prepared, [event.choice])})
                unfinished -= 1
                if not unfinished:
                    last = out
                    continue
            if out:
                yield out
    if include_usage:
        last += openai_sse({**head, "choices": [], "usage": _usage(prepared)})
    if last:
        yield last


def _chat_delta(
    runner: TurnRunner, event: ChoiceEvent, logprobs: bool, tool_index: dict[int, int]
) -> dict[str, Any] | None:
    delta: dict[str, Any] = {}
    if event.reasoning:
        delta["reasoning_content"] = event.reasoning
    if event.text:
        delta["content"] = event.text
    if event.tool_deltas:
        delta["tool_calls"] = []
        for d in event.tool_deltas:
            call: dict[str, Any] = {"index": d.index}
            if d.id is not None:
                call.update({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
            else:
                call["function"] = {"arguments": d.arguments}
            delta["tool_calls"].append(call)
    entries = None
    if logprobs and event.delta is not None:
        new = event.delta
        entries = {"content": _chat_logprobs(runner, new.token_ids, new.logprobs, new.top_logprobs)}
    if not delta and entries is None:
        return None
    return {"index": event.choice.index, "delta": delta, "logprobs": entries, "finish_reason": None}


# -- completions ---------------------------------------------------------------------------------------


def _completion_logprobs(
    runner: TurnRunner, ids: list[int], logprobs: list[float], tops: list[Any] | None
) -> dict[str, Any]:
    tokens = [runner.tokenizer.decode([t]) for t in ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [{runner.tokenizer.decode([t]): lp for t, lp in tops[i]} for i in range(len(ids))] if tops else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


async def completions(body: CompletionRequest, raw: Request, svc: ServicesDep) -> Response:
    session, metadata = session_of(raw, body.session_id, body.user, body.metadata, group=body.group)
    svc = pool_for(svc, raw, body.model)  # after the session's identity: its 401 comes first
    runner = svc.turns
    request = completion_request(body, metadata)
    request.sampling = governed_sampling(raw, svc.settings, request.sampling, body, COMPLETION_FIELDS, "max_tokens")
    completion_id = new_request_id("cmpl")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    logprobs = body.logprobs is not None

    def answer(prepared: PreparedTurn) -> TurnAnswer:
        return TurnAnswer(
            partial(
                _envelope, "text_completion", completion_id, runner, prepared, partial(_completion_choices, logprobs)
            ),
            partial(_completion_chunks, runner, prepared, completion_id, logprobs, include_usage),
            _done,
            _error_event,
        )

    return await serve_turn(raw, runner, request, session, answer)


def _completion_choices(logprobs: bool, runner: TurnRunner, prepared: PreparedTurn) -> list[Any]:
    choices = []
    for c in prepared.choices:
        s = c.state
        entries = _completion_logprobs(runner, s.output_ids, s.logprobs, s.top_logprobs or None) if logprobs else None
        choices.append({"index": c.index, "text": c.text, "logprobs": entries, "finish_reason": c.finish_reason})
    return choices


def _completion_chunks(
    runner: TurnRunner, prepared: PreparedTurn, completion_id: str, logprobs: bool, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    head = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": runner.model_name}

    def delta_of(event: ChoiceEvent) -> dict[str, Any] | None:
        d = event.delta
        lp = _completion_logprobs(runner, d.token_ids, d.logprobs, d.top_logprobs) if logprobs and d else None
        if not event.text and lp is None:
            return None
        return {"index": event.choice.index, "text": event.text, "logprobs": lp, "finish_reason": None}

    return _turn_chunks(runner, prepared, head, include_usage, delta_of, {"text": ""})


def _usage(prepared: PreparedTurn) -> dict[str, int]:
    completion = sum(len(c.state.output_ids) for c in prepared.choices)
    prompt = len(prepared.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _done() -> bytes:
    return b"data: [DONE]\n\n"


def _error_event(exc: GatewayError) -> bytes:
    error = {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.status_code}
    return openai_sse({"error": error})
