"""What follows an assistant reply in the chat template's text: the template renders the conversation with the
last reply's content replaced by a mark, and the text after the reply's end is cut out.

The reply's own tokens are what the model sampled (the sample keeps them); only what the template writes after the
reply ends is new. The mark finds the reply (its content, and its last tool call's arguments: Llama 3's and
Mistral's templates write a reply with tool calls without its content); the first end-of-turn text after the last
mark ends the reply, and the text from there on is the suffix. A template whose turns end with the next message's
role token (GLM-4.5: `<|user|>`, `<|observation|>`: `ChatTokenizer.next_turn_ids`) has the suffix start with that
token, as `between_turns` expects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

# Text no template writes of its own (a turn whose new messages hold it is not continued from tokens).
REPLY_MARK = "rg-reply-mark-5c1e9b"

__all__ = ["REPLY_MARK", "anchored", "reply_tail"]


def anchored(conversation: Sequence[Message], *, reasoning: str | None = None) -> list[Message]:
    """`conversation` with its last message (the assistant's reply) reduced to the mark and its tool calls, the last
    one's arguments the mark: what a verified template writes after a reply depends on neither the reply's text nor
    its reasoning (`check_template`, which renders it with `reasoning` too)."""
    reply = conversation[-1]
    mark: Message = {"role": "assistant", "content": REPLY_MARK}
    if reasoning is not None:
        mark["reasoning_content"] = reasoning
    calls = reply.get("tool_calls")
    if calls:
        last = calls[-1]
        function = dict(last.get("function") or {})
        marked = {"mark": REPLY_MARK}
        function["arguments"] = json.dumps(marked) if isinstance(function.get("arguments"), str) else marked
        mark["tool_calls"] = [*calls[:-1], {**last, "function": function}]
    return [*conversation[:-1], mark]


def reply_tail(text: str, end_texts: Sequence[str], next_turn_texts: Sequence[str]) -> str | None:
    """The text after the marked reply's end in `text` (the template's rendering of `anchored` messages): after the
    first end-of-turn text that follows the last mark, or from the first next-turn text. None where there is no
    mark (a template that writes neither the reply's content nor its arguments) or no end follows it."""
    at = text.rfind(REPLY_MARK)
    if at < 0:
        return None
    start = at + len(REPLY_MARK)
    ends = [(i + len(end), i) for end in end_texts if (i := text.find(end, start)) >= 0]
    ends += [(i, i) for turn in next_turn_texts if (i := text.find(turn, start)) >= 0]
    if not ends:
        return None
    cut, _ = min(ends, key=lambda end: end[1])
    return text[cut:]
