"""What every protocol's turn route shares (OpenAI chat and completions, Anthropic Messages, OpenAI Responses,
`POST /generate` in a session): the turn's session, preparing the turn, generating to the end or relaying its
stream, and closing it. Each protocol's module maps its request to a `TurnRequest` and shapes its answer
(`TurnAnswer`) around these (docs/architecture.md §1, §7).

A turn is closed in one place, `serve_turn`'s `async with`: whether it was refused, answered whole, or streamed
(then the stack that closes it moves to the streamed response, which closes it however the response ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.asgi import ClientDisconnected, relay_until_disconnected, unless_disconnected
from common.errors import GatewayError
from gateway.api.deps import agent_key, turn_session
from gateway.api.errors import stream_error
from gateway.api.streaming import DISCONNECT_WATCH_AFTER_S, GuardedStreamingResponse, LastChunk
from gateway.session.identity import with_group
from gateway.turns.prepared import Choice, PreparedTurn
from gateway.turns.request import TurnRequest
from gateway.turns.runner import TurnRunner

__all__ = ["TurnAnswer", "openai_sse", "rollout_field", "serve_turn", "session_of"]


def openai_sse(payload: Any) -> bytes:
    """One server-sent event of data only, as OpenAI's streams send them."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def rollout_field(prepared: PreparedTurn, choices: list[Choice]) -> dict[str, Any]:
    """The vendor field `rollout`: the request's session, and per choice its session (a group's member, else the
    same), the sample it was recorded in, its per-token versions, resumes and output ids; `group_id` for a group
    request."""
    out: dict[str, Any] = {
        "session_id": prepared.session_id,
        "choices": [
            {
                "index": c.index,
                "session_id": c.turn.session_id,
                "sample_index": c.turn.stored_index,
                "new_sample": c.turn.new_sample,
                "versions": c.state.versions,
                "num_resumes": c.state.num_resumes,
                "output_ids": c.state.output_ids,
            }
            for c in choices
        ],
    }
    if prepared.group_id is not None:
        out["group_id"] = prepared.group_id
    return out


def session_of(
    raw: Request, body_session: str | None, user: str | None, metadata: dict[str, str] | None, *, group: bool = False
) -> tuple[str | None, dict[str, str] | None]:
    """The turn's session (`turn_session`) and its metadata: a `grp-` name's group metadata joins the body's (not for
    a `group: true` request, whose members get their own)."""
    session, named_group = turn_session(raw, body_session, user)
    if named_group is not None and session is not None and not group:
        metadata = with_group(metadata, named_group, session)
    return session, metadata


@dataclass(frozen=True, slots=True)
class TurnAnswer:
    """How a protocol answers one prepared turn. Whole: `whole()`, once the turn is recorded. Streamed: `chunks()`,
    its events but the last; `last()`, once the turn is recorded, the event that ends the stream (OpenAI's
    `[DONE]`, Anthropic's `message_stop`; b"" for none); `error_event`, an error's event once the answer started
    (200)."""

    whole: Callable[[], Awaitable[Response]]
    chunks: Callable[[], AsyncGenerator[bytes, None]]
    last: Callable[[], Awaitable[bytes]]
    error_event: Callable[[GatewayError], bytes]


async def serve_turn(
    raw: Request,
    runner: TurnRunner,
    request: TurnRequest,
    session: str | None,
    answer_of: Callable[[PreparedTurn], TurnAnswer],
) -> Response:
    """Prepare the turn for the caller (its key: `agent_key`), generate it (aborted if the client leaves) and answer
    it (`answer_of(prepared)`). The turn is recorded before the answer, or a stream's last event: an agent that
    finishes its session right after a turn never races that turn's write (the trainer would get the trajectory
    without it). However the request ends, the turn is closed once: recorded (one that did not finish as
    cancelled), its locks and the caller's slot released."""
    prepared = await runner.prepare(request, session, agent_key(raw))
    if request.stream:
        async with prepared.handle.closed_on_error():
            chunks = _relay(raw, answer_of(prepared), prepared.close)
        # The response's now: it closes the turn however it ends.
        return GuardedStreamingResponse(chunks, prepared.close, media_type="text/event-stream")
    async with prepared.handle:
        answer = answer_of(prepared)
        await unless_disconnected(raw, runner.run(prepared), _nothing, DISCONNECT_WATCH_AFTER_S)
    return await answer.whole()


async def _relay(raw: Request, answer: TurnAnswer, close: Callable[[], Awaitable[Any]]) -> AsyncIterator[bytes]:
    """Relay the answer's chunks until done or the client leaves, then record the turn (`close`) and send its last
    event. An error becomes the protocol's error event, an unexpected one a 500 event (the response then records
    the turn)."""
    try:
        # Closed before the turn is recorded, however the relay ends (a client cut while this generator is
        # suspended closes it from outside): its generation closes its segment first.
        relayed = relay_until_disconnected(raw, answer.chunks(), DISCONNECT_WATCH_AFTER_S)
        async with contextlib.aclosing(relayed):
            async for chunk in relayed:
                yield chunk
        await close()
        last = await answer.last()
    except ClientDisconnected:
        raise
    except Exception as exc:  # the answer started (200): the error can only be an event
        yield answer.error_event(stream_error(exc))
        return
    if last:
        yield LastChunk(last)


def _nothing() -> None:
    """What a disconnect needs besides the cancellation of the turn: nothing (its generation aborts its engine
    request when cancelled, and `serve_turn` records it)."""
