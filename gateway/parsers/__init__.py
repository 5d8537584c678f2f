"""Parsers of what a model writes: reasoning and tool calls, selected by model family (docs/architecture.md §7).

- `base`: the parsed shapes (`ToolCall`, `ParsedOutput`, `ReasoningOutput`, the streamed `ContentDelta` /
  `ToolCallDelta` / `ReasoningDelta`) and the `ToolParser` / `ReasoningParser` protocols every parser implements.
- `tool_calls/`: one module per tool-call format (`hermes`: the hermes/Qwen `<tool_call>{json}</tool_call>` blocks;
  `qwen3_coder`, `glm45`, `kimi_k2`, `deepseek_v3`, `mistral`, `llama3_json`, on the shared `tagged` / `json_scan` /
  `stream` machinery; `openai`: gpt-oss's harmony calls).
- `reasoning/`: one module per reasoning format (`qwen3`, `deepseek_r1`, `glm45`, `kimi_k2`, all on the think-tag
  parser `think_tags`; `gpt_oss`: the harmony `analysis` channel).
- `harmony`: gpt-oss's harmony messages read from text with `openai-harmony`, for the two gpt-oss parsers.
- `registry`: the parsers by their config name (vLLM's names); `detect`: `auto`, the format a chat template shows.

Parsers work on a completion's text and never change the recorded ids.
"""

from __future__ import annotations

from gateway.parsers.base import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    ReasoningOutput,
    ReasoningParser,
    ReasoningStreamDelta,
    StreamingReasoningParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    collect_deltas,
    collect_reasoning,
    new_tool_call_id,
)
from gateway.parsers.registry import (
    AUTO,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ParserRegistry,
    get_reasoning_parser,
    get_tool_parser,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from gateway.parsers.tool_calls.hermes import HermesStreamingToolParser, HermesToolParser

__all__ = [
    "AUTO",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ContentDelta",
    "HermesStreamingToolParser",
    "HermesToolParser",
    "ParsedOutput",
    "ParserRegistry",
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
    "collect_deltas",
    "collect_reasoning",
    "get_reasoning_parser",
    "get_tool_parser",
    "new_tool_call_id",
    "resolve_reasoning_parser",
    "resolve_tool_parser",
]
