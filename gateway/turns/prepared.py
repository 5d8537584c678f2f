"""A turn ready to generate (`PreparedTurn`) and its choices (`Choice`), each generation's text decoded and split as
it streams (`ChoiceEvent`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.generation import Delta, GenerationRequest, GenerationState
from gateway.parsers import (
    ReasoningStreamDelta,
    StreamingReasoningParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolStreamDelta,
)
from gateway.session.open_turn import OpenTurn
from gateway.session.samples import Turn
from gateway.tokenization import IncrementalDetokenizer

__all__ = ["Choice", "ChoiceEvent", "PreparedTurn", "assistant_message"]


@dataclass(slots=True)
class Choice:
    """One of the n generations of a turn, with its text decoded as it streams and split, for a chat turn, into
    reasoning (`reasoning_stream`), then content and tool calls (`tool_stream`)."""

    index: int
    turn: Turn
    request: GenerationRequest
    state: GenerationState
    detokenizer: IncrementalDetokenizer
    tool_stream: StreamingToolParser | None
    reasoning_stream: StreamingReasoningParser | None = None
    prompt_tail: str = ""
    text: str = ""
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut_in_tool_call: bool = False  # max_tokens ended the reply inside a tool call, which was dropped
    # What `tool_stream` made: the reply's content and calls are these collected, so that the ids a streamed reply
    # sent are the ids its recorded message holds (the chat templates of some families write them back).
    tool_deltas: list[ToolStreamDelta] = field(default_factory=list)
    reasoning_deltas: list[ReasoningStreamDelta] = field(default_factory=list)  # what `reasoning_stream` made

    @property
    def finish_reason(self) -> str:
        """OpenAI's: `length` when cut by max_tokens inside a tool call, else `tool_calls` when it made calls, else
        the engine's (`stop`, `length`, `abort`)."""
        if self.cut_in_tool_call:
            return "length"
        if self.tool_calls:
            return "tool_calls"
        return self.state.finish_reason or "stop"


@dataclass(slots=True)
class ChoiceEvent:
    """What changed in one choice: new content (`text`), reasoning or tool-call deltas, new token logprobs, or its
    end."""

    choice: Choice
    text: str = ""
    tool_deltas: list[ToolCallDelta] = field(default_factory=list)
    delta: Delta | None = None
    finished: bool = False
    reasoning: str = ""


@dataclass(slots=True)
class PreparedTurn:
    """A turn ready to generate. `session_id`: the session named (or made up) for the request; the choices' turns
    are in it, or in the sessions of its group (`group_id` set). `handle`: the open turn, which holds the sessions'
    locks and the caller's slot, and records this turn when it closes (`close`). `decoded`: the reply is decoded to
    text and recorded as a chat message in the sample (False for a token-in/token-out turn)."""

    session_id: str
    one_turn: bool
    choices: list[Choice]
    prompt_ids: list[int]
    handle: OpenTurn
    group_id: str | None = None
    decoded: bool = True

    def replies(self) -> Iterator[tuple[Turn, GenerationState, dict[str, Any] | None]]:
        """Per choice, what its sample records: its turn, its generation, and the reply to keep as the sample's
        conversation (None: a token-in/token-out turn, or a cancelled one)."""
        for choice in self.choices:
            recorded = self.decoded and choice.state.finished
            yield choice.turn, choice.state, assistant_message(choice) if recorded else None

    async def close(self) -> None:
        """Record the turn and release what it holds, once (`OpenTurn.aclose`)."""
        await self.handle.aclose()


def assistant_message(choice: Choice) -> dict[str, Any]:
    """The reply as the agent receives it (and echoes back next turn)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls
        ]
    return message
