"""Whether a request's messages replay a session's conversation, and what they add to it.

Agents keep their own copy of the conversation and send it back with every turn, and few send it back byte for
byte as the gateway answered: the OpenAI SDK drops a reply's reasoning, frameworks re-serialize tool-call
arguments (other key order, other spacing), mint their own tool-call ids, strip whitespace or send a text as a
list of parts. `strict` forgives only what every template and client differ in (a reply's reasoning left out or
changed, empty fields); `loose` (`sessions.replay_match`, the default) forgives the rest of what is serialization
and not meaning (`Forgiven`), and counts each kind. Any other difference is an edit: the turn is no replay.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

Message = dict[str, Any]
ReplayMatch = Literal["loose", "strict"]

__all__ = ["Forgiven", "Replay", "ReplayMatch", "as_said", "replayed", "same_messages"]

# What agents echo back differently from what the gateway answered: the reply's reasoning (templates like Qwen3's
# drop it from earlier turns, and many agents never send it back).
_ECHOED_LOOSELY = ("reasoning_content", "reasoning")


class Forgiven(StrEnum):
    """A difference between a replayed message and the stored one that is serialization, not an edit."""

    REASONING = "reasoning"  # a reply's reasoning left out or sent back changed (both modes)
    ARGUMENTS = "arguments"  # tool-call arguments re-serialized: the same JSON value (loose)
    WHITESPACE = "whitespace"  # a text with other whitespace: the same words (loose)
    TOOL_CALL_ID = "tool_call_id"  # a tool call's id re-minted, and the tool results naming it (loose)
    CONTENT_PARTS = "content_parts"  # a text sent as a list of text parts, or back (loose)


@dataclass
class Replay:
    """Messages that replay a conversation: the ones they add (tool results naming a re-minted id renamed back to
    the id the conversation holds, which is the one the model saw) and the differences forgiven."""

    added: list[Message]
    forgiven: set[Forgiven] = field(default_factory=set)


def as_said(message: Message) -> Message:
    """A message without what agents echo back differently: an assistant reply's reasoning, empty fields."""
    drop = _ECHOED_LOOSELY if message.get("role") == "assistant" else ()
    return {key: value for key, value in message.items() if key not in drop and value not in (None, "")}


def replayed(
    conversation: Sequence[Message], messages: Sequence[Message], match: ReplayMatch = "loose"
) -> Replay | None:
    """`messages` as a replay of `conversation`: they start with its messages as said (under `match`) and add one
    or more messages none of which is an assistant's. None when they do not."""
    size = len(conversation)
    if not size or len(messages) <= size:
        return None
    added = list(messages[size:])
    if any(message.get("role") == "assistant" for message in added):
        return None
    matcher = _Matcher(match == "loose")
    pairs = zip(conversation, messages[:size], strict=True)
    if not all(old == new or matcher.same(old, new) for old, new in pairs):
        return None
    return Replay([matcher.renamed(message) for message in added], matcher.forgiven)


def same_messages(old: Message, new: Message, match: ReplayMatch = "loose") -> bool:
    """Whether `new` says what `old` says, under `match` (one message, ids not followed across messages)."""
    return old == new or _Matcher(match == "loose").same(old, new)


class _Matcher:
    """Compares messages pairwise along one conversation, remembering re-minted tool-call ids (new → stored)."""

    def __init__(self, loose: bool) -> None:
        self.loose = loose
        self.forgiven: set[Forgiven] = set()
        self.ids: dict[str, str] = {}

    def same(self, old: Message, new: Message) -> bool:
        if old.get("role") == "assistant" and _reasoning(old) != _reasoning(new):
            self.forgiven.add(Forgiven.REASONING)
        old, new = as_said(old), as_said(new)
        if old == new:
            return True
        if not self.loose or set(old) != set(new):
            return False
        return all(self._same_field(key, old[key], new[key]) for key in old)

    def renamed(self, message: Message) -> Message:
        """An added message with the tool-call id it answers renamed to the stored one, if it was re-minted."""
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str) and call_id in self.ids:
            return {**message, "tool_call_id": self.ids[call_id]}
        return message

    def _same_field(self, key: str, old: Any, new: Any) -> bool:
        if old == new:
            return True
        if key == "content":
            return self._same_content(old, new)
        if key == "tool_calls":
            return self._same_calls(old, new)
        if key == "tool_call_id":
            return self.ids.get(new) == old and self._forgive(Forgiven.TOOL_CALL_ID)
        return False

    def _same_content(self, old: Any, new: Any) -> bool:
        old_text, new_text = _text(old), _text(new)
        if old_text is None or new_text is None:
            return False
        if isinstance(old, list) != isinstance(new, list):
            self.forgiven.add(Forgiven.CONTENT_PARTS)
        return old_text == new_text or (old_text.split() == new_text.split() and self._forgive(Forgiven.WHITESPACE))

    def _same_calls(self, old: Any, new: Any) -> bool:
        if not isinstance(old, list) or not isinstance(new, list) or len(old) != len(new):
            return False
        return all(self._same_call(a, b) for a, b in zip(old, new, strict=True))

    def _same_call(self, old: Any, new: Any) -> bool:
        if not isinstance(old, dict) or not isinstance(new, dict):
            return False
        old_fn, new_fn = old.get("function") or {}, new.get("function") or {}
        if old_fn.get("name") != new_fn.get("name") or old.get("type", "function") != new.get("type", "function"):
            return False
        old_args, new_args = old_fn.get("arguments"), new_fn.get("arguments")
        if old_args != new_args:
            if _json_value(old_args) != _json_value(new_args) or _json_value(old_args) is _INVALID:
                return False
            self.forgiven.add(Forgiven.ARGUMENTS)
        old_id, new_id = old.get("id"), new.get("id")
        if old_id != new_id:
            if not isinstance(old_id, str) or not isinstance(new_id, str) or self.ids.get(new_id, old_id) != old_id:
                return False
            self.ids[new_id] = old_id
            self.forgiven.add(Forgiven.TOOL_CALL_ID)
        return True

    def _forgive(self, kind: Forgiven) -> bool:
        self.forgiven.add(kind)
        return True


def _reasoning(message: Message) -> Any:
    return next((message[key] for key in _ECHOED_LOOSELY if message.get(key) not in (None, "")), None)


def _text(content: Any) -> str | None:
    """A message's content as one text: a string, or a list of text parts joined as the gateway renders them
    (`gateway.tokenization.chat_template`: one per line); None for other parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(part.get("text", "")) for part in content)
    return None


_INVALID = object()


def _json_value(arguments: Any) -> Any:
    """Tool-call arguments as a JSON value (a string is parsed; an object is itself); `_INVALID` if unparsable."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return _INVALID
