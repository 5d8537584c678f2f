"""Parsers of what a model writes: tool calls (and, as they come, reasoning), selected by model family.

- `base`: the parsed shapes (`ToolCall`, `ParsedOutput`, the streamed `ContentDelta` / `ToolCallDelta`) and the
  `ToolParser` / `StreamingToolParser` protocols every tool-call parser implements.
- `tool_calls/`: one module per format (`hermes`: the hermes/Qwen `<tool_call>{json}</tool_call>` blocks).
- `reasoning/`: where reasoning parsers will go.
- `registry`: the parsers by their config name (vLLM's names); `get_tool_parser` looks one up.

Parsers work on a completion's text and never change the recorded ids.
"""

from __future__ import annotations

from gateway.parsers.base import (
    ContentDelta,
    ParsedOutput,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    collect_deltas,
    new_tool_call_id,
)
from gateway.parsers.registry import TOOL_PARSERS, ParserRegistry, get_tool_parser
from gateway.parsers.tool_calls.hermes import HermesStreamingToolParser, HermesToolParser

__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "HermesStreamingToolParser",
    "HermesToolParser",
    "ParsedOutput",
    "ParserRegistry",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "collect_deltas",
    "get_tool_parser",
    "new_tool_call_id",
]
