"""The model's tokenizer, chat template, conversation matching and streaming detokenizer (docs/architecture.md §7).

The gateway owns tokenization: it renders chat messages to ids with the model's own template, sends ids to the
engines, turns output ids back into text as they stream, and parses tool calls out of that text. One module per
concept, the public names re-exported here:

- `tokenizer`: `ChatTokenizer` loads `transformers.AutoTokenizer` from a local folder (offline), encodes and decodes,
  and renders messages to ids; `VocabInfo` is the vocabulary size alone.
- `chat_template`: messages in the shape chat templates expect, and the template applied to them.
- `conversation`: the prefix rule. `ChatTokenizer.render_delta` is what multi-turn sessions build on: turn N+1 is the
  exact ids of turn N (prompt + sampled tokens) followed by only the ids the template adds for the new messages;
  `NotAPrefix` says that the new conversation does not extend the old one, so a new sample must start.
- `text_path`: where the input can be cut after a stop token and each part tokenized apart (`EncodedPrefix`).
- `detokenizer`: `IncrementalDetokenizer` turns streamed ids into text without ever splitting a multi-byte
  character, and applies stop strings (OpenAI semantics); `make_stop_checker` backs `GenerationRequest.stop`.

The tool-call parsers live in `gateway.parsers` (`ToolParser`, `HermesToolParser`, `get_tool_parser`, ...); their
names are re-exported here too.
"""

from __future__ import annotations

from gateway.parsers import (
    ContentDelta,
    HermesStreamingToolParser,
    HermesToolParser,
    ParsedOutput,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    collect_deltas,
    get_tool_parser,
)
from gateway.tokenization.chat_template import Message, Tool
from gateway.tokenization.conversation import ConversationMatch, NotAPrefix, Rendering, TextCheck
from gateway.tokenization.detokenizer import (
    IncrementalDetokenizer,
    StopMatch,
    StopMatcher,
    StopStringChecker,
    make_stop_checker,
)
from gateway.tokenization.text_path import EncodedPrefix
from gateway.tokenization.tokenizer import ChatTokenizer, VocabInfo

__all__ = [
    "ChatTokenizer",
    "ContentDelta",
    "ConversationMatch",
    "EncodedPrefix",
    "HermesStreamingToolParser",
    "HermesToolParser",
    "IncrementalDetokenizer",
    "Message",
    "NotAPrefix",
    "ParsedOutput",
    "Rendering",
    "StopMatch",
    "StopMatcher",
    "StopStringChecker",
    "StreamingToolParser",
    "TextCheck",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "VocabInfo",
    "collect_deltas",
    "get_tool_parser",
    "make_stop_checker",
]
