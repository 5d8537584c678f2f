"""The DeepSeek-V3 tool-call format: special-token markup around each call, the arguments in a JSON code fence.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Zürich"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Config name `deepseek_v3` (vLLM's; DeepSeek-V3 and R1. V3.1's format, without the fence, is vLLM's
`deepseek_v31`).
"""

from __future__ import annotations

import re

from gateway.parsers.base import json_object, new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, arguments_json
from gateway.parsers.tool_calls.stream import Call, IdFactory
from gateway.parsers.tool_calls.tagged import TaggedFormat, TaggedToolParser

__all__ = ["DEEPSEEK_V3", "DeepSeekV3ToolParser"]

_CALL = re.compile(r"\s*function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def _read(body: str, _schemas: ToolSchemas) -> Call | None:
    """The call of a block body: `function<｜tool▁sep｜><name>`, then the arguments object in a fence."""
    call = _CALL.fullmatch(body)
    arguments = json_object(call.group(2)) if call is not None else None
    if call is None or arguments is None or not call.group(1).strip():
        return None
    return Call(call.group(1).strip(), arguments_json(arguments))


DEEPSEEK_V3 = TaggedFormat(
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    _read,
    section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
)


class DeepSeekV3ToolParser(TaggedToolParser):
    """The DeepSeek-V3 format (`TaggedToolParser`'s rules). Its markers are added tokens of DeepSeek's tokenizer;
    the parser reads the text with special tokens kept, so that it sees them whether or not they are marked
    special."""

    format = DEEPSEEK_V3
    reads_special_tokens = True

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)
