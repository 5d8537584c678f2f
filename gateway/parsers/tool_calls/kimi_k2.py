"""The Kimi K2 tool-call format: special-token markup, a section of calls each named by its id.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|>

Config name `kimi_k2` (vLLM's). The id (`functions.<name>:<index>`) is the call's OpenAI id, as vLLM gives it: the
chat template writes a call's id back into the conversation, so the model sees its own ids next turn.
"""

from __future__ import annotations

import re

from gateway.parsers.base import json_object, new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, arguments_json
from gateway.parsers.tool_calls.stream import Call, IdFactory
from gateway.parsers.tool_calls.tagged import TaggedFormat, TaggedToolParser

__all__ = ["KIMI_K2", "KimiK2ToolParser"]

_CALL = re.compile(r"\s*(([^\s<]+):\d+)\s*<\|tool_call_argument_begin\|>(.*)", re.DOTALL)


def _read(body: str, _schemas: ToolSchemas) -> Call | None:
    """The call of a block body: `<id><|tool_call_argument_begin|><JSON object>`, the id `functions.<name>:<n>`
    (or `<name>:<n>`)."""
    call = _CALL.fullmatch(body)
    arguments = json_object(call.group(3)) if call is not None else None
    if call is None or arguments is None:
        return None
    name = call.group(2).removeprefix("functions.")
    return Call(name, arguments_json(arguments), id=call.group(1)) if name else None


KIMI_K2 = TaggedFormat(
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    _read,
    section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
)


class KimiK2ToolParser(TaggedToolParser):
    """The Kimi K2 format (`TaggedToolParser`'s rules). Its markers are special tokens in Kimi's tokenizer, so the
    parser reads the text with them."""

    format = KIMI_K2
    reads_special_tokens = True

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)
