"""The Qwen3-Coder tool-call format: XML-like calls inside hermes's tags, each argument as text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Zürich
    </parameter>
    </function>
    </tool_call>

Config name `qwen3_coder` (vLLM's). An argument's text is typed by the tool's JSON schema (the request's tools):
`<parameter=a>\\n7\\n</parameter>` is the number 7 where `a` is an integer, the string "7" where it is a string or
the schema does not say (vLLM's rule).
"""

from __future__ import annotations

import re

from gateway.parsers.base import new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, arguments_json
from gateway.parsers.tool_calls.stream import Call, IdFactory
from gateway.parsers.tool_calls.tagged import TaggedFormat, TaggedToolParser

__all__ = ["QWEN3_CODER", "Qwen3CoderToolParser"]

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _read(body: str, schemas: ToolSchemas) -> Call | None:
    """The call of a block body: one `<function=name>` holding only `<parameter=x>value</parameter>` elements
    (whitespace between them); anything else is malformed."""
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, params = function.group(1).strip(), function.group(2)
    arguments = {}
    at = 0
    while (parameter := _PARAMETER.match(params, at)) is not None:
        key = parameter.group(1).strip()
        arguments[key] = schemas.value(name, key, _unwrap(parameter.group(2)), untyped_json=False)
        at = parameter.end()
    if not name or params[at:].strip():
        return None
    return Call(name, arguments_json(arguments))


def _unwrap(value: str) -> str:
    """The template writes a value on lines of its own: one newline after the tag and one before the closing tag
    are markup."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


QWEN3_CODER = TaggedFormat("<tool_call>", "</tool_call>", _read)


class Qwen3CoderToolParser(TaggedToolParser):
    """The Qwen3-Coder format (`TaggedToolParser`'s rules; a block that is not one well-formed function is
    malformed)."""

    format = QWEN3_CODER

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)
