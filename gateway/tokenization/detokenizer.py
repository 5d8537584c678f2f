"""Streaming detokenization: output ids to text as they arrive, never splitting a character, with stop strings.

`IncrementalDetokenizer` turns streamed ids into text without ever splitting a multi-byte character and applies stop
strings (OpenAI semantics); `make_stop_checker` backs `GenerationRequest.stop`.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from gateway.errors import InvalidRequest

if TYPE_CHECKING:
    from gateway.generation import StopChecker
    from gateway.tokenization.tokenizer import ChatTokenizer

__all__ = ["IncrementalDetokenizer", "StopMatch", "StopMatcher", "StopStringChecker", "make_stop_checker"]

logger = logging.getLogger(__name__)

_PROMPT_CONTEXT = 8
"""Prompt ids the decode stream is primed with, so the first output token decodes in context (SentencePiece)."""
_MAX_HELD = 128
"""Ids the decode stream may hold for one unfinished character before their bytes are released as garbage."""


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string matched: keep the first `keep` output tokens (the one that completed `stop` is the last)."""

    stop: str
    keep: int


class StopMatcher:
    """Finds stop strings in text that arrives in pieces; pure text, no tokens.

    The match reported is the one that *completes* first (smallest end, then smallest start), so the answer does
    not depend on how the text was split into pieces.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._longest = max((len(stop) for stop in self.stops), default=0)
        self._first_chars = frozenset(stop[0] for stop in self.stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str) -> tuple[int, int, str] | None:
        """`(start, end, stop)` of the first stop string to complete in `text`, or None."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < (best[1], best[0])):
                best = (start, start + len(stop), stop)
        return best

    def holdback(self, text: str) -> int:
        """Index from which `text` must be held back: its longest suffix that could begin a stop string."""
        for index in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[index] in self._first_chars:
                tail = text[index:]
                if any(stop.startswith(tail) for stop in self.stops):
                    return index
        return len(text)


