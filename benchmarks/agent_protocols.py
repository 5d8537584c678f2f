"""The agent protocols the load generator speaks: a turn's request and the check of its answer, per protocol.

* `chat`: OpenAI `POST /v1/chat/completions` (`messages`, `max_tokens`; streamed with `stream_options.include_usage`
  so that the last chunk carries the usage);
* `messages`: Anthropic `POST /v1/messages` (`messages`, `max_tokens`; `x-api-key` and `anthropic-version` headers, as
  the official SDK sends them); a stream is `event:`/`data:` pairs: `content_block_delta` text, `message_delta` with
  `stop_reason` and `usage.output_tokens`;
* `responses`: OpenAI `POST /v1/responses` (`input` items, the whole conversation each turn, `max_output_tokens`; or,
  chained, only the new user message and `previous_response_id`); a stream's `response.output_text.delta` events,
  then `response.incomplete` (or `.completed`) with the response.

A turn sends the conversation so far (user and assistant turns alternating, as text) with a token budget and
`temperature: 0`, nothing a protocol does not define (no `ignore_eos`: `benchmarks.compare` runs its replicas with
EOS off instead). Its answer must be status 200, name the budget as the reason it ended (`length`, `max_tokens`,
`incomplete: max_output_tokens`), report exactly the budget as output tokens, and carry text; anything else, or an
error event in a stream, raises `AnswerError` with what was wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

AGENT_APIS = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
HEADERS = {
    "chat": {"Authorization": "Bearer bench"},
    "messages": {"x-api-key": "bench", "anthropic-version": "2023-06-01"},
    "responses": {"Authorization": "Bearer bench"},
}
BUDGET_REASONS = {"chat": "length", "messages": "max_tokens", "responses": "max_output_tokens"}

Pieces = list[tuple[float, bytes]]
"""An answer's body as it arrived: (arrival time, bytes) per read."""
Conversation = list[tuple[str, str]]
"""(role, text) of each turn so far: "user" and "assistant", alternating, starting with "user"."""


class AnswerError(Exception):
    """An answer that is not what was asked for (status, shape, token count, an error event)."""


@dataclass
class Reply:
    """What a valid answer said: its output tokens, when its first text arrived (streams), its text and (Responses)
    its id."""

    tokens: int
    first: float | None
    text: str
    response_id: str | None = None


@dataclass
class _Reading:
    """What an answer says, gathered from its body or its events."""

    text: list[str] = field(default_factory=list)
    first: float | None = None
    reason: str | None = None  # why it ended, in the protocol's words
    tokens: int | None = None  # usage: output tokens
    response_id: str | None = None

    def add_text(self, now: float | None, text: str | None) -> None:
        if text:
            self.text.append(text)
            self.first = self.first or now


def request_body(
    api: str, conversation: Conversation, budget: int, stream: bool, previous_response_id: str | None = None
) -> dict[str, Any]:
    """The body of one turn of `api` (model `tiny`) sending `conversation`; with `previous_response_id` (Responses),
    only its last turn, the new user message, and that id."""
    turns = [{"role": role, "content": text} for role, text in conversation]
    common = {"model": "tiny", "temperature": 0, "stream": stream}
    if api == "chat":
        body = {**common, "messages": turns, "max_tokens": budget}
        return body | ({"stream_options": {"include_usage": True}} if stream else {})
    if api == "messages":
        return {**common, "messages": turns, "max_tokens": budget}
    if api == "responses" and previous_response_id is not None:
        return {
            **common,
            "input": turns[-1:],
            "previous_response_id": previous_response_id,
            "max_output_tokens": budget,
        }
    if api == "responses":
        return {**common, "input": turns, "max_output_tokens": budget}
    raise ValueError(f"unknown agent api {api!r}; one of {AGENT_APIS}")


def sse_events(pieces: Pieces) -> Iterator[tuple[float, Any]]:
    """(arrival time, decoded `data:`) of each server-sent event but `[DONE]`; an `event:` line before the data (as
    Anthropic's and the Responses API's streams send) is skipped, the data carries the same `type`."""
    buffer = b""
    for now, piece in pieces:
        buffer += piece
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            at = 0 if event.startswith(b"data:") else event.find(b"\ndata:") + 1
            if at == 0 and not event.startswith(b"data:"):
                continue  # a comment, or an event without data
            data = event[at + 5 :].strip()
            if data != b"[DONE]":
                yield now, orjson.loads(data)


