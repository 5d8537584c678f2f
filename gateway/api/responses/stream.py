"""The server-sent events of a streamed Responses API answer (`event: <type>` + `data: {type, sequence_number, ...}`):
`response.created`, `response.in_progress`, each output item as it grows (`output_item.added`, its content part,
text, reasoning-text or function-call-argument deltas), every item's `done` events once the reply ends, and
`response.completed` (or `response.incomplete`), sent by the route after the turn is recorded.

Items open in the order the reply makes them (reasoning, text, calls) and stay open to the end, since text may go on
after a call began; their ids are the final answer's (`ItemIds`), and a call's id is the one its first delta gave,
which is the recorded one too (`gateway.turns.choices` names the whole parse's calls as the stream did).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.api.responses.items import ItemIds, function_call_item, message_item, reasoning_item
from gateway.parsers import ToolCallDelta
from gateway.turns.prepared import ChoiceEvent

__all__ = ["ResponseEvents"]


@dataclass
class _Open:
    """An output item being streamed: its index, kind and what it holds so far."""

    index: int
    kind: str  # reasoning | message | function_call
    item_id: str
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass
class ResponseEvents:
    """Numbers the events of one answer and follows its open items. `ids`: the answer's item ids."""

    ids: ItemIds
    sequence: int = 0
    items: list[_Open] = field(default_factory=list)
    _reasoning: _Open | None = None
    _message: _Open | None = None
    _calls: dict[int, _Open] = field(default_factory=dict)  # by the tool parser's call index

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def opening(self, snapshot: dict[str, Any]) -> bytes:
        return self.event("response.created", response=snapshot) + self.event("response.in_progress", response=snapshot)

    def of(self, event: ChoiceEvent) -> bytes:
        """The events of what one turn event added."""
        out = b""
        if event.reasoning:
            out += self._delta(self._open_reasoning, event.reasoning, "response.reasoning_text.delta")
        if event.text:
            out += self._delta(self._open_message, event.text, "response.output_text.delta")
        for delta in event.tool_deltas:
            out += self._tool(delta)
        return out

    def _open_reasoning(self) -> tuple[_Open, bytes]:
        if self._reasoning is None:
            self._reasoning = self._add("reasoning", self.ids.reasoning)
            item = {
                "type": "reasoning",
                "id": self.ids.reasoning,
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            return self._reasoning, self._added(self._reasoning, item, {"type": "reasoning_text", "text": ""})
        return self._reasoning, b""

    def _open_message(self) -> tuple[_Open, bytes]:
        if self._message is None:
            self._message = self._add("message", self.ids.message)
            item = message_item(self.ids.message, "", "in_progress") | {"content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return self._message, self._added(self._message, item, part)
        return self._message, b""

    def _add(self, kind: str, item_id: str) -> _Open:
        found = _Open(len(self.items), kind, item_id)
        self.items.append(found)
        return found

    def _added(self, item: _Open, body: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        out = self.event("response.output_item.added", output_index=item.index, item=body)
        if part is not None:
            out += self.event(
                "response.content_part.added", item_id=item.item_id, output_index=item.index, content_index=0, part=part
            )
        return out

    def _delta(self, open_item: Callable[[], tuple[_Open, bytes]], text: str, kind: str) -> bytes:
        item, out = open_item()
        item.text += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return out + self.event(
            kind, item_id=item.item_id, output_index=item.index, content_index=0, delta=text, **extra
        )

    def _tool(self, delta: ToolCallDelta) -> bytes:
        out = b""
        call = self._calls.get(delta.index)
        if call is None:
            if delta.id is None:
                return b""  # arguments of a call never announced: the parser does not do that
            call = self._add("function_call", ItemIds.function_call(delta.id))
            call.call_id, call.name = delta.id, delta.name or ""
            self._calls[delta.index] = call
            out += self._added(call, function_call_item(delta.id, call.name, "", "in_progress"), None)
        if delta.arguments:
            call.text += delta.arguments
            out += self.event(
                "response.function_call_arguments.delta",
                item_id=call.item_id,
                output_index=call.index,
                delta=delta.arguments,
            )
        return out

    def closing(self, final: list[dict[str, Any]]) -> bytes:
        """The `done` events of every open item, each with its final form where the answer has one (`final`: the
        answer's output items), else with what was streamed."""
        by_id = {item["id"]: item for item in final}
        out = b""
        for item in self.items:
            done = by_id.get(item.item_id)
            where = {"item_id": item.item_id, "output_index": item.index}
            if item.kind == "function_call":
                done = done or function_call_item(item.call_id, item.name, item.text)
                out += self.event("response.function_call_arguments.done", **where, arguments=done["arguments"])
            elif item.kind == "message":
                done = done or message_item(item.item_id, item.text)
                part = done["content"][0]
                out += self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
                out += self.event("response.content_part.done", **where, content_index=0, part=part)
            else:
                done = done or reasoning_item(item.item_id, item.text)
                part = done["content"][0]
                out += self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                out += self.event("response.content_part.done", **where, content_index=0, part=part)
            out += self.event("response.output_item.done", output_index=item.index, item=done)
        return out
