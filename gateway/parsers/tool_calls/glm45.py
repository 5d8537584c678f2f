"""The GLM-4.5 tool-call format: hermes's tags around the function name and key/value argument pairs.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Zürich</arg_value>
    </tool_call>

Config name `glm45` (vLLM's). An argument's text is a string where the tool's JSON schema says so, else the JSON
value it holds (the template writes non-strings with `tojson`), else the text (vLLM's rule).
"""

from __future__ import annotations

import re

from gateway.parsers.base import new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, arguments_json
from gateway.parsers.tool_calls.stream import Call, IdFactory
from gateway.parsers.tool_calls.tagged import TaggedFormat, TaggedToolParser

__all__ = ["GLM45", "Glm45ToolParser"]

_NAME = re.compile(r"\s*([\w.\-]+)[ \t]*(?=\n|<arg_key>|$)")
_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _read(body: str, schemas: ToolSchemas) -> Call | None:
    """The call of a block body: the function name on the first line, then only `<arg_key>`/`<arg_value>`
    pairs; anything else is malformed."""
    head = _NAME.match(body)
    if head is None:
        return None
    name = head.group(1)
    arguments = {}
    at = head.end()
    while (pair := _ARGUMENT.match(body, at)) is not None:
        key = pair.group(1).strip()
        arguments[key] = schemas.value(name, key, pair.group(2).strip(), untyped_json=True)
        at = pair.end()
    if body[at:].strip():
        return None
    return Call(name, arguments_json(arguments))


GLM45 = TaggedFormat("<tool_call>", "</tool_call>", _read)


class Glm45ToolParser(TaggedToolParser):
    """The GLM-4.5 format (`TaggedToolParser`'s rules; a block that is not a name and argument pairs is
    malformed)."""

    format = GLM45

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)
