"""The model's tokenizer, chat template, streaming detokenizer and tool-call parsers (DESIGN §7).

The gateway owns tokenization: it renders chat messages to ids with the model's own template, sends ids to the
engines, turns output ids back into text as they stream, and parses tool calls out of that text.

- `ChatTokenizer` loads `transformers.AutoTokenizer` from a local folder (offline) and renders messages to ids.
  `render_delta` is what multi-turn sessions build on: turn N+1 is the exact ids of turn N (prompt + sampled
  tokens) followed by only the ids the template adds for the new messages; `NotAPrefix` says that the new
  conversation does not extend the old one, so a new sample must start.
- `IncrementalDetokenizer` turns streamed ids into text without ever splitting a multi-byte character, and
  applies stop strings (OpenAI semantics); `make_stop_checker` backs `GenerationRequest.stop`.
- `ToolParser` / `StreamingToolParser` are the pluggable tool-call formats; `HermesToolParser` parses the
  hermes/Qwen `<tool_call>{json}</tool_call>` format; `get_tool_parser` looks one up by its config name.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import uuid
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Protocol, cast

from jinja2 import TemplateError
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.decoders import DecodeStream
from tokenizers.models import BPE

from gateway.encode_threads import EncodeThreads, encode_ids, encode_pieces, private_copy
from gateway.errors import ConfigError, GatewayError, InvalidRequest
from gateway.text_search import AnyOf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from gateway.generation import StopChecker

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]
"""An OpenAI-style chat message: `role`, `content`, and for assistants `tool_calls`, for tools `tool_call_id`."""
Tool = Mapping[str, Any]
"""An OpenAI-style tool definition: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

__all__ = [
    "ChatTokenizer",
    "ContentDelta",
    "ConversationMatch",
    "EncodedPrefix",
    "HermesStreamingToolParser",
    "HermesToolParser",
    "IncrementalDetokenizer",
    "Message",
    "NotAPrefix",
    "ParsedOutput",
    "Rendering",
    "StopMatch",
    "StopMatcher",
    "StopStringChecker",
    "StreamingToolParser",
    "TextCheck",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "VocabInfo",
    "collect_deltas",
    "get_tool_parser",
    "make_stop_checker",
]


@dataclass(frozen=True, slots=True)
class VocabInfo:
    """What request validation needs to know about the vocabulary."""

    vocab_size: int

    @classmethod
    def from_tokenizer_dir(cls, path: Path) -> VocabInfo:
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for unreadable files
            raise ConfigError(f"model.tokenizer: cannot load {file}: {exc}") from exc
        return cls(vocab_size=int(tokenizer.get_vocab_size(with_added_tokens=True)))


# --------------------------------------------------------------------------------------------------------------
# Chat template rendering
# --------------------------------------------------------------------------------------------------------------


class NotAPrefix(GatewayError):
    """The new conversation's ids do not start with the previous conversation's ids.

    Either the agent rewrote history (an earlier message, the system prompt or the tools changed) or the chat
    template is not prefix-stable for this pair (e.g. it drops reasoning from earlier turns). Not a client error:
    the sessions layer catches it and starts a new sample. `position` is the index of the first differing id.
    """

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(message)
        self.position = position


