"""The hermes/Qwen tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text.

Config name `hermes` (vLLM's name for the same format).
"""

from __future__ import annotations

from gateway.parsers.base import json_object, new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, json_call
from gateway.parsers.tool_calls.stream import Call, DeltaWriter, IdFactory
from gateway.parsers.tool_calls.tagged import TaggedFormat, TaggedStreamingToolParser, TaggedToolParser

__all__ = ["HERMES", "HermesStreamingToolParser", "HermesToolParser"]


def _read(body: str, _schemas: ToolSchemas) -> Call | None:
    call = json_call(json_object(body))
    return None if call is None else Call(*call)


HERMES = TaggedFormat("<tool_call>", "</tool_call>", _read)


class HermesToolParser(TaggedToolParser):
    """The hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of blocks.

    A block whose body is not a JSON object with a string `name` and object `arguments` is malformed; the rules
    for content, malformed and unclosed blocks and cuts are `TaggedToolParser`'s.
    """

    format = HERMES

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)


class HermesStreamingToolParser(TaggedStreamingToolParser):
    """The streaming hermes parser (what `HermesToolParser().streaming()` makes)."""

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(HERMES, DeltaWriter(id_factory), ToolSchemas())
