"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, and the same under a session
prefix, `/sessions/{session_id}/v1/...` (the session named by the path: `gateway.session.identity`).

A thin adapter over the chat turn: the request becomes a turn request (`gateway.api.anthropic.chat`),
runs as any turn (`gateway.api.turn_http`), and its reply is shaped as Anthropic's message or events
(`gateway.api.anthropic.answer`). Errors come in Anthropic's shape (`AnthropicErrorsRoute`). The vendor field
`rollout` carries what only a rollout needs, as on the OpenAI routes.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.anthropic.answer import message_answer
from gateway.api.anthropic.chat import conversation, messages_request
from gateway.api.anthropic.models import CountTokensRequest, MessagesRequest
from gateway.api.deps import ServicesDep, pool_for, require_agent, session_in_path
from gateway.api.errors import AnthropicErrorsRoute
from gateway.api.json_answer import JSONAnswer, json_answer
from gateway.api.limits import check_messages
from gateway.api.sampling import ANTHROPIC_FIELDS, governed_sampling
from gateway.api.turn_http import serve_turn, session_of
from gateway.request_ids import new_name

__all__ = ["count_tokens", "create_router", "create_session_router", "messages"]


def create_router() -> APIRouter:
    """The Messages routes; not hot routes, so FastAPI's route class (with Anthropic's error shape)."""
    router = APIRouter(tags=["anthropic"], dependencies=[Depends(require_agent)], route_class=AnthropicErrorsRoute)
    _add_routes(router)
    return router


def create_session_router() -> APIRouter:
    """The same routes under `/sessions/{session_id}`, for agents that set only a base URL."""
    dependencies = [Depends(require_agent), Depends(session_in_path)]
    router = APIRouter(
        prefix="/sessions/{session_id}", tags=["anthropic"], dependencies=dependencies, route_class=AnthropicErrorsRoute
    )
    _add_routes(router)
    return router


def _add_routes(router: APIRouter) -> None:
    router.add_api_route("/v1/messages", messages, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


async def messages(body: MessagesRequest, raw: Request, svc: ServicesDep) -> Response:
    check_messages(len(body.messages), svc.settings.server)
    user = body.metadata.user_id if body.metadata else None
    session, metadata = session_of(raw, body.session_id, user, None)
    svc = pool_for(svc, raw, body.model)  # after the session's identity: its 401 comes first
    runner = svc.turns
    request = messages_request(body, metadata)
    request.sampling = governed_sampling(raw, svc.settings, request.sampling, body, ANTHROPIC_FIELDS, "max_tokens")
    answer = partial(message_answer, f"msg_{new_name()}", runner)
    return await serve_turn(raw, runner, request, session, answer)


async def count_tokens(body: CountTokensRequest, raw: Request, svc: ServicesDep) -> JSONAnswer:
    """The prompt's length in tokens: the chat template's rendering of the conversation and tools."""
    svc = pool_for(svc, raw, body.model)
    runner = svc.turns
    check_messages(len(body.messages), svc.settings.server)
    return json_answer({"input_tokens": len(await runner.render(conversation(body)))})
