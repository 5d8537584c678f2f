"""Responses API items ↔ chat messages: a request's input items as the chat messages of a turn, and a turn's reply as
the output items of its answer.

The two directions agree: the output items of a reply, echoed back as input, are the assistant message the session
recorded (`gateway.turns.prepared.assistant_message`): a reasoning item is its `reasoning_content`, a message item its
`content`, function_call items its `tool_calls` (ids = `call_id`). Consecutive assistant-side items make one
assistant message: a reasoning item opens a new one, as does a message item after one that has content or calls.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.api.responses.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ReasoningItem,
    TextPart,
)
from gateway.turns.prepared import Choice

__all__ = ["ItemIds", "chat_messages", "output_items", "reasoning_text"]

Message = dict[str, Any]


def _text(parts: list[TextPart]) -> str:
    return "".join(p.text for p in parts)


def reasoning_text(item: ReasoningItem) -> str | None:
    """The reasoning an item carries (its `content`), None if it carries none."""
    return None if item.content is None else "".join(c.text for c in item.content)


def chat_messages(items: list[InputItem]) -> list[Message]:
    """The chat messages of `items` (see the module docstring), as the template takes them
    (`ChatMessage.to_template`'s form)."""
    messages: list[Message] = []
    assistant: Message | None = None  # the assistant message the items so far are building

    def open_assistant() -> Message:
        message: Message = {"role": "assistant", "content": None}
        messages.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            assistant = open_assistant()
            reasoning = reasoning_text(item)
            if reasoning is not None:
                assistant["reasoning_content"] = reasoning
        elif isinstance(item, FunctionCallItem):
            assistant = assistant or open_assistant()
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            assistant.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            assistant = None
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif item.role == "assistant":
            if assistant is None or assistant["content"] is not None or "tool_calls" in assistant:
                assistant = open_assistant()
            assistant["content"] = _text(item.content)
        else:
            assistant = None
            role = "system" if item.role == "developer" else item.role  # as `ChatMessage.to_template` writes it
            messages.append({"role": role, "content": _text(item.content)})
    return messages


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(16)}"


@dataclass
class ItemIds:
    """The ids of one answer's output items, the same in its stream and in its final response. A function call's
    item id follows from its call id (`fc_<call id>`)."""

    reasoning: str = field(default_factory=lambda: _new_id("rs"))
    message: str = field(default_factory=lambda: _new_id("msg"))

    @staticmethod
    def function_call(call_id: str) -> str:
        return f"fc_{call_id}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": ItemIds.function_call(call_id),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(choice: Choice, ids: ItemIds) -> list[dict[str, Any]]:
    """The reply's output items: its reasoning, its text (always a message when there is no call), its calls."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items = []
    if choice.reasoning is not None:
        items.append(reasoning_item(ids.reasoning, choice.reasoning, status))
    if choice.content or not choice.tool_calls:
        items.append(message_item(ids.message, choice.content or "", status))
    items += [function_call_item(c.id, c.name, c.arguments) for c in choice.tool_calls]
    return items
