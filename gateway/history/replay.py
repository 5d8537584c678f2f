"""Whether a request's messages replay a session's conversation, and what they add to it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

__all__ = ["as_said", "replayed"]

# What agents echo back differently from what the gateway answered: the reply's reasoning (templates like Qwen3's
# drop it from earlier turns, and many agents never send it back).
_ECHOED_LOOSELY = ("reasoning_content", "reasoning")


def as_said(message: Message) -> Message:
    """A message without what agents echo back differently: an assistant reply's reasoning, empty fields."""
    drop = _ECHOED_LOOSELY if message.get("role") == "assistant" else ()
    return {key: value for key, value in message.items() if key not in drop and value not in (None, "")}


def replayed(conversation: Sequence[Message], messages: Sequence[Message]) -> list[Message] | None:
    """The messages that follow `conversation` in `messages` when `messages` start with it as said (`as_said`),
    and they add one or more messages none of which is an assistant's; else None."""
    size = len(conversation)
    if not size or len(messages) <= size:
        return None
    added = list(messages[size:])
    if any(message.get("role") == "assistant" for message in added):
        return None
    if any(as_said(old) != as_said(new) for old, new in zip(conversation, messages[:size], strict=True)):
        return None
    return added
