"""A chat turn's reply as Anthropic's Messages API answers it: the whole message, or its server-sent events.

Content blocks in order: a `thinking` block (the reply's reasoning, signature ""), a `text` block (its content), a
`tool_use` block per call (`input` the parsed arguments). `stop_reason`: `tool_use` (calls made), `max_tokens`
(cut), `stop_sequence` (with the matched `stop_sequence`), else `end_turn`. The vendor field `rollout` rides on the
message (whole) or on `message_delta` (streamed).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

import orjson
from fastapi.responses import Response

from common.errors import GatewayError
from gateway.api.errors import anthropic_error
from gateway.api.json_answer import json_answer, model_json
from gateway.api.turn_http import TurnAnswer, rollout_field
from gateway.turns.prepared import Choice, ChoiceEvent, PreparedTurn
from gateway.turns.runner import TurnRunner

__all__ = ["MESSAGE_STOP", "error_event", "message", "message_answer", "message_events"]


def _sse(event: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic's streams send them: its type as the event name, then its data."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


MESSAGE_STOP = _sse("message_stop", {"type": "message_stop"})


def message_answer(message_id: str, runner: TurnRunner, prepared: PreparedTurn) -> TurnAnswer:
    """How a turn of `POST /v1/messages` is answered: the whole message, or its events then `message_stop`."""

    async def whole() -> Response:
        return json_answer(message(message_id, runner, prepared))

    async def last() -> bytes:
        return MESSAGE_STOP

    return TurnAnswer(whole, partial(message_events, message_id, runner, prepared), last, error_event)


def error_event(exc: GatewayError) -> bytes:
    return _sse("error", anthropic_error(exc.status_code, exc.message))


def stop_of(choice: Choice) -> tuple[str, str | None]:
    """The reply's `stop_reason` and `stop_sequence`."""
    finish = choice.finish_reason
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.detokenizer.stop_match
    if matched is not None:
        return "stop_sequence", matched.stop
    return "end_turn", None


def content_of(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content is not None:
        blocks.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": model_json(call.arguments)})
    return blocks


def _head(message_id: str, runner: TurnRunner) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": runner.model_name}


def message(message_id: str, runner: TurnRunner, prepared: PreparedTurn) -> dict[str, Any]:
    """The whole answer of a finished turn (one choice)."""
    choice = prepared.choices[0]
    stop_reason, stop_sequence = stop_of(choice)
    usage = {"input_tokens": len(prepared.prompt_ids), "output_tokens": len(choice.state.output_ids)}
    return {
        **_head(message_id, runner),
        "content": content_of(choice),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
        "rollout": rollout_field(prepared, prepared.choices),
    }


async def message_events(message_id: str, runner: TurnRunner, prepared: PreparedTurn) -> AsyncGenerator[bytes, None]:
    """The events of a streamed turn up to `message_delta` (the route's relay sends `message_stop` once the turn is
    recorded). A reply's last events go out in one chunk."""
    usage = {"input_tokens": len(prepared.prompt_ids), "output_tokens": 0}
    start = {**_head(message_id, runner), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield _sse("message_start", {"type": "message_start", "message": start})
    blocks = _Blocks()
    async with contextlib.aclosing(runner.events(prepared)) as events:  # closed before the turn is recorded
        async for event in events:
            out = blocks.add(event)
            if event.finished:
                out += blocks.finish(event.choice)
                stop_reason, stop_sequence = stop_of(event.choice)
                delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": len(event.choice.state.output_ids)},
                    "rollout": rollout_field(prepared, [event.choice]),
                }
                out += _sse("message_delta", delta)
            if out:
                yield out


class _Blocks:
    """The content blocks of a streamed reply: a block starts when the kind of delta changes (reasoning, text, a new
    tool call) and stops when the next starts or the reply ends."""

    def __init__(self) -> None:
        self.count = 0  # blocks started so far; the open one is the last
        self.open: str | None = None
        self.tool_blocks: dict[int, int] = {}  # a tool call's index → its block's index
        self.text_sent = False

    def add(self, event: ChoiceEvent) -> bytes:
        out = b""
        if event.reasoning:
            out += self._enter("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta(self.count - 1, {"type": "thinking_delta", "thinking": event.reasoning})
        if event.text:
            out += self._text(event.text)
        for d in event.tool_deltas:
            if d.id is not None:
                out += self._start("tool_use", {"type": "tool_use", "id": d.id, "name": d.name or "", "input": {}})
                self.tool_blocks[d.index] = self.count - 1
            if d.arguments:
                out += self._delta(self.tool_blocks[d.index], {"type": "input_json_delta", "partial_json": d.arguments})
        return out

    def finish(self, choice: Choice) -> bytes:
        """Close the open block. A reply whose content is empty has an empty text block, as its whole answer does."""
        out = b""
        if choice.content is not None and not self.text_sent:
            out += self._text(choice.content)
        return out + self._stop()

    def _text(self, text: str) -> bytes:
        self.text_sent = True
        out = self._enter("text", {"type": "text", "text": ""})
        return out + (self._delta(self.count - 1, {"type": "text_delta", "text": text}) if text else b"")

    def _enter(self, kind: str, block: dict[str, Any]) -> bytes:
        return b"" if self.open == kind else self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.open = kind
        self.count += 1
        start = {"type": "content_block_start", "index": self.count - 1, "content_block": block}
        return out + _sse("content_block_start", start)

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