class IncrementalDetokenizer:
    """Turns output ids into text as they stream in, O(new tokens) per call.

    `feed` returns only new, final text: a multi-byte character split across tokens is held back until it is
    complete (the `tokenizers` `DecodeStream` keeps a sliding prefix window, like vLLM's detokenizer, and yields
    nothing while the decoded tail ends in U+FFFD), and nothing is ever emitted twice. `flush` returns what is
    still held at the end (an incomplete character becomes U+FFFD there). The concatenation of all returned
    text equals `decode(all ids, skip_special_tokens)` up to a stop string (for decoders whose output for more
    ids extends their output for fewer, as byte-level BPE's does). `skip_special_tokens` defaults to True: the
    text an OpenAI client sees. `prompt_ids` give the first output tokens their context (SentencePiece spaces).

    With `stop` strings (OpenAI semantics) text that could be the beginning of a stop string is held back too;
    when one matches, the text before it is returned, the stop string and everything after it never are,
    `stop_match` tells which matched and how many tokens to keep, and further ids are ignored.

    `silent_ids`: ids that add no text even when special tokens are kept (the end-of-turn tokens, for a model whose
    parsers read its other special tokens).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
        silent_ids: Iterable[int] = (),
    ) -> None:
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        # Ids that can produce no text never enter the stream: it re-decodes everything it holds at every step,
        # so a degenerate run of them (a policy spamming <|endoftext|>) would cost O(n^2).
        self._silent = (tokenizer.special_token_ids if skip_special_tokens else frozenset()) | frozenset(silent_ids)
        self._vocab_size = tokenizer.vocab_size
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._matcher = StopMatcher(stop)
        self._held_ids: list[int] = []  # ids whose text the stream has not released yet
        self._pending = ""  # released text held back because it could begin a stop string
        self._count = 0
        self.stop_match: StopMatch | None = None

    @property
    def num_tokens(self) -> int:
        """Ids consumed so far (after a stop match: the kept ones)."""
        return self._count

    def feed(self, ids: Sequence[int]) -> str:
        """Consume the next ids; return the text that became final."""
        if self.stop_match is not None or not ids:
            return ""
        if not self._matcher:
            self._count += len(ids)
            return "".join(piece for piece in map(self._step, ids) if piece)
        return self._feed_with_stops(ids)

    def flush(self) -> str:
        """End of the stream: return whatever is still held."""
        if self.stop_match is not None:
            return ""
        tail = self._backend.decode(self._held_ids, skip_special_tokens=self._skip) if self._held_ids else ""
        self._held_ids = []
        text = self._pending + tail
        self._pending = ""
        match = self._matcher.find(text) if self._matcher else None
        if match is None:
            return text
        self.stop_match = StopMatch(match[2], self._count)
        return text[: match[0]]

    def _feed_with_stops(self, ids: Sequence[int]) -> str:
        parts = [self._pending]
        length = len(self._pending)
        peek = ""
        visible: list[int] = []  # after each id: how much of `text + peek` exists
        for token_id in ids:
            piece = self._step(token_id)
            if piece:
                parts.append(piece)
                length += len(piece)
                peek = ""
            else:
                peek = self._peek()
            visible.append(length + len(peek))
        text = "".join(parts)
        match = self._matcher.find(text + peek)
        if match is not None:
            start, end, stop = match
            self._count += bisect_left(visible, end) + 1  # the id after which the whole stop string existed
            self.stop_match = StopMatch(stop, self._count)
            self._pending = ""
            return (text + peek)[:start]
        self._count += len(ids)
        hold = self._matcher.holdback(text)
        self._pending = text[hold:]
        return text[:hold]

    def _peek(self) -> str:
        """The complete characters among the ids the stream holds back for an unfinished one.

        A token can end a stop string and begin a multi-byte character ("x" + the first byte of "你"): the stop
        string exists after that token, although the stream releases its text only with the next one.
        """
        if not self._held_ids:
            return ""
        return self._backend.decode(self._held_ids, skip_special_tokens=self._skip).rstrip("\ufffd")

    def _step(self, token_id: int) -> str | None:
        if token_id in self._silent or token_id >= self._vocab_size:
            return None  # decodes to nothing (out-of-vocabulary ids: engines pad the embedding matrix)
        piece = self._stream_step(token_id)
        if piece is not None:
            self._held_ids.clear()
            return piece
        self._held_ids.append(token_id)
        if len(self._held_ids) <= _MAX_HELD:
            return None
        # No real character spans this many tokens: these bytes will never decode, so let them go as they are
        # rather than re-decoding an ever longer tail at every step.
        garbage = self._backend.decode(self._held_ids, skip_special_tokens=self._skip)
        self._held_ids.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return garbage

    def _stream_step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception when a decoder is not prefix-monotonic
            if "invalid prefix" not in str(exc).lower():
                raise
            logger.warning("detokenizer: %s; restarting the decode stream", exc)
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id)


class StopStringChecker:
    """A `StopChecker` for stop strings: called with all output ids so far, it feeds only the new ones to an
    `IncrementalDetokenizer` and returns the number of tokens to keep once a stop string matched.

    Output ids only ever grow (a resumed generation keeps its tokens); if a call passes fewer ids than seen
    before, the checker starts over from those ids.
    """

    def __init__(self, tokenizer: ChatTokenizer, stops: Sequence[str], *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stops = list(stops)
        self._skip = skip_special_tokens
        self._detokenizer = self._new_detokenizer()
        self._seen = 0

    def __call__(self, output_ids: list[int]) -> int | None:
        if len(output_ids) < self._seen:
            self._detokenizer, self._seen = self._new_detokenizer(), 0
        if self._detokenizer.stop_match is None and len(output_ids) > self._seen:
            self._detokenizer.feed(output_ids[self._seen :])
            self._seen = len(output_ids)
        match = self._detokenizer.stop_match
        return match.keep if match is not None else None

    @property
    def stop_match(self) -> StopMatch | None:
        return self._detokenizer.stop_match

    def _new_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tokenizer, skip_special_tokens=self._skip, stop=self._stops)


def make_stop_checker(
    tokenizer: ChatTokenizer, stops: Sequence[str], *, skip_special_tokens: bool = True
) -> StopChecker | None:
    """The `GenerationRequest.stop` callback for these stop strings, or None when there are none."""
    if not stops:
        return None
    return StopStringChecker(tokenizer, stops, skip_special_tokens=skip_special_tokens)
