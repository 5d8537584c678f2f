"""Generating a prepared turn's choices: each engine delta decoded to text and, for a chat turn, split into
reasoning, content and tool calls as it streams (`events`), or generated to the end at once (`run`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from gateway.generation import Delta, Generator
from gateway.parsers import (
    ContentDelta,
    ReasoningDelta,
    ReasoningStreamDelta,
    ToolCallDelta,
    ToolStreamDelta,
    collect_deltas,
    collect_reasoning,
)
from gateway.turns.prepared import Choice, ChoiceEvent, PreparedTurn

__all__ = ["events", "run"]


async def run(generator: Generator, prepared: PreparedTurn) -> None:
    """Generate every choice to the end (non-streaming). One choice without stop strings is generated in whole
    engine answers (`Generator.complete`) and decoded once at the end: the detokenizer turns ids into the same
    text in one feed as in one feed per delta (only its stop-string matching looks across feeds). A token-in/
    token-out turn is not decoded at all."""
    if len(prepared.choices) == 1 and prepared.choices[0].request.stop is None:
        choice = prepared.choices[0]
        await generator.complete(choice.request, choice.state)
        if prepared.decoded:
            _decoded(choice, choice.detokenizer.feed(choice.state.output_ids), None)
            _finish(choice)
        return
    async for _ in events(generator, prepared):
        pass


def events(generator: Generator, prepared: PreparedTurn) -> AsyncGenerator[ChoiceEvent, None]:
    """Text and tool-call deltas of all choices as they arrive, then one `finished` event per choice."""
    if len(prepared.choices) == 1:
        return _choice_events(generator, prepared.choices[0])  # no merging layer on the common path
    return _merged_events(generator, prepared)


async def _merged_events(generator: Generator, prepared: PreparedTurn) -> AsyncGenerator[ChoiceEvent, None]:
    queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in _choice_events(generator, choice):
                await queue.put(event)
            await queue.put(None)
        except BaseException as exc:  # handed to the consumer, which re-raises it (not a cleanup: nothing is held)
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(c)) for c in prepared.choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # results were consumed above


async def _choice_events(generator: Generator, choice: Choice) -> AsyncGenerator[ChoiceEvent, None]:
    stream = generator.stream(choice.request, choice.state)
    async with contextlib.aclosing(stream):
        async for delta in stream:
            yield _decoded(choice, choice.detokenizer.feed(delta.token_ids), delta)
    yield _finish(choice)


def _decoded(choice: Choice, text: str, delta: Delta | None) -> ChoiceEvent:
    choice.text += text
    if choice.reasoning_stream is None and choice.tool_stream is None:
        return ChoiceEvent(choice, text=text, delta=delta)
    event = ChoiceEvent(choice, delta=delta)
    if text:
        _split(choice, event, choice.reasoning_stream.feed(text) if choice.reasoning_stream else None, text)
    return event


def _split(choice: Choice, event: ChoiceEvent, reasoned: list[ReasoningStreamDelta] | None, text: str) -> None:
    """Add to `event` the reasoning the reasoning parser made of new text (`reasoned`; None: no such parser, the
    text is all content), and the content and tool calls the tool parser made of the rest."""
    if reasoned is not None:
        choice.reasoning_deltas += reasoned
        event.reasoning += "".join(d.text for d in reasoned if isinstance(d, ReasoningDelta))
        text = "".join(d.text for d in reasoned if isinstance(d, ContentDelta))
    if choice.tool_stream is None:
        event.text += text
    elif text:
        _add_tool_deltas(event, choice.tool_stream.feed(text))


def _add_tool_deltas(event: ChoiceEvent, deltas: list[ToolStreamDelta]) -> None:
    event.choice.tool_deltas += deltas
    event.text += "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    event.tool_deltas += [d for d in deltas if isinstance(d, ToolCallDelta)]


def _finish(choice: Choice) -> ChoiceEvent:
    tail = _decoded(choice, choice.detokenizer.flush(), None)
    cut = choice.state.finish_reason == "length"
    if choice.reasoning_stream is not None:
        _split(choice, tail, choice.reasoning_stream.finish(), "")
    if choice.tool_stream is not None:
        _add_tool_deltas(tail, choice.tool_stream.finish(cut=cut))
    content = choice.text
    if choice.reasoning_stream is not None:  # the streamed deltas are what `parse(text)` gives
        split = collect_reasoning(choice.reasoning_deltas)
        choice.reasoning, content = split.reasoning, split.content
    if choice.tool_stream is not None:  # the streamed deltas are what `parse(content)` gives, ids kept
        parsed = collect_deltas(choice.tool_deltas, unfinished=choice.tool_stream.unfinished)
        choice.content, choice.tool_calls = parsed.content, parsed.tool_calls
        choice.cut_in_tool_call = cut and parsed.unfinished
    else:
        choice.content = content
    tail.finished = True
    return tail
