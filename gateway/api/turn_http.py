"""What every protocol's turn route shares (OpenAI chat and completions, Anthropic Messages, OpenAI Responses): the
turn's session, the caller's session slot, generating to the end, and relaying a streamed turn. Each protocol's
module shapes only its request and its answer around these (docs/architecture.md §1).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from common.asgi import ClientDisconnected, relay_until_disconnected, unless_disconnected
from common.errors import GatewayError
from gateway.api.deps import agent_key, session_owner, turn_session
from gateway.api.errors import stream_error
from gateway.api.streaming import DISCONNECT_WATCH_AFTER_S, GuardedStreamingResponse, LastChunk
from gateway.services import Services
from gateway.session.identity import with_group
from gateway.turns.runner import Choice, PreparedTurn, TurnRunner

__all__ = ["openai_sse", "prepare_turn", "relay", "rollout_field", "run_to_end", "session_of", "streaming_answer"]


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


async def prepare_turn(
    raw: Request, svc: Services, session: str | None, prepare: Callable[[str | None], Awaitable[PreparedTurn]]
) -> PreparedTurn:
    """Take the caller's per-key session slot, then prepare the turn (`prepare(owner)`: the caller's
    `session_owner`, which alone may use the session); the slot is freed when the turn closes."""
    lease = svc.quota.acquire(agent_key(raw), session)
    try:
        prepared = await prepare(session_owner(raw))
    except BaseException:
        lease.release()
        raise
    prepared.leases.append(lease)
    return prepared


async def run_to_end(raw: Request, runner: TurnRunner, prepared: PreparedTurn) -> None:
    """Generate every choice (aborted if the client leaves), then record the turn."""
    try:
        await unless_disconnected(raw, runner.run(prepared), lambda: None, DISCONNECT_WATCH_AFTER_S)
    finally:
        await runner.lifecycle.close(prepared)


def streaming_answer(chunks: AsyncIterator[bytes], runner: TurnRunner, prepared: PreparedTurn) -> Response:
    """The SSE response of a streamed turn; the turn is recorded however the response ends."""
    return GuardedStreamingResponse(chunks, lambda: runner.lifecycle.close(prepared), media_type="text/event-stream")


async def relay(
    raw: Request,
    runner: TurnRunner,
    prepared: PreparedTurn,
    chunks: AsyncGenerator[bytes, None],
    *,
    last: Callable[[], bytes],
    error_event: Callable[[GatewayError], bytes],
) -> AsyncIterator[bytes]:
    """Relay SSE chunks until done or the client leaves, then record the turn and send `last()` (OpenAI's `[DONE]`,
    Anthropic's `message_stop`): an agent that finishes its session right after a streamed turn never races that
    turn's write (the trainer would get the trajectory without it). An error becomes the protocol's error event
    (`error_event`), an unexpected one a 500 event; the turn is always recorded, one that did not finish as
    cancelled."""
    try:
        # Closed before the turn is recorded, however the relay ends (a client cut while this generator is
        # suspended closes it from outside): its generation closes its segment first.
        async with contextlib.aclosing(relay_until_disconnected(raw, chunks, DISCONNECT_WATCH_AFTER_S)) as relayed:
            async for chunk in relayed:
                yield chunk
        await runner.lifecycle.close(prepared)
        yield LastChunk(last())
    except ClientDisconnected:
        raise
    except Exception as exc:  # the answer started (200): the error can only be an event
        yield error_event(stream_error(exc))
    finally:
        await runner.lifecycle.close(prepared)
