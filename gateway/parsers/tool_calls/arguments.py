"""Call arguments: a JSON call object checked (`json_call`), and the request's tools as parameter types
(`ToolSchemas`), for formats that write each argument as text (Qwen3-Coder's `<parameter=x>`, GLM's
`<arg_value>`) and so need the tool's JSON schema to tell the number 7 from the string "7"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.parsers.base import Tools, json_object

__all__ = ["ToolSchemas", "arguments_json", "json_call"]


def arguments_json(arguments: Mapping[str, Any]) -> str:
    """The arguments as the OpenAI API carries them: a JSON object string (non-ASCII kept as is)."""
    return json.dumps(arguments, ensure_ascii=False)


def json_call(call: dict[str, Any] | None) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a call object `{"name": ..., "arguments": {...}}` (or `"parameters"`, Llama's
    key; arguments absent: none), or None when it is not one: no non-empty string name, arguments not an object
    (nor a string holding one: some models write the arguments as a JSON string)."""
    if call is None or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        return (call["name"], arguments) if json_object(arguments) is not None else None
    if not isinstance(arguments, dict):
        return None
    return call["name"], arguments_json(arguments)


class ToolSchemas:
    """The JSON-schema types of each tool's parameters, from the request's tools (none: nothing is known)."""

    def __init__(self, tools: Tools | None = None) -> None:
        self._properties: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function", tool)
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            self._properties[function["name"]] = properties if isinstance(properties, Mapping) else {}

    def types(self, function: str, parameter: str) -> frozenset[str] | None:
        """The JSON types the schema allows for `parameter` of `function`; None when it says nothing."""
        schema = self._properties.get(function, {}).get(parameter)
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        if isinstance(kind, str):
            return frozenset({kind})
        if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
            return frozenset(kind)
        return None

    def value(self, function: str, parameter: str, text: str, *, untyped_json: bool) -> Any:
        """A parameter written as text, as its schema types it: a string where the schema allows one, else the
        JSON value the text holds (`7`, `true`, `[1, 2]`; a boolean also as `True`), else the text itself. A
        parameter the schema does not type is JSON when it holds JSON and `untyped_json` (GLM's rule), else the
        text (Qwen3-Coder's)."""
        types = self.types(function, parameter)
        if types is None:
            return _json_or_text(text) if untyped_json else text
        if "string" in types:
            return text
        if "boolean" in types and text.lower() in ("true", "false"):
            return text.lower() == "true"
        return _json_or_text(text)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text
