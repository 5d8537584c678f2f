"""What every parser shares: the parsed shapes (whole and streamed) and the `ToolParser` / `ReasoningParser`
protocols.

A completion's text goes through two parsers, each whole (`parse`) or as the text streams in (`streaming`):
a reasoning parser splits it into reasoning and the rest (`ReasoningOutput`), and a tool parser splits that rest
into content and OpenAI-style tool calls (`ParsedOutput`). `collect_deltas` / `collect_reasoning` fold the streamed
deltas into what `parse` returns, so the two can be checked against each other.

A tool parser's `cut`: the completion was cut by `max_tokens`. A call it was inside is then dropped, neither a call
nor content (`ParsedOutput.unfinished` says one was), so the turn ends `length`, not `tool_calls`. Its `tools`: the
request's tools, for formats that write arguments as text and type them by the tool's JSON schema (Qwen3-Coder's
`<parameter=x>7</parameter>`); formats whose arguments are JSON ignore them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ContentDelta",
    "ParsedOutput",
    "ReasoningDelta",
    "ReasoningOutput",
    "ReasoningParser",
    "ReasoningStreamDelta",
    "StreamingReasoningParser",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "Tools",
    "collect_deltas",
    "collect_reasoning",
    "json_object",
    "new_tool_call_id",
]


Tools = Sequence[Mapping[str, Any]]
"""A request's tools, OpenAI-style: `{"type": "function", "function": {"name", "parameters": <JSON schema>}}`."""


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
    # The text ended inside a call (cut by max_tokens): with `cut` that call is in neither field.
    unfinished: bool = False


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

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        """The completion ended (`cut`: by max_tokens): return the deltas for what is still held."""
        ...

    @property
    def unfinished(self) -> bool:
        """After `finish`: the text ended inside a call."""
        ...


class ToolParser(Protocol):
    """A model's tool-call format (config `model.tool_parser`).

    `reads_special_tokens`: the format's markup is special tokens (Kimi's `<|tool_call_begin|>`, harmony's
    `<|channel|>`), so the text it parses keeps them (all but the end-of-turn ones); else they are left out, as an
    OpenAI client sees the text. `turn_end_tokens`: tokens of the format that end the model's turn besides the
    tokenizer's own (harmony's `<|call|>`): a chat turn asks the engine to stop at them too.
    """

    reads_special_tokens: bool
    turn_end_tokens: tuple[str, ...]

    def parse(self, text: str, *, cut: bool = False, tools: Tools | None = None) -> ParsedOutput:
        """Split a whole completion into content and tool calls; never raises on malformed calls."""
        ...

    def streaming(self, *, tools: Tools | None = None) -> StreamingToolParser:
        """A parser for one streamed completion; its deltas collect to what `parse` returns (given the same
        `tools`)."""
        ...


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Streaming: more reasoning text."""

    text: str


ReasoningStreamDelta = ReasoningDelta | ContentDelta


@dataclass(frozen=True, slots=True)
class ReasoningOutput:
    """A completion split into reasoning (None: the model did not reason) and the rest, which goes on to the tool
    parser. The markup around the reasoning (`<think>`, `</think>`, channel headers) is in neither."""

    reasoning: str | None
    content: str


class StreamingReasoningParser(Protocol):
    """Consumes a completion's text deltas and yields reasoning and content deltas."""

    def feed(self, text: str) -> list[ReasoningStreamDelta]:
        """Consume the next text; return the deltas it made final."""
        ...

    def finish(self) -> list[ReasoningStreamDelta]:
        """The completion ended: return the deltas for what is still held."""
        ...


class ReasoningParser(Protocol):
    """A model's reasoning format (config `model.reasoning_parser`).

    `prompt_tail`: the end of the prompt as text, special tokens kept (the last few tokens decoded), so that a
    parser can tell whether the chat template opened the reasoning already (a generation prompt ending in
    `<think>`: the completion starts inside it, with no start tag of its own). `reads_special_tokens`: as
    `ToolParser`'s, and so is `turn_end_tokens`.
    """

    reads_special_tokens: bool
    turn_end_tokens: tuple[str, ...]

    def parse(self, text: str, prompt_tail: str = "") -> ReasoningOutput:
        """Split a whole completion into reasoning and the rest; never raises."""
        ...

    def streaming(self, prompt_tail: str = "") -> StreamingReasoningParser:
        """A parser for one streamed completion; its deltas collect to what `parse` returns."""
        ...


def collect_reasoning(deltas: Sequence[ReasoningStreamDelta]) -> ReasoningOutput:
    """Fold streamed reasoning deltas into the `ReasoningOutput` they describe (reasoning None when none came)."""
    reasoning = [d.text for d in deltas if isinstance(d, ReasoningDelta)]
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return ReasoningOutput("".join(reasoning) if reasoning else None, content)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect_deltas(deltas: Sequence[ToolStreamDelta], *, unfinished: bool = False) -> ParsedOutput:
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
    return ParsedOutput(None if tool_calls and not text.strip() else text, tool_calls, unfinished)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` holds, or None when it holds anything else or is not JSON."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
