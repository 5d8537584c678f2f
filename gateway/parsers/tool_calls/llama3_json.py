"""The Llama 3.1/3.2 JSON tool-call format: the reply is the call, a bare JSON object, or several separated by `;`.

    {"name": "get_weather", "parameters": {"city": "Zürich"}}

Config name `llama3_json` (vLLM's). `<|python_tag|>` may come first (a special token: an OpenAI client's text
does not hold it, nor does the parser's).
"""

from __future__ import annotations

import re

from gateway.parsers.base import StreamingToolParser, ToolStreamDelta, json_object, new_tool_call_id
from gateway.parsers.tool_calls.arguments import ToolSchemas, json_call
from gateway.parsers.tool_calls.json_scan import JsonSpan
from gateway.parsers.tool_calls.stream import (
    BufferedStreamingParser,
    Call,
    DeltaWriter,
    IdFactory,
    OnePassToolParser,
    partial_marker_suffix,
)

__all__ = ["Llama3JsonStreamingToolParser", "Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"
_FIRST_LEAD = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")  # what may come before the first call
_NEXT_LEAD = re.compile(r"\s*(?:;\s*)?")  # and between calls


class Llama3JsonToolParser(OnePassToolParser):
    """The Llama JSON format. A reply whose first text (after whitespace, `<|python_tag|>`) is not `{` is all
    content. Otherwise each JSON object `{"name": ..., "parameters": {...}}` (or `"arguments"`) is a call, the
    whitespace and `;` around them markup; from an object that is not a valid call, or any other text after a
    call, on, the rest is content verbatim. A completion that ends inside an object is `unfinished`: cut by
    max_tokens, that object is dropped; else it is content (it cannot be valid JSON)."""

    def __init__(self, id_factory: IdFactory = new_tool_call_id) -> None:
        super().__init__(id_factory)

    def _stream(self, writer: DeltaWriter, schemas: ToolSchemas) -> StreamingToolParser:
        return Llama3JsonStreamingToolParser(writer)


class Llama3JsonStreamingToolParser(BufferedStreamingParser):
    """The streaming Llama JSON parser: a call goes out when its object closes; content once the text shows it is
    no call."""

    def __init__(self, writer: DeltaWriter) -> None:
        self._writer = writer
        self._buffer = ""
        self._span: JsonSpan | None = None  # the object being read
        self._text = False  # the rest is content
        self._unfinished = False

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        self._unfinished = self._span is not None
        if self._span is None:
            held = partial_marker_suffix(self._buffer, (PYTHON_TAG,)) if cut and not self._text else 0
            self._writer.content(self._buffer[: len(self._buffer) - held], out)
        elif not cut:  # an object that never closed: not a call
            self._writer.content(self._buffer, out)
        self._buffer, self._span = "", None
        self._writer.finish(out)
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        """Consume what the buffer decides; True when there may be more to do."""
        if self._text:
            self._writer.content(self._buffer, out)
            self._buffer = ""
            return False
        if self._span is None:
            return self._find_object()
        end = self._span.end(self._buffer)
        if end is None:
            return False
        call = json_call(json_object(self._buffer[self._span.start : end]))
        self._span = None
        if call is None:
            self._text = True
            return True
        self._writer.call(Call(*call), out)  # what came before it (whitespace, tag, separator) is markup
        self._buffer = self._buffer[end:]
        return True

    def _find_object(self) -> bool:
        """Outside an object: start the next one where the text allows one; True when decided."""
        first = self._writer.calls == 0
        lead = (_FIRST_LEAD if first else _NEXT_LEAD).match(self._buffer)
        at = lead.end() if lead is not None else 0
        rest = self._buffer[at:]
        if not rest or (first and PYTHON_TAG.startswith(rest)):
            return False  # only markup so far
        if rest[0] == "{":
            self._span = JsonSpan(at)
        else:
            self._text = True
        return True
