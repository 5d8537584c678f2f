"""The Mistral tool-call format: `[TOOL_CALLS]` (a special token), then the calls in one of two forms.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}          (tokenizer v11 on: Mistral Small 3.2, Devstral)

Config name `mistral` (vLLM's). Mistral's templates require call ids of 9 letters and digits: a call gets the
model's own id (`"id"`, `[CALL_ID]`) where it wrote one, else a new one of that shape, as vLLM makes.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from gateway.parsers.base import StreamingToolParser, ToolStreamDelta, json_object
from gateway.parsers.tool_calls.arguments import ToolSchemas, arguments_json, json_call
from gateway.parsers.tool_calls.json_scan import JsonSpan
from gateway.parsers.tool_calls.stream import (
    BufferedStreamingParser,
    Call,
    DeltaWriter,
    IdFactory,
    OnePassToolParser,
    partial_marker_suffix,
)

__all__ = ["MistralStreamingToolParser", "MistralToolParser", "new_mistral_call_id"]

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
CALL_ID = "[CALL_ID]"
_HEAD = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?")  # what comes between [TOOL_CALLS] and [ARGS]
_HEAD_SO_FAR = re.compile(r"\s*[\w.\-]*(?:\[CALL_ID\][A-Za-z0-9]*)?")


def new_mistral_call_id() -> str:
    """A call id as Mistral's templates require: 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralToolParser(OnePassToolParser):
    """The Mistral format. After `[TOOL_CALLS]`, a JSON array of call objects (all valid, or the whole is
    malformed) or `name[ARGS]{arguments}`; a malformed one stays content verbatim, `[TOOL_CALLS]` included, and
    text around calls is content. A completion that ends after `[TOOL_CALLS]` before its calls closed is
    `unfinished`: cut by max_tokens, that part is dropped (as is a `[TOOL_CALLS]` the cut split); else it is
    content (it cannot be valid). `[TOOL_CALLS]` is a special token of Mistral's tokenizers: the parser reads the
    text with them."""

    reads_special_tokens = True

    def __init__(self, id_factory: IdFactory = new_mistral_call_id) -> None:
        super().__init__(id_factory)

    def _stream(self, writer: DeltaWriter, schemas: ToolSchemas) -> StreamingToolParser:
        return MistralStreamingToolParser(writer)


class MistralStreamingToolParser(BufferedStreamingParser):
    """The streaming Mistral parser: the calls of one `[TOOL_CALLS]` go out when their JSON closes."""

    def __init__(self, writer: DeltaWriter) -> None:
        self._writer = writer
        self._buffer = ""  # outside calls: undecided text; inside: what follows [TOOL_CALLS]
        self._inside = False
        self._span: JsonSpan | None = None
        self._unfinished = False

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        self._unfinished = self._inside
        if not self._inside:
            held = partial_marker_suffix(self._buffer, (TOOL_CALLS,)) if cut else 0
            self._writer.content(self._buffer[: len(self._buffer) - held], out)
        elif not cut:
            self._writer.content(TOOL_CALLS + self._buffer, out)
        self._buffer, self._inside, self._span = "", False, None
        self._writer.finish(out)
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        if not self._inside:
            start = self._buffer.find(TOOL_CALLS)
            keep = start if start >= 0 else len(self._buffer) - partial_marker_suffix(self._buffer, (TOOL_CALLS,))
            self._writer.content(self._buffer[:keep], out)
            self._buffer = self._buffer[keep + len(TOOL_CALLS) :] if start >= 0 else self._buffer[keep:]
            self._inside = start >= 0
            return self._inside
        if self._span is None:
            return self._find_json(out)
        end = self._span.end(self._buffer)
        if end is None:
            return False
        calls = _calls(self._buffer[: self._span.start], self._buffer[self._span.start : end])
        self._close(calls, end, out)
        return True

    def _find_json(self, out: list[ToolStreamDelta]) -> bool:
        """After [TOOL_CALLS]: find where the calls' JSON starts (an array, or the object after `name[ARGS]`); text
        that cannot lead to one makes [TOOL_CALLS] content, and the text after it is read as any other."""
        stripped = self._buffer.lstrip()
        if stripped.startswith("["):
            self._span = JsonSpan(len(self._buffer) - len(stripped))
            return True
        args = self._buffer.find(ARGS)
        if args < 0 and _may_become_head(self._buffer):
            return False  # the name may still be coming
        rest = self._buffer[args + len(ARGS) :].lstrip() if args >= 0 else ""
        if args < 0 or _HEAD.fullmatch(self._buffer[:args]) is None or (rest and not rest.startswith("{")):
            self._writer.content(TOOL_CALLS, out)
            self._inside = False
            return True
        if not rest:
            return False
        self._span = JsonSpan(len(self._buffer) - len(rest))
        return True

    def _close(self, calls: list[Call] | None, end: int, out: list[ToolStreamDelta]) -> None:
        """The [TOOL_CALLS] part ends at `end` of the buffer: its calls, or (None) content verbatim."""
        if calls is None:
            self._writer.content(TOOL_CALLS + self._buffer[:end], out)
        for call in calls or ():
            self._writer.call(call, out)
        self._buffer, self._inside, self._span = self._buffer[end:], False, None


def _may_become_head(text: str) -> bool:
    """Whether more text could make `text` (no [ARGS] yet) a `name[CALL_ID]id` head."""
    rest = text[_HEAD_SO_FAR.match(text).end() :]  # type: ignore[union-attr]  # the pattern matches any text
    return not rest or CALL_ID.startswith(rest) or ARGS.startswith(rest)


def _calls(head: str, value: str) -> list[Call] | None:
    """The calls of one [TOOL_CALLS]: `head` is what came before the JSON `value` (`name[ARGS]` or whitespace)."""
    if value.startswith("["):
        try:
            items: Any = json.loads(value)
        except (ValueError, RecursionError):
            return None
        calls = [_array_call(item) for item in items] if isinstance(items, list) and items else [None]
        return None if None in calls else [c for c in calls if c is not None]
    named = _HEAD.fullmatch(head.rstrip().removesuffix(ARGS))
    arguments = json_object(value)
    if named is None or arguments is None:
        return None
    return [Call(named.group(1), arguments_json(arguments), named.group(2))]


def _array_call(item: Any) -> Call | None:
    call = json_call(item) if isinstance(item, dict) else None
    if call is None:
        return None
    call_id = item.get("id")
    return Call(*call, id=call_id if isinstance(call_id, str) and call_id.isalnum() else None)