def read_answer(api: str, status: int, pieces: Pieces, stream: bool, budget: int) -> Reply:
    """The reply of a valid answer to a turn of `api` asking for `budget` tokens; raises `AnswerError` otherwise."""
    if status != 200:
        raise AnswerError(f"HTTP {status}: {b''.join(p for _, p in pieces)[:200]!r}")
    reading = _Reading()
    if stream:
        for now, event in sse_events(pieces):
            _STREAM_READERS[api](event, now, reading)
    else:
        _WHOLE_READERS[api](orjson.loads(b"".join(p for _, p in pieces)), reading)
    text = "".join(reading.text)
    if reading.reason != BUDGET_REASONS[api] or reading.tokens != budget or not text:
        raise AnswerError(
            f"asked {budget} tokens, got {reading.tokens} ({reading.reason!r}, {len(text)} characters of text)"
        )
    return Reply(budget, reading.first, text, reading.response_id)


def _error(event: dict[str, Any]) -> None:
    if event.get("type") in ("error", "response.failed") or event.get("error"):
        raise AnswerError(f"error event: {str(event)[:200]}")


# -- chat completions -------------------------------------------------------------------------------------------


def _chat_whole(answer: dict[str, Any], reading: _Reading) -> None:
    choice = answer["choices"][0]
    reading.add_text(None, choice["message"].get("content"))
    reading.reason, reading.tokens = choice["finish_reason"], answer["usage"]["completion_tokens"]


def _chat_event(event: dict[str, Any], now: float, reading: _Reading) -> None:
    _error(event)
    for choice in event.get("choices") or ():
        reading.add_text(now, choice.get("delta", {}).get("content"))
        reading.reason = choice.get("finish_reason") or reading.reason
    if event.get("usage"):
        reading.tokens = event["usage"]["completion_tokens"]


# -- Anthropic messages -----------------------------------------------------------------------------------------


def _messages_whole(answer: dict[str, Any], reading: _Reading) -> None:
    _error(answer)
    for block in answer["content"]:
        if block["type"] == "text":
            reading.add_text(None, block["text"])
    reading.reason, reading.tokens = answer["stop_reason"], answer["usage"]["output_tokens"]


def _messages_event(event: dict[str, Any], now: float, reading: _Reading) -> None:
    _error(event)
    kind = event["type"]
    if kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
        reading.add_text(now, event["delta"]["text"])
    elif kind == "message_delta":
        reading.reason = event["delta"].get("stop_reason")
        reading.tokens = event["usage"]["output_tokens"]


# -- Responses --------------------------------------------------------------------------------------------------


def _response_end(response: dict[str, Any], reading: _Reading) -> None:
    """The end state of a response object: why it ended (`completed`, or the reason it is `incomplete`), its usage."""
    details = response.get("incomplete_details") or {}
    reading.reason = details.get("reason") if response["status"] == "incomplete" else response["status"]
    reading.tokens = response["usage"]["output_tokens"]
    reading.response_id = response["id"]


def _responses_whole(answer: dict[str, Any], reading: _Reading) -> None:
    _error(answer)
    for item in answer["output"]:
        for part in item.get("content") or () if item["type"] == "message" else ():
            if part["type"] == "output_text":
                reading.add_text(None, part["text"])
    _response_end(answer, reading)


def _responses_event(event: dict[str, Any], now: float, reading: _Reading) -> None:
    _error(event)
    kind = event["type"]
    if kind == "response.output_text.delta":
        reading.add_text(now, event["delta"])
    elif kind in ("response.completed", "response.incomplete"):
        _response_end(event["response"], reading)


_WHOLE_READERS = {"chat": _chat_whole, "messages": _messages_whole, "responses": _responses_whole}
_STREAM_READERS = {"chat": _chat_event, "messages": _messages_event, "responses": _responses_event}
