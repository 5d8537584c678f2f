"""`TokenHistory`: the ids a turn adds to its sample's exact ids when its messages replay the session's conversation
(`sessions.history: tokens`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.errors import InvalidRequest
from gateway.history.anchor import REPLY_MARK, anchored, reply_tail
from gateway.tokenization import ChatTokenizer

Message = dict[str, Any]
Tool = dict[str, Any]

__all__ = ["TokenHistory", "turn_end_texts", "writes_all"]

logger = logging.getLogger(__name__)

# How many sets of chat template arguments a `TokenHistory` remembers its verdict on (one check each).
MAX_CHECKED_ARGUMENTS = 64


def turn_end_texts(tokenizer: ChatTokenizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The texts that end a reply in the template's text: its stop tokens that are not next-turn tokens, and the
    next-turn tokens (`ChatTokenizer.next_turn_ids`)."""
    next_turn = set(tokenizer.next_turn_ids)
    ends = tuple(tokenizer.decode([i]) for i in tokenizer.stop_token_ids if i not in next_turn)
    return ends, tuple(tokenizer.decode([i]) for i in sorted(next_turn))


class TokenHistory:
    """A session's next prompt from tokens: the sample's ids as they are (the model's reasoning and stop token as
    sampled) and then what the chat template writes after a reply, for the new messages, up to the generation
    prompt. Templates that drop earlier reasoning (Qwen3, DeepSeek-R1) no longer start a new sample at each turn.

    Made by `token_history_for` once the template passed `check_template` with the configured template arguments
    (`checked`). A turn with other arguments (a request's `chat_template_kwargs` or reasoning effort: the template
    may write other text after a reply under them) goes on from tokens only once `check` passed with them too; it
    runs once per set of arguments (`MAX_CHECKED_ARGUMENTS` remembered), and where it fails those turns go the
    template's way, with one warning."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        family: str,
        *,
        checked: Mapping[str, Any] | None = None,
        check: Callable[[Mapping[str, Any] | None], bool] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.family = family
        self._ends, self._next_turns = turn_end_texts(tokenizer)
        self._check = check
        self._verdicts: dict[str, bool] = {_arguments_key(checked): True}

    def holds_for(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the suffix rule holds under these template arguments (checked once per set, `check`)."""
        key = _arguments_key(template_kwargs)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._check is None or self._check(template_kwargs)
            if not verdict:
                logger.warning(
                    "chat template arguments %s: the suffix rule does not hold under them; turns that set them are "
                    "prompted by the template (sessions.history: template for them)",
                    key,
                )
            if len(self._verdicts) < MAX_CHECKED_ARGUMENTS:
                self._verdicts[key] = verdict
        return verdict

    def suffix_text(
        self,
        conversation: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[Tool] | None,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str | None:
        """What the template writes after the conversation's last reply for `new` messages, generation prompt
        included; None where the text path cannot take it (a new message or tool holds an added token's text,
        which the template path sanitizes, or the mark), the template refuses the messages, or it writes one of
        them elsewhere (DeepSeek-R1's gathers every system message at the top: `writes_all`), or the rule does not
        hold under the template arguments (`holds_for`)."""
        if not self.holds_for(template_kwargs):
            return None
        tokenizer = self._tokenizer
        calls = conversation[-1].get("tool_calls")
        if tokenizer.text_path.added_text_in((new, tools, template_kwargs, calls)) or _holds_mark(new):
            return None
        messages = [*anchored(conversation), *new]
        try:
            text = tokenizer.render_text(messages, tools, True, chat_template_kwargs=template_kwargs)
        except InvalidRequest:
            return None  # the template path renders it again and answers the client's error
        suffix = reply_tail(text, self._ends, self._next_turns)
        return suffix if suffix is not None and writes_all(suffix, new) else None

    async def suffix_ids(
        self,
        conversation: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[Tool] | None,
        template_kwargs: Mapping[str, Any] | None,
    ) -> list[int] | None:
        """`suffix_text` tokenized as it follows a stop token (`ChatTokenizer.encode_tail_async`)."""
        text = self.suffix_text(conversation, new, tools, template_kwargs)
        return None if text is None else await self._tokenizer.encode_tail_async(text)


def writes_all(suffix: str, new: Sequence[Message]) -> bool:
    """Whether each new message's text is in the suffix, as it is or JSON-escaped (Llama 3's tool results): a
    template that writes a message elsewhere (before the reply) cannot be continued from tokens for it."""
    return all(text in suffix or json.dumps(text)[1:-1] in suffix for text in _texts(new))


def _texts(messages: Sequence[Message]) -> list[str]:
    texts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return texts


def _arguments_key(template_kwargs: Mapping[str, Any] | None) -> str:
    return json.dumps(template_kwargs or {}, sort_keys=True, default=str)


def _holds_mark(messages: Sequence[Message]) -> bool:
    return any(REPLY_MARK in str(message.get("content")) for message in messages)
