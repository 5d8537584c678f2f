"""Reasoning between think tags (`<think>…</think>`), the markup most reasoning families share; a `ThinkTagFormat`
holds what differs between them (see `gateway.parsers.reasoning.families`).

Where the completion starts. The chat template may open the reasoning itself: a generation prompt ending in
`<think>` (DeepSeek-R1's, Qwen3-Thinking-2507's) makes the completion start inside it, and one ending in
`<think></think>` (thinking switched off) outside it; the prompt's tail says which. Otherwise a start tag at the very
beginning of the completion (after whitespace, which is dropped with it) opens the reasoning; without one the
completion starts inside the reasoning only for formats whose start tag is optional (the model writes only the end
tag), else it is all content.

Inside the reasoning, the end tag ends it; so does an implicit end (markup that starts the answer, kept in it, such
as Kimi's tool-call section). A reasoning never closed (cut by max_tokens, or the model stopped) is all reasoning.
After it, the rest is content exactly, whitespace after the end tag included (as vLLM answers it). Empty reasoning
counts as none.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.parsers.base import ContentDelta, ReasoningDelta, ReasoningOutput, ReasoningStreamDelta, collect_reasoning

__all__ = ["ThinkTagFormat", "ThinkTagReasoningParser", "ThinkTagStreamingParser"]


@dataclass(frozen=True, slots=True)
class ThinkTagFormat:
    """One family's think-tag markup.

    `start_optional`: the model may begin reasoning without a start tag (a completion with no tag at all is then all
    reasoning). `implicit_ends`: markup that ends the reasoning without the end tag and begins the answer.
    `reads_special_tokens`: the tags are special tokens in the family's tokenizer (see `ReasoningParser`).
    """

    start_tag: str = "<think>"
    end_tag: str = "</think>"
    start_optional: bool = False
    implicit_ends: tuple[str, ...] = ()
    reads_special_tokens: bool = False


class ThinkTagReasoningParser:
    """A `ReasoningParser` for a `ThinkTagFormat`; `parse` is one `streaming()` pass, so both always agree."""

    def __init__(self, fmt: ThinkTagFormat) -> None:
        self.format = fmt
        self.reads_special_tokens = fmt.reads_special_tokens
        self.turn_end_tokens: tuple[str, ...] = ()

    def parse(self, text: str, prompt_tail: str = "") -> ReasoningOutput:
        stream = self.streaming(prompt_tail)
        return collect_reasoning(stream.feed(text) + stream.finish())

    def streaming(self, prompt_tail: str = "") -> ThinkTagStreamingParser:
        return ThinkTagStreamingParser(self.format, prompt_tail)


class _Phase(Enum):
    OPENING = "opening"  # the completion's first characters: whitespace, perhaps a start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkTagStreamingParser:
    """The streaming think-tag parser: reasoning and content are emitted as they arrive, except what could still be
    the start of a tag (and, at the very beginning, whitespace that may precede a start tag)."""

    def __init__(self, fmt: ThinkTagFormat, prompt_tail: str = "") -> None:
        self._format = fmt
        self._inside_first = _opened_by(prompt_tail, fmt)
        self._phase = _Phase.OPENING
        self._buffer = ""
        self._ends = (fmt.end_tag, *fmt.implicit_ends)

    def feed(self, text: str) -> list[ReasoningStreamDelta]:
        self._buffer += text
        out: list[ReasoningStreamDelta] = []
        if self._phase is _Phase.OPENING:
            self._open(final=False)
        if self._phase is _Phase.REASONING:
            self._reason(out, final=False)
        if self._phase is _Phase.CONTENT:
            _emit(out, ContentDelta, self._buffer)
            self._buffer = ""
        return out

    def finish(self) -> list[ReasoningStreamDelta]:
        out: list[ReasoningStreamDelta] = []
        if self._phase is _Phase.OPENING:
            self._open(final=True)
        if self._phase is _Phase.REASONING:
            self._reason(out, final=True)
        _emit(out, ContentDelta, self._buffer)
        self._buffer = ""
        return out

    def _open(self, *, final: bool) -> None:
        """Decide, from the completion's first characters, whether it opens with a start tag (dropped, with the
        whitespace before it); what is kept goes on to the phase chosen."""
        body = self._buffer.lstrip()
        tag = self._format.start_tag
        if body.startswith(tag):
            self._buffer, self._phase = body[len(tag) :], _Phase.REASONING
        elif final or (body and not tag.startswith(body)):
            self._phase = _Phase.REASONING if self._inside_first else _Phase.CONTENT

    def _reason(self, out: list[ReasoningStreamDelta], *, final: bool) -> None:
        """Emit the reasoning up to its end (the end tag dropped, an implicit end kept as content), holding back
        a possible partial end unless `final`."""
        found = [(at, end) for end in self._ends if (at := self._buffer.find(end)) >= 0]
        if found:
            at, end = min(found)
            _emit(out, ReasoningDelta, self._buffer[:at])
            kept = at if end != self._format.end_tag else at + len(end)
            self._buffer, self._phase = self._buffer[kept:], _Phase.CONTENT
            return
        held = 0 if final else max(_partial_suffix(self._buffer, end) for end in self._ends)
        _emit(out, ReasoningDelta, self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]


def _opened_by(prompt_tail: str, fmt: ThinkTagFormat) -> bool:
    """Whether the completion starts inside the reasoning before reading any of it: the prompt's last tag is a start
    tag, or the prompt shows no tag and the format's start tag is optional."""
    start, end = prompt_tail.rfind(fmt.start_tag), prompt_tail.rfind(fmt.end_tag)
    if start < 0 and end < 0:
        return fmt.start_optional
    return start > end


def _emit(out: list[ReasoningStreamDelta], kind: type[ReasoningDelta] | type[ContentDelta], text: str) -> None:
    if text:
        out.append(kind(text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
