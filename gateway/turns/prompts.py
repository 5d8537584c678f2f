"""A turn's prompt checked and encoded: a prompt too long for the context refused before it is rendered or tokenized
whole (`PromptEncoder.check_fits`, over every text of it: `conversation_texts`, `text_prompt`), and a raw completion's
text encoded reusing what it shares with its session's previous prompt (`PromptEncoder.encode`)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.tokenization import ChatTokenizer, EncodedPrefix
from gateway.turns.request import Conversation

__all__ = ["LIKELY_MAX_CHARS_PER_TOKEN", "PromptEncoder", "PromptTexts", "conversation_texts", "text_prompt"]

# Beyond this many characters a token of the context, a prompt is counted in chunks before it is tokenized whole:
# natural text and code run at 2-5 characters a token, so a text that long almost never fits.
LIKELY_MAX_CHARS_PER_TOKEN = 8

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the refusal's error code, as OpenAI's

PromptTexts = Sequence[tuple[str, Callable[[], Iterable[str]]]]
"""A prompt's texts by the request field that holds them (the refusal's `param`), in the order a template writes
them; each a function that reads them anew, lazily (the check reads them once or twice, and no further than it
needs)."""


class PromptEncoder:
    """Checks prompts against the context (`max_model_len` tokens) and encodes raw completion prompts, keeping per
    session the beginning of its last one and its ids, for as many sessions as `cache_size()` says (the session
    cache's size)."""

    def __init__(self, tokenizer: ChatTokenizer, max_model_len: int, cache_size: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._cache_size = cache_size
        self._prefixes: OrderedDict[str, EncodedPrefix] = OrderedDict()

    def forget(self, session_id: str) -> None:
        """Drop the session's last prompt (it is finished)."""
        self._prefixes.pop(session_id, None)

    async def check_fits(self, texts: PromptTexts) -> None:
        """Refuse a prompt the context cannot hold before it is rendered or tokenized whole (a prompt or tool
        descriptions of megabytes cost seconds of CPU and gigabytes of memory to learn it was too long): by its
        texts' length alone where that says so (`ChatTokenizer.fits_in`), read no further than that; else, for texts
        longer than `LIKELY_MAX_CHARS_PER_TOKEN` characters a token of the context, by counting their tokens a chunk
        at a time up to the context (`ChatTokenizer.count_at_least`). Shorter texts are rendered whole, a cost
        bounded by the context's size. The refusal names the field whose texts passed the bound."""
        limit = self.max_model_len
        characters = 0
        for param, read in texts:
            for text in read():
                characters += len(text)
                if not self.tokenizer.fits_in(characters, limit):
                    raise InvalidRequest(
                        f"the prompt text through `{param}` is at least {characters} characters, which cannot fit "
                        f"the context length of {limit} tokens",
                        param=param,
                        code=CONTEXT_LENGTH_EXCEEDED,
                    )
        if characters <= limit * LIKELY_MAX_CHARS_PER_TOKEN:
            return
        counted = 0
        for param, read in texts:
            counted += await self.tokenizer.count_at_least(read(), limit - counted)
            if counted > limit:
                raise InvalidRequest(
                    f"the prompt text through `{param}` is at least {counted} tokens (counted up to the context "
                    f"length of {limit} tokens)",
                    param=param,
                    code=CONTEXT_LENGTH_EXCEEDED,
                )

    async def encode(self, text: str, session_id: str | None) -> list[int]:
        """The ids of a raw completion's text prompt; in a session, reusing those of the beginning it shares with the
        session's previous prompt in this process (`ChatTokenizer.encode_continuing`). A pure cache: a prefix is
        used only where the text begins with its text, so a concurrent turn of the session cannot mislead it."""
        if session_id is None:
            return await self.tokenizer.encode_async(text)
        ids, prefix = await self.tokenizer.encode_continuing(text, self._prefixes.get(session_id))
        if prefix is None:
            self._prefixes.pop(session_id, None)
        else:
            self._prefixes[session_id] = prefix
            self._prefixes.move_to_end(session_id)
            while len(self._prefixes) > self._cache_size():
                self._prefixes.popitem(last=False)
        return ids


def text_prompt(text: str) -> PromptTexts:
    """A raw completion's text prompt, for `PromptEncoder.check_fits`."""
    return [("prompt", lambda: (text,))]


def conversation_texts(conversation: Conversation) -> PromptTexts:
    """Every text a conversation's rendering holds, for `PromptEncoder.check_fits`: its tools' (`tools`; templates
    write them first), then its messages' (`messages`), as `field_texts` reads them."""
    tools, messages = conversation.tools or (), conversation.messages
    return [
        ("tools", lambda: (text for tool in tools for text in field_texts(tool))),
        ("messages", lambda: (text for message in messages for text in field_texts(message))),
    ]


_NOT_TEXT = frozenset({"role", "type"})  # a message's role, a tool's or a part's type: the template's own words
_LISTS = frozenset({"content", "tool_calls"})  # a message's content parts, an assistant's tool calls


def field_texts(fields: Mapping[str, Any]) -> Iterator[str]:
    """The texts of a message's or a tool's fields, as the chat template may write them: strings as they are (a
    content, a name, a description, a tool call's arguments), the fields of content parts, of tool calls and of a
    tool's `function` read the same way, and any other structure (a `parameters` schema, arguments as an object) as
    compact JSON, which the template's own JSON (`tojson`) can only lengthen. Roles and types are left out."""
    for key, value in fields.items():
        if key in _NOT_TEXT or value is None or isinstance(value, bool | int | float):
            continue
        if isinstance(value, str):
            yield value
        elif key == "function" and isinstance(value, Mapping):
            yield from field_texts(value)
        elif key in _LISTS and isinstance(value, list):
            for item in value:
                if isinstance(item, Mapping):
                    yield from field_texts(item)
                else:
                    yield _json(item)
        else:
            yield _json(value)


def _json(value: Any) -> str:
    """`value` as compact JSON."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer too large for orjson: the stdlib's encoder writes it
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
