"""The hermes/Qwen tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text.

Config name `hermes` (vLLM's name for the same format).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.parsers.base import (
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolStreamDelta,
    collect_deltas,
    json_object,
    new_tool_call_id,
)

__all__ = ["HermesStreamingToolParser", "HermesToolParser"]


class HermesToolParser:
    """The hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of blocks.

    A block whose body is not a JSON object with a string `name` and object `arguments` stays in the content
    verbatim; so does text between and around blocks. A final block the completion never closed counts when its
    body is a valid call, unless the completion was `cut` (by max_tokens): then it is dropped, as is a start tag
    the cut split. `parse` is one `streaming()` pass, so both always agree.
    """

    reads_special_tokens = False
    turn_end_tokens: tuple[str, ...] = ()

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._id_factory = id_factory

    def parse(self, text: str, *, cut: bool = False) -> ParsedOutput:
        stream = self.streaming()
        deltas = stream.feed(text) + stream.finish(cut=cut)
        return collect_deltas(deltas, unfinished=stream.unfinished)

    def streaming(self) -> HermesStreamingToolParser:
        return HermesStreamingToolParser(self._id_factory)


class HermesStreamingToolParser:
    """The streaming hermes parser.

    Content is emitted as it arrives, except text that could be the start of `<tool_call>` and whitespace, which
    waits for more content (dropped when a tool call or the end comes first, unless there is no call at all,
    as `parse` drops it). A tool call is emitted when its
    block closes, as two deltas: id and name, then the whole arguments string; emitting earlier could announce
    a call whose JSON then turns out malformed, which `parse` treats as content.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._id_factory = id_factory
        self._buffer = ""
        self._inside = False
        self._scan_from = 0  # where to look for the end tag next: the buffer before it cannot hold one
        self._held_space = ""
        self._calls = 0
        self._unfinished = False

    def feed(self, text: str) -> list[ToolStreamDelta]:
        self._buffer += text
        out: list[ToolStreamDelta] = []
        while self._advance(out):
            pass
        return out

    @property
    def unfinished(self) -> bool:
        return self._unfinished

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        self._unfinished = self._inside
        if self._inside and not cut:
            self._close_block(self._buffer, out, closed=False)
        elif not self._inside:
            held = _partial_tag_suffix(self._buffer, self.start_tag) if cut else 0
            self._content(self._buffer[: len(self._buffer) - held], out)
        self._buffer, self._inside = "", False
        if self._held_space and self._calls == 0:  # no tool calls: the content is the text, exactly
            out.append(ContentDelta(self._held_space))
        self._held_space = ""
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        """Consume what the buffer decides; True when a tag was crossed and there may be more to do."""
        if self._inside:
            end = self._buffer.find(self.end_tag, self._scan_from)
            if end < 0:
                self._scan_from = max(0, len(self._buffer) - len(self.end_tag) + 1)
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self.end_tag) :]
            self._inside, self._scan_from = False, 0
            self._close_block(body, out, closed=True)
            return True
        start = self._buffer.find(self.start_tag)
        if start < 0:
            cut = len(self._buffer) - _partial_tag_suffix(self._buffer, self.start_tag)
            self._content(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
            return False
        self._content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(self.start_tag) :]
        self._inside = True
        return True

    def _close_block(self, body: str, out: list[ToolStreamDelta], *, closed: bool) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(self.start_tag + body + (self.end_tag if closed else ""), out)
            return
        name, arguments = call
        out.append(ToolCallDelta(self._calls, id=self._id_factory(), name=name))
        out.append(ToolCallDelta(self._calls, arguments=arguments))
        self._calls += 1

    def _content(self, text: str, out: list[ToolStreamDelta]) -> None:
        # Trailing whitespace waits for more content: before a tool call (or at the end after one) it is dropped.
        body = text.rstrip()
        if not body:
            self._held_space += text
            return
        out.append(ContentDelta(self._held_space + body))
        self._held_space = text[len(body) :]


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a block body, or None when it is not a valid call."""
    call = json_object(body)
    if call is None or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        return (call["name"], arguments) if json_object(arguments) is not None else None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)
