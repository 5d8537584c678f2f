"""gpt-oss's tool calls: harmony messages to `functions.<name>`. Config name `openai` (vLLM's name)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from openai_harmony import HarmonyEncoding

from gateway.parsers.base import (
    ContentDelta,
    ParsedOutput,
    ToolCallDelta,
    Tools,
    ToolStreamDelta,
    collect_deltas,
    json_object,
    new_tool_call_id,
)
from gateway.parsers.harmony import (
    Body,
    End,
    HarmonyEvent,
    HarmonyReader,
    Header,
    Text,
    function_name,
    harmony_encoding,
    header_markup,
    is_answer,
)

__all__ = ["OpenAIStreamingToolParser", "OpenAIToolParser"]


class OpenAIToolParser:
    """gpt-oss's harmony format: each message to `functions.<name>` is a call of `<name>` whose body, a JSON
    object, is its arguments (kept as the model wrote them).

    It reads what the `gpt_oss` reasoning parser leaves (the answer as plain text, the calls as harmony markup)
    as well as a whole harmony completion (no reasoning parser): content is the text outside any message plus the
    bodies of the messages for the user (`final`, a `commentary` preamble); other messages (`analysis`) are
    dropped. A call whose body is not a JSON object, or whose name is empty, is content, markup and all. A call
    the completion never closed counts when its body is valid, unless the completion was `cut` (by max_tokens):
    then it is dropped (`unfinished`). `parse` is one `streaming()` pass, so both always agree.
    """

    reads_special_tokens = True
    turn_end_tokens: tuple[str, ...] = ("<|call|>",)  # a call ends the turn: vLLM also stops there

    def __init__(
        self, encoding: HarmonyEncoding | None = None, id_factory: Callable[[], str] = new_tool_call_id
    ) -> None:
        self._encoding = encoding if encoding is not None else harmony_encoding()
        self._id_factory = id_factory

    def parse(self, text: str, *, cut: bool = False, tools: Tools | None = None) -> ParsedOutput:
        stream = self.streaming()
        deltas = stream.feed(text) + stream.finish(cut=cut)
        return collect_deltas(deltas, unfinished=stream.unfinished)

    def streaming(self, *, tools: Tools | None = None) -> OpenAIStreamingToolParser:
        # Harmony's arguments are JSON: the request's tools type nothing here.
        return OpenAIStreamingToolParser(HarmonyReader(self._encoding), self._id_factory)


class _Route(Enum):
    CONTENT = auto()
    CALL = auto()
    DROP = auto()


class OpenAIStreamingToolParser:
    """The streaming `openai` parser: content goes out as it streams in; a call when its message closes (id and
    name, then the whole arguments), since a body that turns out not to be JSON is content."""

    def __init__(self, reader: HarmonyReader, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._reader = reader
        self._id_factory = id_factory
        self._route: _Route | None = None  # where the open message's body goes
        self._header: Header | None = None  # the open call's
        self._arguments: list[str] = []
        self._calls = 0
        self._unfinished = False

    def feed(self, text: str) -> list[ToolStreamDelta]:
        return self._route_events(self._reader.feed(text))

    def finish(self, *, cut: bool = False) -> list[ToolStreamDelta]:
        out = self._route_events(self._reader.finish())
        self._unfinished = self._route is _Route.CALL
        if self._unfinished and not cut:
            self._close_call("", out)
        self._route = None
        return out

    @property
    def unfinished(self) -> bool:
        return self._unfinished

    def _route_events(self, events: list[HarmonyEvent]) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        for event in events:
            if isinstance(event, Text):
                out.append(ContentDelta(event.text))
            elif isinstance(event, Header):
                self._open(event)
            elif isinstance(event, Body):
                if self._route is _Route.CONTENT:
                    out.append(ContentDelta(event.text))
                elif self._route is _Route.CALL:
                    self._arguments.append(event.text)
            elif isinstance(event, End):
                if self._route is _Route.CALL:
                    self._close_call(event.tag, out)
                self._route = None
        return out

    def _open(self, header: Header) -> None:
        if function_name(header) is not None:
            self._route, self._header, self._arguments = _Route.CALL, header, []
        else:
            self._route = _Route.CONTENT if is_answer(header) else _Route.DROP

    def _close_call(self, tag: str, out: list[ToolStreamDelta]) -> None:
        header, arguments = self._header, "".join(self._arguments)
        assert header is not None  # set with the CALL route
        name = function_name(header)
        if not name or json_object(arguments) is None:
            markup = header_markup(header.channel, header.recipient or "", header.content_type)
            out.append(ContentDelta(markup + arguments + tag))
            return
        out.append(ToolCallDelta(self._calls, id=self._id_factory(), name=name))
        out.append(ToolCallDelta(self._calls, arguments=arguments))
        self._calls += 1
