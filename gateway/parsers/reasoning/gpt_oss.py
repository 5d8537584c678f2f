"""gpt-oss's reasoning: the harmony `analysis` channel. Config name `gpt_oss`."""

from __future__ import annotations

from enum import Enum, auto

from openai_harmony import HarmonyEncoding

from gateway.parsers.base import (
    ContentDelta,
    ReasoningDelta,
    ReasoningOutput,
    ReasoningStreamDelta,
    collect_reasoning,
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

__all__ = ["GptOssReasoningParser", "GptOssStreamingReasoningParser"]


class GptOssReasoningParser:
    """gpt-oss's harmony messages split into reasoning and the rest.

    Reasoning: the bodies of the `analysis` messages (and of any message that is neither for the user nor a
    function call: a built-in tool's), one message per line. The rest, for the tool parser: the `final` channel's
    text (and a `commentary` preamble's) as plain text, and each call of a function (a message to
    `functions.<name>`) as harmony markup, `<|start|>assistant to=functions.<name><|channel|>commentary json
    <|message|>{...}<|call|>`, which the `openai` tool parser turns into a tool call. A request without tools runs
    no tool parser: such a call then reaches the client as that markup, as a hermes `<tool_call>` block would.
    Text outside any message is content. The encoding is loaded when the parser is made (`ConfigError` at startup
    when it cannot be); `parse` is one `streaming()` pass, so both always agree.
    """

    reads_special_tokens = True
    turn_end_tokens: tuple[str, ...] = ("<|call|>",)  # a call ends the turn: vLLM also stops there

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self._encoding = encoding if encoding is not None else harmony_encoding()

    def parse(self, text: str, prompt_tail: str = "") -> ReasoningOutput:
        stream = self.streaming(prompt_tail)
        return collect_reasoning(stream.feed(text) + stream.finish())

    def streaming(self, prompt_tail: str = "") -> GptOssStreamingReasoningParser:
        # The prompt always ends with `<|start|>assistant`: the completion opens a message's header.
        return GptOssStreamingReasoningParser(HarmonyReader(self._encoding))


class _Route(Enum):
    REASONING = auto()
    CONTENT = auto()
    CALL = auto()


class GptOssStreamingReasoningParser:
    """The streaming `gpt_oss` parser: reasoning and answer text go out as their bodies stream in; a call's markup
    goes out as content, its header once complete."""

    def __init__(self, reader: HarmonyReader) -> None:
        self._reader = reader
        self._route: _Route | None = None  # where the open message's body goes
        self._reasoned = False  # reasoning went out: the next reasoning message starts on a new line
        self._new_line = False

    def feed(self, text: str) -> list[ReasoningStreamDelta]:
        return self._route_events(self._reader.feed(text))

    def finish(self) -> list[ReasoningStreamDelta]:
        return self._route_events(self._reader.finish())

    def _route_events(self, events: list[HarmonyEvent]) -> list[ReasoningStreamDelta]:
        out: list[ReasoningStreamDelta] = []
        for event in events:
            if isinstance(event, Text):
                out.append(ContentDelta(event.text))
            elif isinstance(event, Header):
                self._open(event, out)
            elif isinstance(event, Body):
                self._body(event.text, out)
            elif isinstance(event, End):
                if self._route is _Route.CALL and event.tag:
                    out.append(ContentDelta(event.tag))
                self._route = None
        return out

    def _open(self, header: Header, out: list[ReasoningStreamDelta]) -> None:
        if function_name(header) is not None:
            self._route = _Route.CALL
            out.append(ContentDelta(header_markup(header.channel, header.recipient or "", header.content_type)))
        elif is_answer(header):
            self._route = _Route.CONTENT
        else:
            self._route, self._new_line = _Route.REASONING, self._reasoned

    def _body(self, text: str, out: list[ReasoningStreamDelta]) -> None:
        if self._route is not _Route.REASONING:
            out.append(ContentDelta(text))
            return
        if self._new_line:
            text, self._new_line = "\n" + text, False
        out.append(ReasoningDelta(text))
        self._reasoned = True
