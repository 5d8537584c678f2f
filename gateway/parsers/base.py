"""What every parser shares: the parsed shapes (whole and streamed) and the `ToolParser` protocol.

A tool parser splits a completion's text into content and OpenAI-style tool calls, either whole (`parse`) or as the
text streams in (`streaming`); `collect_deltas` folds the streamed deltas into what `parse` returns, so the two can
be checked against each other.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ContentDelta",
    "ParsedOutput",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "collect_deltas",
    "json_object",
    "new_tool_call_id",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object as a string, as the OpenAI API carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A completion split into content and tool calls.

    Without tool calls `content` is the whole text, exactly. With tool calls it is the text outside the blocks
    (a malformed block counts as text) without trailing whitespace, or None when that is empty.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streaming: more content text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Streaming: part of tool call `index` (OpenAI `delta.tool_calls[i]`): first `id` and `name`, then
    `arguments` text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


ToolStreamDelta = ContentDelta | ToolCallDelta


class StreamingToolParser(Protocol):
    """Consumes a completion's text deltas and yields OpenAI-style content and tool-call deltas."""

    def feed(self, text: str) -> list[ToolStreamDelta]:
        """Consume the next text; return the deltas it made final."""
        ...

    def finish(self) -> list[ToolStreamDelta]:
        """The completion ended: return the deltas for what is still held."""
        ...


class ToolParser(Protocol):
    """A model's tool-call format (config `model.tool_parser`)."""

    def parse(self, text: str) -> ParsedOutput:
        """Split a whole completion into content and tool calls; never raises on malformed calls."""
        ...

    def streaming(self) -> StreamingToolParser:
        """A parser for one streamed completion; its deltas collect to what `parse` returns."""
        ...


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect_deltas(deltas: Sequence[ToolStreamDelta]) -> ParsedOutput:
    """Fold streamed deltas into the `ParsedOutput` they describe."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
            continue
        call = calls.setdefault(delta.index, ["", "", ""])
        call[0] = delta.id if delta.id is not None else call[0]
        call[1] = delta.name if delta.name is not None else call[1]
        call[2] += delta.arguments
    text = "".join(content)
    tool_calls = [ToolCall(*calls[index]) for index in sorted(calls)]
    return ParsedOutput(None if tool_calls and not text.strip() else text, tool_calls)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` holds, or None when it holds anything else or is not JSON."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
