"""Formats whose calls are blocks between a start and an end marker (hermes's `<tool_call>…</tool_call>`, Kimi's
`<|tool_call_begin|>…<|tool_call_end|>`), optionally inside a section (Kimi's `<|tool_calls_section_begin|>…`):
one streaming parser for all of them, each format a `TaggedFormat` that says how to read one block's body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.parsers.base import ToolStreamDelta
from gateway.parsers.tool_calls.arguments import ToolSchemas
from gateway.parsers.tool_calls.stream import (
    BufferedStreamingParser,
    Call,
    DeltaWriter,
    OnePassToolParser,
    partial_marker_suffix,
)

__all__ = ["TaggedFormat", "TaggedStreamingToolParser", "TaggedToolParser"]

ReadCall = Callable[[str, ToolSchemas], Call | None]


@dataclass(frozen=True, slots=True)
class TaggedFormat:
    """A block format: `start` body `end`; `read` makes the call a body holds (None: malformed). `section`: the
    markers the model writes around all its calls, dropped from the content."""

    start: str
    end: str
    read: ReadCall
    section: tuple[str, str] | None = None

    @property
    def openers(self) -> tuple[str, ...]:
        """The markers looked for outside a block."""
        return (self.start, *(self.section or ()))


class TaggedToolParser(OnePassToolParser):
    """A block format's parser (`format`), the rules every such format keeps:

    A block whose body is not a valid call stays in the content verbatim, markers included; so does text between
    and around blocks. A block lasts until the first end marker. A final block the completion never closed counts
    when its body is a valid call, unless the completion was `cut` (by max_tokens): then it is dropped, as is a
    marker the cut split. Section markers are markup around calls (`DeltaWriter.markup`): dropped where calls come
    (content where none does); a completion that ends inside a block or an open section is `unfinished`.
    """

    format: TaggedFormat

    def _stream(self, writer: DeltaWriter, schemas: ToolSchemas) -> TaggedStreamingToolParser:
        return TaggedStreamingToolParser(self.format, writer, schemas)


class TaggedStreamingToolParser(BufferedStreamingParser):
    """The streaming parser of a block format: content goes out as it comes, except text that could be the start of
    a marker (and the whitespace `DeltaWriter` holds); a call goes out when its block closes, since emitting earlier
    could announce a call whose body then turns out malformed, which is content."""

    def __init__(self, fmt: TaggedFormat, writer: DeltaWriter, schemas: ToolSchemas) -> None:
        self._format = fmt
        self._writer = writer
        self._schemas = schemas
        self._buffer = ""
        self._inside = False
        self._in_section = False
        self._scan_from = 0  # where to look for the end marker next: the buffer before it cannot hold one
        self._unfinished = False

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        self._unfinished = self._inside or self._in_section
        if self._inside and not cut:
            self._close_block(self._buffer, out, closed=False)
        elif not self._inside:
            held = partial_marker_suffix(self._buffer, self._format.openers) if cut else 0
            self._writer.content(self._buffer[: len(self._buffer) - held], out)
        self._buffer, self._inside = "", False
        self._writer.finish(out, drop_markup=cut and self._unfinished)
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        """Consume what the buffer decides; True when a marker was crossed and there may be more to do."""
        if self._inside:
            end_marker = self._format.end
            end = self._buffer.find(end_marker, self._scan_from)
            if end < 0:
                self._scan_from = max(0, len(self._buffer) - len(end_marker) + 1)
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(end_marker) :]
            self._inside, self._scan_from = False, 0
            self._close_block(body, out, closed=True)
            return True
        found = [(at, marker) for marker in self._format.openers if (at := self._buffer.find(marker)) >= 0]
        if not found:
            keep = len(self._buffer) - partial_marker_suffix(self._buffer, self._format.openers)
            self._writer.content(self._buffer[:keep], out)
            self._buffer = self._buffer[keep:]
            return False
        at, marker = min(found)
        self._writer.content(self._buffer[:at], out)
        self._buffer = self._buffer[at + len(marker) :]
        if marker == self._format.start:
            self._inside = True
        else:
            self._writer.markup(marker)
            self._in_section = self._format.section is not None and marker == self._format.section[0]
        return True

    def _close_block(self, body: str, out: list[ToolStreamDelta], *, closed: bool) -> None:
        call = self._format.read(body, self._schemas)
        if call is None:
            self._writer.content(self._format.start + body + (self._format.end if closed else ""), out)
        else:
            self._writer.call(call, out)