class ChatTokenizer:
    """The model's tokenizer and chat template, loaded from a local folder.

    Rendering goes through `apply_chat_template` and returns ids straight from the tokenizer. With
    `sanitize_control_tokens` (the default) control tokens that appear *inside* messages or tools (a tool result
    containing `<|im_end|>`, say) are encoded as ordinary text, so only the template itself can open or close a
    turn; `decode(render(m))` still equals the template's text.

    With `encode_threads` (>= 1), the async calls (`encode_async`, `render_async`) tokenize texts of at least
    `encode_thread_min_chars` characters in that many worker threads (`gateway.encode_threads`), so a long prompt
    does not hold the event loop; `close` stops them.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        *,
        sanitize_control_tokens: bool = True,
        encode_threads: int = 0,
        encode_thread_min_chars: int = 4096,
    ) -> None:
        if encode_threads < 0 or encode_thread_min_chars < 0:
            raise ValueError(
                f"encode_threads and encode_thread_min_chars must be >= 0, not {encode_threads}, "
                f"{encode_thread_min_chars}"
            )
        self._tok = tokenizer
        self._backend: Tokenizer = tokenizer.backend_tokenizer
        self._sanitize = sanitize_control_tokens
        eos = tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise ConfigError("model.tokenizer: the tokenizer has no eos_token")
        self._eos: int = eos
        self._vocab_size = len(tokenizer)  # computed by transformers on every call: keep it
        added = self._backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._end_of_turn = self._probe_end_of_turn()
        # What `ConversationMatch.by_text` needs: the texts of every added token, and of the stop tokens that can
        # end a turn's rendering, provided none of those strips whitespace around it (else: no text path).
        self._added_texts = tuple(token.content for token in added.values() if token.content)
        self._added_text_in = AnyOf(self._added_texts).in_value  # one pass over a conversation for all of them
        stops = [added.get(i) for i in self.stop_token_ids]
        exact = all(t is not None and not t.rstrip and not t.lstrip and not t.normalized for t in stops)
        stop_texts = tuple(t.content for t in stops if t is not None) if exact else ()
        # An added token that holds a stop token's text (and is longer) could match across the cut after it.
        inside = any(stop in text and stop != text for stop in stop_texts for text in self._added_texts)
        # How a text that follows a stop token is tokenized apart, as within the whole text (`encode_tail`): alone
        # (""), or after a stop token whose id is then dropped; None: neither, so no text path.
        lead = _tail_lead(self._backend, stop_texts) if stop_texts and not inside else None
        self._stop_texts = stop_texts if lead is not None else ()
        self._tail_lead = lead or ""
        self._exact_decoding = _decodes_exactly(self._backend)
        self._thread_min_chars = encode_thread_min_chars
        # After the probe above: transformers has set the tokenizer for the calls made here (no truncation, no
        # padding), and the copy takes those settings.
        self._threads = EncodeThreads(private_copy(self._backend), encode_threads) if encode_threads else None
        self.reused_ids = 0  # ids `encode_continuing` took from a prefix instead of tokenizing their text again

    @classmethod
    def load(
        cls,
        path: Path | str,
        *,
        sanitize_control_tokens: bool = True,
        encode_threads: int = 0,
        encode_thread_min_chars: int = 4096,
    ) -> ChatTokenizer:
        """Load `AutoTokenizer` from a local folder, never from the network (blocking: call it in a thread). The
        keywords are the constructor's."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        folder = Path(path)
        if not folder.exists():
            raise ConfigError(f"model.tokenizer: {folder} does not exist")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad folder
            raise ConfigError(f"model.tokenizer: cannot load a tokenizer from {folder}: {exc}") from exc
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ConfigError(f"model.tokenizer: {folder} has no fast (tokenizers) tokenizer")
        if tokenizer.chat_template is None:
            raise ConfigError(f"model.tokenizer: {folder} has no chat template")
        return cls(
            tokenizer,
            sanitize_control_tokens=sanitize_control_tokens,
            encode_threads=encode_threads,
            encode_thread_min_chars=encode_thread_min_chars,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def end_of_turn_id(self) -> int:
        """The id the template closes an assistant turn with (`<|im_end|>` for ChatML); the EOS if none."""
        return self._end_of_turn

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS and the template's end-of-turn token."""
        return tuple(sorted({self._eos, self._end_of_turn}))

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` that does the work (streaming decode uses it directly)."""
        return self._backend

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens added (special-token strings in `text` do become those tokens)."""
        # The Rust tokenizer directly: what transformers' fast encode runs, without its per-call Python wrapping.
        return encode_ids(self._backend, text)

    async def encode_async(self, text: str) -> list[int]:
        """`encode(text)`, in a worker thread if the text is long enough and threads were asked for."""
        if self._threads is None or len(text) < self._thread_min_chars:
            return encode_ids(self._backend, text)
        return await self._threads.encode(text)

    def encode_tail(self, text: str) -> list[int]:
        """The ids of `text` as they are within a longer text where it follows a stop token (what the text path
        tokenizes: `ConversationMatch.tail`, `encode_continuing`). Most tokenizers encode such a text alone; one
        that marks the input's first piece (SentencePiece's `Metaspace` with `prepend_scheme` "first") encodes it
        after a stop token, whose id is then dropped."""
        if not self._tail_lead:
            return encode_ids(self._backend, text)
        return encode_ids(self._backend, self._tail_lead + text)[1:]

    async def encode_tail_async(self, text: str) -> list[int]:
        """`encode_tail(text)`, in a worker thread as `encode_async` decides."""
        if not self._tail_lead:
            return await self.encode_async(text)
        return (await self.encode_async(self._tail_lead + text))[1:]

    async def render_async(self, messages: Sequence[Message], tools: Sequence[Tool] | None = None) -> list[int]:
        """`render(messages, tools)` (with the generation prompt), tokenized in a worker thread where `encode_async`
        would take the template's text there.

        With threads, that is the template's text encoded (`render_text`, then as `encode_async`), which gives
        `render`'s ids where no message or tool holds the text of an added token: then sanitizing changes nothing.
        A conversation that holds one, or a tokenizer without threads, is rendered by `render` on the calling
        thread."""
        if self._threads is None or self._added_text_in((messages, tools)):
            return self.render(messages, tools)
        return await self.encode_async(self.render_text(messages, tools))

    async def encode_continuing(
        self, text: str, prefix: EncodedPrefix | None
    ) -> tuple[list[int], EncodedPrefix | None]:
        """`encode(text)`, reusing the ids of `prefix` where `text` begins with its text; and the prefix of `text`
        for the next call (None where there is none).

        A raw completion agent sends its whole conversation again at every turn. Tokenizing only what follows the
        previous prompt's last stop token makes a turn cost what its new text costs, not the conversation. It rests
        on the property `ConversationMatch.by_text` uses: the tokenizer splits its input at added tokens first, so
        the ids of a text cut right after a stop token are the ids of its two parts. `_stop_texts` holds the stop
        tokens for which that is so (none that strips whitespace or that a longer added token holds, tails probed
        when the tokenizer loads); without them every text is tokenized whole. Texts of `encode_thread_min_chars`
        or more are tokenized in the worker threads, as by `encode_async`."""
        if not self._stop_texts:
            return await self.encode_async(text), None
        start, head = 0, None
        if prefix is not None and prefix.begins(text):
            start, head = prefix.length, prefix.ids
            self.reused_ids += len(head)
        cut = max((i + len(stop) for stop in self._stop_texts if (i := text.rfind(stop)) >= 0), default=-1)
        if cut <= start:  # no stop token after the reused beginning: the rest in one piece, the prefix as it was
            if head is None:
                return await self.encode_async(text), None
            return head.tolist() + await self.encode_tail_async(text[start:]), prefix
        # Both pieces in one call; each that follows a stop token as `encode_tail` takes it.
        lead = self._tail_lead
        leads = (lead if start else "", lead)
        pieces = [leads[0] + text[start:cut], lead + text[cut:]]
        if self._threads is not None and len(text) - start >= self._thread_min_chars:
            middle, rest = await self._threads.encode_pieces(pieces)
        else:
            middle, rest = encode_pieces(self._backend, pieces)
        ids = array("i", head) if head is not None else array("i")
        ids.extend(middle[1:] if leads[0] else middle)
        return ids.tolist() + (rest[1:] if lead else rest), EncodedPrefix.of(text, cut, ids)

    @property
    def thread_encodes(self) -> int:
        """Texts handed to the worker threads so far (one that concurrent callers share counts once)."""
        return 0 if self._threads is None else self._threads.encodes

    def close(self) -> None:
        """Stop the worker threads, if any (texts not started yet are dropped)."""
        if self._threads is not None:
            self._threads.close()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return cast(str, self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text for `messages` (what `render` tokenizes; `render_delta` compares texts with it)."""
        out = self._apply(messages, tools, add_generation_prompt, chat_template_kwargs, tokenize=False)
        return cast(str, out)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of `messages` rendered by the chat template.

        Messages are OpenAI-style dicts; assistant `tool_calls` may carry `arguments` as a JSON string (as the
        OpenAI API sends them) or as an object. A message or template the template rejects raises
        `InvalidRequest` naming `messages`.
        """
        out = self._apply(messages, tools, add_generation_prompt, chat_template_kwargs, tokenize=True)
        return cast("list[int]", out)

    def render_prefix(
        self,
        previous_messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids a finished conversation contributes to every longer one.

        That is `render(previous_messages, add_generation_prompt=False)` cut right after its last stop token: for
        ChatML it ends with the final assistant turn's `<|im_end|>`, without the `\\n` the template writes after
        it (the model stops at `<|im_end|>` and never samples that `\\n`). Empty history: `[]`.
        """
        if not previous_messages:
            return []
        ids = self.render(
            previous_messages, tools, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs
        )
        return ids[: _end_after_last(ids, self.stop_token_ids)]

    def render_delta(
        self,
        previous_messages: Sequence[Message],
        new_messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        previous_tools: Sequence[Tool] | None | EllipsisType = ...,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids to append to the previous turn's exact ids to prompt the next turn.

        `previous_messages` is the conversation of the previous turn including the assistant reply the model
        produced; `new_messages` is the WHOLE conversation of the new request (OpenAI clients resend the
        history), which must extend it. With `prefix = render_prefix(previous_messages)` and
        `full = render(new_messages)` (with the generation prompt), the result is `full[len(prefix):]`, after
        checking that `prefix` is a prefix of `full`; otherwise `NotAPrefix` is raised (history rewritten, system
        prompt or tools changed, or a template that is not prefix-stable for this pair) and the caller starts a
        new sample. `previous_tools` defaults to `tools`.

        The delta starts with whatever the template writes between the assistant's end-of-turn token and the next
        message, so the caller's ids stay exactly what the model saw; all delta ids get loss mask 0. ChatML, a
        user turn after the reply "Hello!" (`\\n` is a newline)::

            prompt of turn N  <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
                              <|im_start|>assistant\\n
            sampled (mask 1)  Hello!<|im_end|>
            delta (mask 0)    \\n<|im_start|>user\\nThanks<|im_end|>\\n<|im_start|>assistant\\n

        `prompt + sampled + delta == render(new_messages)` whenever the sampled ids are the template's own
        rendering of the reply. If the sampled ids do not end with a stop token (the turn was cut by
        `max_tokens`), the caller appends `end_of_turn_id` itself; the delta never contains the reply's tokens.
        """
        tools_before = tools if isinstance(previous_tools, EllipsisType) else previous_tools
        match = self.extension_of(new_messages, tools, chat_template_kwargs=chat_template_kwargs)
        delta = match.by_text(previous_messages, tools_before)
        if isinstance(delta, list):
            return delta
        return match.by_ids(previous_messages, tools_before)

    def extension_of(
        self,
        new_messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ConversationMatch:
        """`render_delta` of `new_messages` against one previous conversation or several (a session's samples,
        newest first): the new conversation is rendered at most once as text and once as ids."""
        return ConversationMatch(self, new_messages, tools, chat_template_kwargs)

    def _apply(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
        *,
        tokenize: bool,
    ) -> object:
        conversation = [_template_message(i, message) for i, message in enumerate(messages)]
        try:
            return self._tok.apply_chat_template(
                conversation,
                tools=[dict(tool) for tool in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=False,
                sanitize_control_tokens=self._sanitize and tokenize,
                **(chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as exc:  # the template rejects these messages
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc

    def _probe_end_of_turn(self) -> int:
        """Find the special token the template closes an assistant turn with by rendering a tiny conversation."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        try:
            ids = self.render(probe, add_generation_prompt=False)
        except InvalidRequest:  # a template with unusual demands: fall back to the EOS alone
            return self._eos
        return next((i for i in reversed(ids) if i in self._special_ids), self._eos)


@dataclass(frozen=True, slots=True)
class EncodedPrefix:
    """A text's beginning, up to right after its last stop token, with that beginning's ids: what a later text that
    begins the same way need not tokenize again (`ChatTokenizer.encode_continuing`). The beginning itself is kept as
    a digest (BLAKE2b, 128 bits), a few bytes instead of the whole conversation's text."""

    length: int  # characters
    digest: bytes
    ids: array[int]

    @classmethod
    def of(cls, text: str, length: int, ids: array[int]) -> EncodedPrefix:
        return cls(length, _digest(text[:length]), ids)

    def begins(self, text: str) -> bool:
        """Whether `text` begins with this prefix's text."""
        return len(text) >= self.length and _digest(text[: self.length]) == self.digest


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class TextCheck(enum.Enum):
    """Why `ConversationMatch.by_text` gave no delta."""

    UNDECIDED = "the text path does not apply; only the ids can tell"
    DIFFERENT = "the new text does not extend the previous text"


class ConversationMatch:
    """One new conversation, matched against previous ones (`ChatTokenizer.extension_of`).

    `by_text` tokenizes only the new tail where that provably gives the same ids as tokenizing both whole
    conversations, and `by_ids` is the reference that does tokenize both (`ChatTokenizer.render_delta` tries the
    first, then the second). The new conversation's text and ids are each rendered once, on first use.

    Tokenizing dominates rendering (a 40-turn, 47k-token conversation: ~0.5 ms to render the template's text,
    ~27 ms to tokenize it), and tokenizing the whole conversation at every turn makes an episode quadratic.
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
        tokenizer: ChatTokenizer,
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
        self._text_path = bool(tokenizer._stop_texts) and not tokenizer._added_text_in(
            (messages, tools, chat_template_kwargs)
        )

    @property
    def texts_decide(self) -> bool:
        """Whether `by_text`'s `DIFFERENT` is final: with byte-level BPE that normalizes nothing, adds no prefix space
        and has no unknown token, ids spell the text's bytes, so ids that extend the previous ones mean text that
        does (`_decodes_exactly`)."""
        return self._tokenizer._exact_decoding

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
            if not tok._added_text_in((previous_messages, previous_tools)):
                text = tok.render_text(previous_messages, previous_tools, False, chat_template_kwargs=self._kwargs)
                cut = max(text.rfind(stop) + len(stop) if stop in text else -1 for stop in tok._stop_texts)
                if cut >= 0:
                    memo.prefix_text = text[:cut]
        if not memo.prefix_text:
            return TextCheck.UNDECIDED
        if self._text is None:
            self._text = tok.render_text(self.messages, self.tools, True, chat_template_kwargs=self._kwargs)
        if not self._text.startswith(memo.prefix_text):
            return TextCheck.DIFFERENT
        return self._text[len(memo.prefix_text) :]

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


_TAIL_PROBES = ("hello", " hello", "\nhello", "\n\nx y", "Hello.", "  two  spaces", "\u2581x", "你好")


def _tail_lead(backend: Tokenizer, stop_texts: Sequence[str]) -> str | None:
    """How a text that follows a stop token is tokenized apart, as within the whole text: "" (alone), a stop
    token's text (after it, its id then dropped), or None (neither).

    The tokenizer splits its input at added tokens before anything else, but a pre-tokenizer may still treat the
    start of the input apart: SentencePiece's `Metaspace` with `prepend_scheme` "first" (what transformers builds
    for Llama-style tokenizers with `legacy: false`) prepends "▁" to the input's first piece only, so a tail
    encoded alone would begin with a "▁" the whole text does not have; after a stop token it is no longer the
    input's first piece. Probed on a few texts, since only the pipeline's parts together decide it."""
    for lead in ("", stop_texts[0]):
        if lead and len(encode_ids(backend, lead)) != 1:
            continue
        if all(
            encode_ids(backend, head + stop + tail)
            == encode_ids(backend, head + stop) + encode_ids(backend, lead + tail)[1 if lead else 0 :]
            for stop in stop_texts
            for head in ("", "hi")
            for tail in _TAIL_PROBES
        ):
            return lead
    return None


def _decodes_exactly(backend: Tokenizer) -> bool:
    """Whether different texts always give different ids: byte-level BPE (every byte its own symbol) that normalizes
    nothing, adds no prefix space (which would give "x" and " x" the same ids) and has no unknown token."""
    model, pre_tokenizer = backend.model, backend.pre_tokenizer
    if backend.normalizer is not None or pre_tokenizer is None:
        return False
    if not isinstance(backend.decoder, ByteLevelDecoder) or not isinstance(model, BPE) or model.unk_token is not None:
        return False
    steps = json.loads(pre_tokenizer.__getstate__())
    steps = steps.get("pretokenizers", [steps]) if steps.get("type") == "Sequence" else [steps]
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    return byte_level and not any(step.get("add_prefix_space") for step in steps)


def _end_after_last(ids: list[int], stops: Sequence[int]) -> int:
    """Index just past the last stop id in `ids`, or `len(ids)` if there is none."""
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] in stops:
            return index + 1
    return len(ids)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _template_message(index: int, message: Message) -> dict[str, Any]:
    """A copy of `message` in the shape chat templates expect (transformers' convention)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = _text_of_parts(index, content)
    tool_calls = out.get("tool_calls")
    if isinstance(tool_calls, list):
        out["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return out


def _text_of_parts(index: int, parts: list[Any]) -> str:
    """OpenAI content parts to one string; only text parts can be tokenized by a text-only template."""
    texts = []
    for part in parts:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequest("only text content parts are supported", param=f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _template_tool_call(call: Any) -> Any:
    """Templates expect `arguments` as an object (they `tojson` it); the OpenAI API sends a JSON string."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        parsed = _json_object(arguments) if arguments.strip() else {}
        function["arguments"] = arguments if parsed is None else parsed  # not a JSON object: as the agent sent it
    return {**call, "function": function}


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------------------------------------------
# Streaming detokenization and stop strings
# --------------------------------------------------------------------------------------------------------------

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
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        # Ids that can produce no text never enter the stream: it re-decodes everything it holds at every step,
        # so a degenerate run of them (a policy spamming <|endoftext|>) would cost O(n^2).
        self._silent = tokenizer.special_token_ids if skip_special_tokens else frozenset()
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


# --------------------------------------------------------------------------------------------------------------
# Tool-call parsers
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object as a string, as the OpenAI API carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A completion split into content and tool calls.

    Without tool calls `content` is the whole text, exactly. With tool calls it is the text outside the blocks
    (a malformed block counts as text) without trailing whitespace, or None when that is empty.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Streaming: more content text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """Streaming: part of tool call `index` (OpenAI `delta.tool_calls[i]`): first `id` and `name`, then
    `arguments` text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


ToolStreamDelta = ContentDelta | ToolCallDelta


class StreamingToolParser(Protocol):
    """Consumes a completion's text deltas and yields OpenAI-style content and tool-call deltas."""

    def feed(self, text: str) -> list[ToolStreamDelta]:
        """Consume the next text; return the deltas it made final."""
        ...

    def finish(self) -> list[ToolStreamDelta]:
        """The completion ended: return the deltas for what is still held."""
        ...


class ToolParser(Protocol):
    """A model's tool-call format (config `model.tool_parser`)."""

    def parse(self, text: str) -> ParsedOutput:
        """Split a whole completion into content and tool calls; never raises on malformed calls."""
        ...

    def streaming(self) -> StreamingToolParser:
        """A parser for one streamed completion; its deltas collect to what `parse` returns."""
        ...


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect_deltas(deltas: Sequence[ToolStreamDelta]) -> ParsedOutput:
    """Fold streamed deltas into the `ParsedOutput` they describe."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
            continue
        call = calls.setdefault(delta.index, ["", "", ""])
        call[0] = delta.id if delta.id is not None else call[0]
        call[1] = delta.name if delta.name is not None else call[1]
        call[2] += delta.arguments
    text = "".join(content)
    tool_calls = [ToolCall(*calls[index]) for index in sorted(calls)]
    return ParsedOutput(None if tool_calls and not text.strip() else text, tool_calls)


class HermesToolParser:
    """The hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of blocks.

    A block whose body is not a JSON object with a string `name` and object `arguments` stays in the content
    verbatim; so does text between and around blocks. A final block the completion never closed counts when its
    body is a valid call. `parse` is one `streaming()` pass, so both always agree.
    """

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._id_factory = id_factory

    def parse(self, text: str) -> ParsedOutput:
        stream = self.streaming()
        return collect_deltas(stream.feed(text) + stream.finish())

    def streaming(self) -> HermesStreamingToolParser:
        return HermesStreamingToolParser(self._id_factory)


class HermesStreamingToolParser:
    """The streaming hermes parser.

    Content is emitted as it arrives, except text that could be the start of `<tool_call>` and whitespace, which
    waits for more content (dropped when a tool call or the end comes first, unless there is no call at all,
    as `parse` drops it). A tool call is emitted when its
    block closes, as two deltas: id and name, then the whole arguments string; emitting earlier could announce
    a call whose JSON then turns out malformed, which `parse` treats as content.
    """

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self._id_factory = id_factory
        self._buffer = ""
        self._inside = False
        self._scan_from = 0  # where to look for the end tag next: the buffer before it cannot hold one
        self._held_space = ""
        self._calls = 0

    def feed(self, text: str) -> list[ToolStreamDelta]:
        self._buffer += text
        out: list[ToolStreamDelta] = []
        while self._advance(out):
            pass
        return out

    def finish(self) -> list[ToolStreamDelta]:
        out: list[ToolStreamDelta] = []
        if self._inside:
            self._close_block(self._buffer, out, closed=False)
        else:
            self._content(self._buffer, out)
        self._buffer, self._inside = "", False
        if self._held_space and self._calls == 0:  # no tool calls: the content is the text, exactly
            out.append(ContentDelta(self._held_space))
        self._held_space = ""
        return out

    def _advance(self, out: list[ToolStreamDelta]) -> bool:
        """Consume what the buffer decides; True when a tag was crossed and there may be more to do."""
        if self._inside:
            end = self._buffer.find(self.end_tag, self._scan_from)
            if end < 0:
                self._scan_from = max(0, len(self._buffer) - len(self.end_tag) + 1)
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self.end_tag) :]
            self._inside, self._scan_from = False, 0
            self._close_block(body, out, closed=True)
            return True
        start = self._buffer.find(self.start_tag)
        if start < 0:
            cut = len(self._buffer) - _partial_tag_suffix(self._buffer, self.start_tag)
            self._content(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
            return False
        self._content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(self.start_tag) :]
        self._inside = True
        return True

    def _close_block(self, body: str, out: list[ToolStreamDelta], *, closed: bool) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(self.start_tag + body + (self.end_tag if closed else ""), out)
            return
        name, arguments = call
        out.append(ToolCallDelta(self._calls, id=self._id_factory(), name=name))
        out.append(ToolCallDelta(self._calls, arguments=arguments))
        self._calls += 1

    def _content(self, text: str, out: list[ToolStreamDelta]) -> None:
        # Trailing whitespace waits for more content: before a tool call (or at the end after one) it is dropped.
        body = text.rstrip()
        if not body:
            self._held_space += text
            return
        out.append(ContentDelta(self._held_space + body))
        self._held_space = text[len(body) :]


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a block body, or None when it is not a valid call."""
    call = _json_object(body)
    if call is None or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        return (call["name"], arguments) if _json_object(arguments) is not None else None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


_TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The tool parser registered under `name` (config `model.tool_parser`)."""
    factory = _TOOL_PARSERS.get(name)
    if factory is None:
        known = ", ".join(sorted(_TOOL_PARSERS))
        raise ConfigError(f"model.tool_parser: unknown tool parser {name!r} (known: {known})")
    return factory()
