"""`ChatTokenizer`: the model's tokenizer and chat template, loaded from a local folder; `VocabInfo`.

It encodes and decodes text (long texts in worker threads, `gateway.encode_threads`), renders chat messages to ids
with the model's own template (`chat_template`), and matches a new conversation against previous ones
(`conversation`): `render_delta` is what multi-turn sessions build on.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, cast

from tokenizers import Tokenizer

from gateway.encode_threads import EncodeThreads, encode_ids, encode_pieces, private_copy
from gateway.errors import ConfigError, InvalidRequest
from gateway.tokenization.chat_template import Message, Tool, apply_chat_template
from gateway.tokenization.conversation import ConversationMatch
from gateway.tokenization.text_path import EncodedPrefix, TextPath

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["ChatTokenizer", "VocabInfo"]


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


COUNT_CHUNK_CHARS = 1 << 16  # characters tokenized at a time by `count_at_least`


def _chunks(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, each cut after its last whitespace where it has some."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            space = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
            end = space + 1 if space > start else end
        yield text[start:end]
        start = end


def _pieces(texts: Iterable[str], size: int) -> Iterator[str]:
    """`texts` run together in pieces of at most `size` characters: short texts joined, each longer one in its own
    `_chunks`. Lazy: a piece is made when it is asked for."""
    held: list[str] = []
    length = 0
    for text in texts:
        if held and length + len(text) > size:
            yield "".join(held)
            held, length = [], 0
        if len(text) > size:
            yield from _chunks(text, size)
        elif text:
            held.append(text)
            length += len(text)
    if held:
        yield "".join(held)


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
        self._next_turn_ids = self._probe_next_turn()
        self._end_of_turn = self._eos if self._next_turn_ids else self._probe_end_of_turn()
        self._text_path = TextPath.probe(self._backend, self.stop_token_ids)
        self._thread_min_chars = encode_thread_min_chars
        # After the probe above: transformers has set the tokenizer for the calls made here (no truncation, no
        # padding), and the copy takes those settings.
        self._threads = EncodeThreads(private_copy(self._backend), encode_threads) if encode_threads else None
        self.reused_ids = 0  # ids `encode_continuing` took from a prefix instead of tokenizing their text again
        # The most UTF-8 bytes one token's string takes: a text of more than `n * max_token_bytes` characters is more
        # than n tokens, whatever it says (`fits_in`).
        self._max_token_bytes = max((len(token.encode()) for token in self._backend.get_vocab()), default=1)

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
    def chat_template(self) -> str:
        """The chat template's jinja text (the first, where the tokenizer has several)."""
        template = self._tok.chat_template
        if isinstance(template, dict):
            return str(template.get("default", next(iter(template.values()), "")))
        return str(template or "")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._vocab_size

    def fits_in(self, characters: int, tokens: int) -> bool:
        """False when a text of `characters` characters is surely more than `tokens` tokens, known without
        tokenizing it: a character is at least a byte, a token at most the vocabulary's longest string. True says
        only that it may fit."""
        return characters <= tokens * self._max_token_bytes

    async def count_at_least(self, texts: Iterable[str], limit: int, chunk_chars: int = COUNT_CHUNK_CHARS) -> int:
        """A lower bound of the tokens of `texts` run together, counted a chunk of at most `chunk_chars` characters
        at a time (short texts joined, a long one cut after whitespace where it has some) and no further than needed
        to pass `limit`: the time and memory of texts far too long are those of their first `limit` tokens, not of
        all of them, and `texts` are read no further. A cut may split what the whole text encodes as one token, so
        each chunk but the first counts one token less."""
        total = 0
        for chunk in _pieces(texts, chunk_chars):
            total += max(0, len(await self.encode_async(chunk)) - (1 if total else 0))
            if total > limit:
                return total
        return total

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def end_of_turn_id(self) -> int:
        """The id the template closes an assistant turn with (`<|im_end|>` for ChatML); the EOS if none."""
        return self._end_of_turn

    @property
    def next_turn_ids(self) -> tuple[int, ...]:
        """The role tokens that close an assistant turn by opening the next message, for a template that writes no
        end-of-turn token of its own (GLM-4.5: `<|user|>`, `<|observation|>` follow the reply directly; its
        generation config lists them among the EOS ids, so the engine stops on them). Empty for other templates."""
        return self._next_turn_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS and the template's end-of-turn token, or its next-turn tokens."""
        return tuple(sorted({self._eos, self._end_of_turn, *self._next_turn_ids}))

    def between_turns(self, sampled: Sequence[int], delta: list[int]) -> list[int]:
        """The ids between a sampled turn and the next prompt (loss mask 0): `delta` (`render_delta`) joined to
        the sampled ids, which stay exactly what the model wrote.

        A reply cut by max_tokens never sampled its end-of-turn token; the template needs it, so it comes first.
        Where the next message's role token closes the turn (`next_turn_ids`), the delta starts with that token:
        a reply that sampled it has it already, so it is dropped from the delta; a reply that stopped otherwise
        (another role token, the EOS, max_tokens) keeps its own last id and the template's role token follows."""
        if not sampled:
            return delta
        if self._next_turn_ids:
            return delta[1:] if delta and delta[0] == sampled[-1] else delta
        return delta if sampled[-1] in self.stop_token_ids else [self._end_of_turn, *delta]

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._special_ids

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` that does the work (streaming decode uses it directly)."""
        return self._backend

    @property
    def text_path(self) -> TextPath:
        """Where this tokenizer's input can be cut after a stop token and each part tokenized apart (probed when it
        loads): what `encode_tail`, `encode_continuing` and `ConversationMatch.by_text` rest on."""
        return self._text_path

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
        lead = self._text_path.lead
        if not lead:
            return encode_ids(self._backend, text)
        return encode_ids(self._backend, lead + text)[1:]

    async def encode_tail_async(self, text: str) -> list[int]:
        """`encode_tail(text)`, in a worker thread as `encode_async` decides."""
        lead = self._text_path.lead
        if not lead:
            return await self.encode_async(text)
        return (await self.encode_async(lead + text))[1:]

    async def render_async(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] | None = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """`render(messages, tools)` (with the generation prompt), tokenized in a worker thread where `encode_async`
        would take the template's text there.

        With threads, that is the template's text encoded (`render_text`, then as `encode_async`), which gives
        `render`'s ids where no message or tool holds the text of an added token: then sanitizing changes nothing.
        A conversation that holds one, or a tokenizer without threads, is rendered by `render` on the calling
        thread."""
        if self._threads is None or self._text_path.added_text_in((messages, tools, chat_template_kwargs)):
            return self.render(messages, tools, chat_template_kwargs=chat_template_kwargs)
        return await self.encode_async(self.render_text(messages, tools, chat_template_kwargs=chat_template_kwargs))

    async def encode_continuing(
        self, text: str, prefix: EncodedPrefix | None
    ) -> tuple[list[int], EncodedPrefix | None]:
        """`encode(text)`, reusing the ids of `prefix` where `text` begins with its text; and the prefix of `text`
        for the next call (None where there is none).

        A raw completion agent sends its whole conversation again at every turn. Tokenizing only what follows the
        previous prompt's last stop token makes a turn cost what its new text costs, not the conversation. It rests
        on the property `ConversationMatch.by_text` uses: the tokenizer splits its input at added tokens first, so
        the ids of a text cut right after a stop token are the ids of its two parts. `text_path.stop_texts` holds
        the stop tokens for which that is so (none that strips whitespace or that a longer added token holds, tails
        probed when the tokenizer loads); without them every text is tokenized whole. Texts of
        `encode_thread_min_chars` or more are tokenized in the worker threads, as by `encode_async`."""
        stop_texts = self._text_path.stop_texts
        if not stop_texts:
            return await self.encode_async(text), None
        start, head = 0, None
        if prefix is not None and prefix.begins(text):
            start, head = prefix.length, prefix.ids
            self.reused_ids += len(head)
        cut = max((i + len(stop) for stop in stop_texts if (i := text.rfind(stop)) >= 0), default=-1)
        if cut <= start:  # no stop token after the reused beginning: the rest in one piece, the prefix as it was
            if head is None:
                return await self.encode_async(text), None
            return head.tolist() + await self.encode_tail_async(text[start:]), prefix
        # Both pieces in one call; each that follows a stop token as `encode_tail` takes it.
        lead = self._text_path.lead
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
        it (the model stops at `<|im_end|>` and never samples that `\\n`). A template whose next message closes
        the turn (`next_turn_ids`) writes nothing after the reply: the whole rendering. Empty history: `[]`.
        """
        if not previous_messages:
            return []
        ids = self.render(
            previous_messages, tools, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs
        )
        if self._next_turn_ids:
            return ids
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
        return apply_chat_template(
            self._tok,
            messages,
            tools,
            add_generation_prompt,
            chat_template_kwargs,
            tokenize=tokenize,
            sanitize_control_tokens=self._sanitize,
        )

    def _probe_end_of_turn(self) -> int:
        """Find the special token the template closes an assistant turn with by rendering a tiny conversation."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        try:
            ids = self.render(probe, add_generation_prompt=False)
        except InvalidRequest:  # a template with unusual demands: fall back to the EOS alone
            return self._eos
        return next((i for i in reversed(ids) if i in self._special_ids), self._eos)

    def _probe_next_turn(self) -> tuple[int, ...]:
        """The special tokens that open a user or tool message right after an assistant reply, where the template
        writes no special token after the reply itself (GLM-4.5); empty otherwise."""
        user = {"role": "user", "content": "hi"}
        reply = {"role": "assistant", "content": _PROBE_REPLY}
        after_reply = self._after_probe_reply([user, reply])
        if after_reply is None or self._special_text_at(after_reply) is not None:
            return ()  # the template closes the turn with a token of its own, or says nothing to go by
        openers = []
        for following in ({"role": "user", "content": "next"}, {"role": "tool", "content": "result"}):
            text = self._after_probe_reply([user, reply, following])
            opener = None if text is None else self._special_text_at(text)
            if opener is not None:
                openers.append(opener)
        return tuple(sorted(set(openers)))

    def _after_probe_reply(self, messages: list[Message]) -> str | None:
        """The template's text after the probe's reply, or None where the template rejects the messages."""
        try:
            text = self.render_text(messages, add_generation_prompt=False)
        except InvalidRequest:
            return None
        at = text.rfind(_PROBE_REPLY)
        return None if at < 0 else text[at + len(_PROBE_REPLY) :]

    def _special_text_at(self, text: str) -> int | None:
        """The id of the special token `text` begins with (the longest), if any."""
        added = self._backend.get_added_tokens_decoder()
        found = [(len(t.content), i) for i, t in added.items() if i in self._special_ids and text.startswith(t.content)]
        return max(found)[1] if found else None


_PROBE_REPLY = "probe-reply-7f3a"  # text no template writes of its own


def _end_after_last(ids: list[int], stops: Sequence[int]) -> int:
    """Index just past the last stop id in `ids`, or `len(ids)` if there is none."""
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] in stops:
            return index + 1
    return len(ids)
