"""The OpenAI Responses API: `POST /v1/responses` (and under a session prefix, `/sessions/{id}/v1/responses`), a thin
adapter over the chat turn, and `GET /v1/responses/{id}`.

A request becomes a chat turn (a `TurnRequest`, run by `gateway.api.turn_http.serve_turn`): its `instructions` a system
message first, then the conversation of the response it continues (`previous_response_id`,
`gateway.session.response_records`), then its input items as chat messages (`gateway.api.responses.items`). So a
turn sent with `previous_response_id` and one that replays the whole conversation extend the same sample of the
session.

Session: the one the request names (`turn_session`: path, header, body `session_id`, API key, `user`); else the
previous response's; else a one-turn session, as on the chat API. A previous response of another session than the one
named is a 400. A stored response belongs to the API key that created it (`ResponseRecord.owner`): another key's
`GET` is a 404 and its `previous_response_id` a 400, as for an id never stored.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from common.errors import GatewayError
from gateway.api.context import ApiServices
from gateway.api.deps import ServicesDep, pool_for, require_agent, session_in_path, session_owner, usable
from gateway.api.json_answer import json_answer
from gateway.api.limits import check_messages
from gateway.api.responses.items import ItemIds, chat_messages, output_items
from gateway.api.responses.models import NamedFunction, ResponseRequest
from gateway.api.responses.stream import ResponseEvents
from gateway.api.sampling import RESPONSES_FIELDS, governed_sampling
from gateway.api.turn_http import TurnAnswer, rollout_field, serve_turn, session_of
from gateway.errors import InvalidRequest, NotFound
from gateway.session.response_records import ResponseRecord, ResponseRecords, response_not_found
from gateway.turns.prepared import Choice, PreparedTurn, assistant_message
from gateway.turns.request import Conversation, Sampling, TurnRequest, template_kwargs_of
from gateway.turns.runner import TurnRunner

__all__ = ["create_router", "create_session_router"]

Message = dict[str, Any]


def create_router(route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """`POST /v1/responses` and `GET /v1/responses/{response_id}`; `route_class` as the chat API's (the app passes
    `OnePassRoute`, whose requests the fast path's hot routes serve past FastAPI's stack)."""
    router = APIRouter(tags=["responses"], dependencies=[Depends(require_agent)], route_class=route_class)
    router.add_api_route("/v1/responses", create_response, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    return router


def create_session_router() -> APIRouter:
    """The same under `/sessions/{session_id}`, for agents that set only a base URL."""
    dependencies = [Depends(require_agent), Depends(session_in_path)]
    router = APIRouter(prefix="/sessions/{session_id}", tags=["responses"], dependencies=dependencies)
    router.add_api_route("/v1/responses", create_response, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    return router


async def get_response(response_id: str, raw: Request, svc: ServicesDep) -> Response:
    """The stored answer, from whichever pool the caller's key may use holds it (`pools:`)."""
    pools = [pool_for(svc, raw, name) for name in svc.agent_models() if usable(svc, raw, name)]
    for pool in pools:
        with contextlib.suppress(NotFound):
            return json_answer((await _records(pool).get(response_id, session_owner(raw))).answer)
    raise response_not_found(response_id)


def _records(svc: ApiServices) -> ResponseRecords:
    return ResponseRecords(svc.store.responses, svc.response_cache, max_links=svc.settings.server.max_messages)


async def create_response(body: ResponseRequest, raw: Request, svc: ServicesDep) -> Response:
    session, metadata = session_of(raw, body.session_id, body.user, body.metadata)
    svc = pool_for(svc, raw, body.model)  # after the session's identity: its 401 comes first
    runner = svc.turns
    records = _records(svc)
    owner = session_owner(raw)
    history: list[Message] = []
    if body.previous_response_id is not None:
        previous = await records.previous(body.previous_response_id, owner)
        session = _continuing(session, previous, body.previous_response_id)
        history = await records.conversation(body.previous_response_id, previous)
    messages = _messages(body, history)
    check_messages(len(messages), svc.settings.server)
    request = _turn_request(body, messages, metadata)
    budget = "max_output_tokens"
    request.sampling = governed_sampling(raw, svc.settings, request.sampling, body, RESPONSES_FIELDS, budget)

    def answer(prepared: PreparedTurn) -> TurnAnswer:
        return _Answer(body, runner, prepared, records, owner, len(history)).answer()

    return await serve_turn(raw, runner, request, session, answer)


def _continuing(named: str | None, previous: ResponseRecord, previous_id: str) -> str | None:
    """The session of a request that continues `previous`: the one named, which must be the previous response's;
    else the previous response's (None: it was a one-turn session's, and so is this turn)."""
    if named is not None and named != previous.session_id:
        raise InvalidRequest(
            f"previous response '{previous_id}' belongs to another session than {named!r}",
            param="previous_response_id",
        )
    return previous.session_id


