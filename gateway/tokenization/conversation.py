"""Conversation matching: whether a new conversation extends a previous one, and the ids it adds (the prefix rule).

For turn N+1 of a session the gateway reuses the exact ids of turn N (prompt + sampled tokens) and tokenizes only
what the new messages add. `ConversationMatch` finds those ids for one new conversation against previous ones; when
the new conversation does not extend a previous one, `NotAPrefix` says so and the session starts a new sample.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import GatewayError
from gateway.tokenization.chat_template import Message, Tool
from gateway.tokenization.text_path import TextPath


class Renderer(Protocol):
    """What matching a conversation needs of the tokenizer (`ChatTokenizer` is one)."""

    @property
    def text_path(self) -> TextPath: ...

    @property
    def next_turn_ids(self) -> tuple[int, ...]: ...

    def encode_tail(self, text: str) -> list[int]: ...

    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...

    def render_prefix(
        self,
        previous_messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


__all__ = ["ConversationMatch", "NotAPrefix", "Rendering", "TextCheck"]


class NotAPrefix(GatewayError):
    """The new conversation's ids do not start with the previous conversation's ids.

    Either the agent rewrote history (an earlier message, the system prompt or the tools changed) or the chat
    template is not prefix-stable for this pair (e.g. it drops reasoning from earlier turns). Not a client error:
    the sessions layer catches it and starts a new sample. `position` is the index of the first differing id.
    """

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(message)
        self.position = position


class TextCheck(enum.Enum):
    """Why `ConversationMatch.by_text` gave no delta."""

    UNDECIDED = "the text path does not apply; only the ids can tell"
    DIFFERENT = "the new text does not extend the previous text"


class ConversationMatch:
    """One new conversation, matched against previous ones (`ChatTokenizer.extension_of`).

    `by_text` tokenizes only the new tail where that provably gives the same ids as tokenizing both whole
    conversations, and `by_ids` is the reference that does tokenize both (`ChatTokenizer.render_delta` tries the
    first, then the second). The new conversation's text and ids are each rendered once, on first use.

    Tokenizing costs far more than rendering the template's text (figures: docs/benchmarks/sessions.md, "chat turns
    of long sessions"), and tokenizing the whole conversation at every turn makes an episode quadratic.
    The tokenizer splits its input at added tokens before normalizing and pre-tokenizing, so text that follows
    an added token without whitespace stripping is tokenized on its own: the ids of the tail that follows the
    previous turn's last stop token are the tail of the whole conversation's ids. That holds when (checked
    here) the stop tokens strip nothing and no longer added token holds one, the text after one is tokenized as
    within the whole text (`ChatTokenizer.encode_tail`: SentencePiece's `Metaspace` that prepends "▁" to the
    input's first piece only needs a stop token before it; probed when the tokenizer loads), the previous
    rendering ends with one, and no message, tool or template argument contains the text of an added token
    (which sanitization would encode as plain text, and which could fake the boundary).
    """

    def __init__(
        self,
        tokenizer: Renderer,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> None:
        self._tokenizer = tokenizer
        self.messages = messages
        self.tools = tools
        self._kwargs = chat_template_kwargs
        self._text: str | None = None
        self._ids: array[int] | None = None
        path = tokenizer.text_path
        self._text_path = bool(path.stop_texts) and not path.added_text_in((messages, tools, chat_template_kwargs))

    @property
    def texts_decide(self) -> bool:
        """Whether `by_text`'s `DIFFERENT` is final: with byte-level BPE that normalizes nothing, adds no prefix space
        and has no unknown token, ids spell the text's bytes, so ids that extend the previous ones mean text that
        does (`TextPath.exact_decoding`)."""
        return self._tokenizer.text_path.exact_decoding

    def by_text(
        self,
        previous_messages: Sequence[Message],
        previous_tools: Sequence[Tool] | None,
        memo: Rendering | None = None,
    ) -> list[int] | TextCheck:
        """The delta, tokenizing only the new tail; or why not (`DIFFERENT`: then the ids differ too, unless the
        tokenizer normalizes two different texts to the same ids). `memo`: see `Rendering`."""
        tail = self.tail(previous_messages, previous_tools, memo)
        return self._tokenizer.encode_tail(tail) if isinstance(tail, str) else tail

    def tail(
        self,
        previous_messages: Sequence[Message],
        previous_tools: Sequence[Tool] | None,
        memo: Rendering | None = None,
    ) -> str | TextCheck:
        """The text whose ids are `by_text`'s delta (for the caller to tokenize: `ChatTokenizer.encode_tail_async`),
        or why there is none."""
        tok = self._tokenizer
        if not previous_messages or not self._text_path:
            return TextCheck.UNDECIDED
        memo = self._memo(memo)
        if memo.prefix_text is None:
            memo.prefix_text = ""  # the text path does not apply to this conversation
            if not tok.text_path.added_text_in((previous_messages, previous_tools)):
                text = tok.render_text(previous_messages, previous_tools, False, chat_template_kwargs=self._kwargs)
                cut = max(text.rfind(stop) + len(stop) if stop in text else -1 for stop in tok.text_path.stop_texts)
                if tok.next_turn_ids:  # the reply ends the rendering; the next message's role token follows it
                    cut = len(text)
                if cut >= 0:
                    memo.prefix_text = text[:cut]
        if not memo.prefix_text:
            return TextCheck.UNDECIDED
        if self._text is None:
            self._text = tok.render_text(self.messages, self.tools, True, chat_template_kwargs=self._kwargs)
        if not self._text.startswith(memo.prefix_text):
            return TextCheck.DIFFERENT
        tail = self._text[len(memo.prefix_text) :]
        if tok.next_turn_ids and not tail.startswith(tok.text_path.stop_texts):
            return TextCheck.UNDECIDED  # the cut is not right before a stop token: only the ids can tell
        return tail

    def by_ids(
        self,
        previous_messages: Sequence[Message],
        previous_tools: Sequence[Tool] | None,
        memo: Rendering | None = None,
    ) -> list[int]:
        """The delta by tokenizing both whole conversations, or `NotAPrefix`. `memo`: see `Rendering`."""
        tok = self._tokenizer
        memo = self._memo(memo)
        if memo.prefix_ids is None:
            memo.prefix_ids = array(
                "i", tok.render_prefix(previous_messages, previous_tools, chat_template_kwargs=self._kwargs)
            )
        if self._ids is None:
            ids = tok.render(self.messages, self.tools, add_generation_prompt=True, chat_template_kwargs=self._kwargs)
            self._ids = array("i", ids)
        prefix, full = memo.prefix_ids, self._ids
        if full[: len(prefix)] != prefix:
            position = _first_difference(prefix, full)
            raise NotAPrefix(
                f"the new conversation does not extend the previous one (ids differ at {position} of {len(prefix)})",
                position=position,
            )
        return full[len(prefix) :].tolist()

    def _memo(self, memo: Rendering | None) -> Rendering:
        # A memo holds renderings without template arguments: with them, render afresh.
        return memo if memo is not None and self._kwargs is None else Rendering()


@dataclass(slots=True)
class Rendering:
    """What `ConversationMatch` rendered of one previous conversation with its own tools, kept by the owner of
    that conversation for the next matches (a session's sample between its turns); a new one whenever the
    conversation changes. Ids as 32-bit integers: a few bytes a token."""

    prefix_text: str | None = None  # up to its last stop token; "" where the text path does not apply
    prefix_ids: array[int] | None = None  # `ChatTokenizer.render_prefix`


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
