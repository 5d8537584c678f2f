"""What every streaming tool parser shares: the deltas it writes (`DeltaWriter`: content with its whitespace rule,
calls as id-and-name then arguments), the partial markup it must hold back, and `parse` as one streaming pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.parsers.base import (
    ContentDelta,
    ParsedOutput,
    StreamingToolParser,
    ToolCallDelta,
    Tools,
    ToolStreamDelta,
    collect_deltas,
)
from gateway.parsers.tool_calls.arguments import ToolSchemas

__all__ = ["BufferedStreamingParser", "Call", "DeltaWriter", "IdFactory", "OnePassToolParser", "partial_marker_suffix"]

IdFactory = Callable[[], str]


@dataclass(frozen=True, slots=True)
class Call:
    """One parsed call: `arguments` a JSON object as a string; `id` the model's own when its markup carries one
    (Kimi's `functions.add:0`), which its chat template writes back, else None (the parser makes one)."""

    name: str
    arguments: str
    id: str | None = None


class DeltaWriter:
    """Writes one completion's deltas.

    Content goes out as it comes, except trailing whitespace, which waits for more content: before a tool call (or
    at the end after one) it is dropped, so content is the text outside calls without trailing whitespace; with
    no call at all it goes out at the end, so content is the text exactly. Markup around calls (a section's
    markers, `markup`) waits likewise: dropped once a call comes, content if text or the end comes first. A call
    goes out whole, as two deltas: id and name, then the arguments.
    """

    def __init__(self, id_factory: IdFactory) -> None:
        self._id_factory = id_factory
        self._held: list[tuple[str, bool]] = []  # (text, is markup) waiting for what comes next
        self.calls = 0

    def content(self, text: str, out: list[ToolStreamDelta]) -> None:
        body = text.rstrip()
        if not body:
            self._held.append((text, False))
            return
        out.append(ContentDelta("".join(t for t, _ in self._held) + body))
        self._held = [(text[len(body) :], False)]

    def markup(self, text: str) -> None:
        if self.calls == 0:  # after a call, markup around calls is dropped at once
            self._held.append((text, True))

    def call(self, call: Call, out: list[ToolStreamDelta]) -> None:
        self._held = [(t, False) for t, markup in self._held if not markup]
        call_id = call.id if call.id is not None else self._id_factory()
        out.append(ToolCallDelta(self.calls, id=call_id, name=call.name))
        out.append(ToolCallDelta(self.calls, arguments=call.arguments))
        self.calls += 1

    def finish(self, out: list[ToolStreamDelta], *, drop_markup: bool = False) -> None:
        """The end: what is held goes out where no call came (`drop_markup`: but not the markup, which opened calls
        a cut ended)."""
        held = "".join(t for t, markup in self._held if not (markup and drop_markup))
        if held and self.calls == 0:  # no tool calls: the content is the text, exactly
            out.append(ContentDelta(held))
        self._held = []


def partial_marker_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (markup that may still
    be completed by the next text, so it must not go out as content yet)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class BufferedStreamingParser:
    """A streaming tool parser that buffers the text and consumes what the buffer decides (`_advance`, until it says
    there is no more to do); `finish` sets `_unfinished`."""

    _buffer: str = ""
    _unfinished: bool = False

    @property
    def unfinished(self) -> bool:
        return self._unfinished

    def feed(self, text: str) -> list[ToolStreamDelta]:
        self._buffer += text
        out: list[ToolStreamDelta] = []
        while self._advance(out):
            pass
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        """Consume what the buffer decides, writing into `out`; True when there may be more to do."""
        raise NotImplementedError


class OnePassToolParser:
    """A `ToolParser` whose `parse` is one pass of its own `streaming()` parser, so that the two always agree.
    Subclasses set `reads_special_tokens` (and `turn_end_tokens`) and make the streaming parser (`_stream`)."""

    reads_special_tokens = False
    turn_end_tokens: tuple[str, ...] = ()

    def __init__(self, id_factory: IdFactory) -> None:
        self._id_factory = id_factory

    def parse(self, text: str, *, cut: bool = False, tools: Tools | None = None) -> ParsedOutput:
        stream = self.streaming(tools=tools)
        deltas = stream.feed(text) + stream.finish(cut=cut)
        return collect_deltas(deltas, unfinished=stream.unfinished)

    def streaming(self, *, tools: Tools | None = None) -> StreamingToolParser:
        return self._stream(DeltaWriter(self._id_factory), ToolSchemas(tools))

    def _stream(self, writer: DeltaWriter, schemas: ToolSchemas) -> StreamingToolParser:
        raise NotImplementedError