def _messages(body: ResponseRequest, history: list[Message]) -> list[Message]:
    """The conversation the turn renders: the instructions, the history, the input items. Not validated again: the
    input items' were (`ResponseRequest`), and the history is a conversation the gateway recorded."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) + history
    messages += chat_messages(body.input)
    if not messages:
        raise InvalidRequest("input: the request has no input", param="input")
    return messages


def _turn_request(body: ResponseRequest, messages: list[Message], metadata: dict[str, str] | None) -> TurnRequest:
    """The chat turn `body` asks for, of `messages` (`_messages`)."""
    for index, tool in enumerate(body.tools or ()):
        if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
            where = f"tools.{index}.parameters"
            raise InvalidRequest(f"{where}: function parameters must be a JSON schema of type object", param=where)
    offered = None
    if body.tools and body.tool_choice != "none":
        offered = [{"type": "function", "function": t.definition()} for t in body.tools]
    sampling = Sampling(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(stop for stop in ([body.stop] if isinstance(body.stop, str) else body.stop or ()) if stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        min_p=body.min_p,
    )
    effort = body.reasoning.effort if body.reasoning is not None else None
    conversation = Conversation(messages, offered, template_kwargs_of(body.chat_template_kwargs, effort))
    return TurnRequest(conversation, sampling, body.model, body.stream, metadata)


class _Answer:
    """Shapes one turn's answer: the response object, and its stream."""

    def __init__(
        self,
        body: ResponseRequest,
        runner: TurnRunner,
        prepared: PreparedTurn,
        records: ResponseRecords,
        owner: str | None,
        continued: int,
    ) -> None:
        self.body = body
        self.owner = owner
        self.continued = continued  # how many messages of the previous response's conversation this turn's has
        self.runner = runner
        self.prepared = prepared
        self.records = records
        self.response_id = f"resp_{secrets.token_hex(16)}"  # unguessable: it lets a request continue the session
        self.created_at = int(time.time())
        self.ids = ItemIds()
        self.stream = ResponseEvents(self.ids)
        self._reasoning_tokens = 0
        self._final: dict[str, Any] | None = None  # the streamed response's, once its items are done

    @property
    def choice(self) -> Choice:
        return self.prepared.choices[0]

    def response(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object; `status` "completed" becomes "incomplete" where the reply did not end by itself
        (`incomplete_details.reason` "max_output_tokens" where the budget cut it)."""
        body, choice = self.body, self.choice
        incomplete: dict[str, str | None] | None = None
        if status == "completed":
            output = output_items(choice, self.ids)
            if choice.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            elif choice.finish_reason not in ("stop", "tool_calls"):  # the engine's abort: no reason OpenAI names
                status, incomplete = "incomplete", {"reason": None}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.runner.model_name,
            "output": output or [],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "store": body.store is not False,
            "temperature": self.choice.request.sampling.temperature,  # as the engine got it (`sampling:` pins)
            "text": {"format": {"type": "text"}},
            "tool_choice": _tool_choice(body),
            "tools": [t.echoed() for t in body.tools or ()],
            "top_p": self.choice.request.sampling.top_p,
            "truncation": body.truncation or "disabled",
            "usage": self._usage() if status != "in_progress" else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    async def final(self) -> dict[str, Any]:
        """The response of the ended turn."""
        reasoning = self.choice.reasoning
        if reasoning:  # the engine does not say which ids were reasoning: its text, encoded again, is close
            self._reasoning_tokens = len(await self.runner.tokenizer.encode_async(reasoning))
        return self.response("completed")

    def _usage(self) -> dict[str, Any]:
        prompt, out = len(self.prepared.prompt_ids), len(self.choice.state.output_ids)
        reasoning = min(self._reasoning_tokens, out)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + out,
        }

    async def store(self, final: dict[str, Any]) -> None:
        """Keep the response for `previous_response_id` and `GET` (unless `store: false`, or the turn was not
        recorded as a conversation: cancelled)."""
        choice = self.choice
        if self.body.store is False or choice.state.cancelled:
            return
        one_turn = self.prepared.one_turn
        conversation = [*choice.turn.messages, assistant_message(choice)]
        instructions = self.body.instructions is not None
        history = conversation[1:] if instructions else conversation  # what a request continuing this one starts from
        previous = self.body.previous_response_id if one_turn else None
        if not one_turn:  # the sample holds the messages
            kept = None
        elif previous is None:  # the first of a chain: whole
            kept = conversation
        else:  # the chain holds the messages before its own (`ResponseRecords.conversation`)
            kept, instructions = history[self.continued :], False
        record = ResponseRecord(
            answer=final,
            session_id=None if one_turn else choice.turn.session_id,
            sample=choice.turn.stored_index,
            messages=len(conversation),
            instructions=instructions,
            conversation=kept,
            owner=self.owner,
            previous=previous,
        )
        await self.records.save(self.response_id, record, history)

    def answer(self) -> TurnAnswer:
        return TurnAnswer(self.whole, self.events, self.last, self.error_event)

    async def whole(self) -> Response:
        final = await self.final()
        await self.store(final)
        return json_answer(final | {"rollout": rollout_field(self.prepared, self.prepared.choices)})

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The stream up to the items' `done` events; the relay records the turn, then sends `last`."""
        stream = self.stream
        yield stream.opening(self.response("in_progress"))
        async with contextlib.aclosing(self.runner.events(self.prepared)) as events:  # closed before it is recorded
            async for event in events:
                out = stream.of(event)
                if out:
                    yield out
        self._final = await self.final()
        yield stream.closing(self._final["output"])

    async def last(self) -> bytes:
        """The turn recorded, the response stored: its last event (`response.completed` or `response.incomplete`)."""
        final = self._final
        if final is None:
            return b""
        await self.store(final)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return self.stream.event(kind, response=final | {"rollout": rollout_field(self.prepared, [self.choice])})

    def error_event(self, exc: GatewayError) -> bytes:
        error = {"code": exc.code or exc.error_type, "message": exc.message, "param": exc.param}
        return self.stream.event("error", **error)


def _tool_choice(body: ResponseRequest) -> Any:
    if isinstance(body.tool_choice, NamedFunction):
        return body.tool_choice.model_dump()
    return body.tool_choice or "auto"
