"""A turn's prompt checked and encoded: a text too long for the context refused before it is tokenized whole
(`PromptEncoder.check_fits`), and a raw completion's text encoded reusing what it shares with its session's previous
prompt (`PromptEncoder.encode`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.errors import InvalidRequest
from gateway.tokenization import ChatTokenizer, EncodedPrefix

__all__ = ["LIKELY_MAX_CHARS_PER_TOKEN", "PromptEncoder", "message_texts"]

# Beyond this many characters a token of the context, a prompt is counted in chunks before it is tokenized whole:
# natural text and code run at 2-5 characters a token, so a text that long almost never fits.
LIKELY_MAX_CHARS_PER_TOKEN = 8


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

    async def check_fits(self, texts: list[str], param: str) -> None:
        """Refuse a text the context cannot hold before tokenizing it whole (a 15 MB prompt cost seconds of CPU and a
        GB of memory to learn it was too long): by its length alone where that says so (`ChatTokenizer.fits_in`);
        else, for a text longer than `LIKELY_MAX_CHARS_PER_TOKEN` characters a token of the context, by counting its
        tokens a chunk at a time up to the context (`ChatTokenizer.count_at_least`). A shorter text is tokenized
        whole, a cost bounded by the context's size."""
        characters = sum(map(len, texts))
        if not self.tokenizer.fits_in(characters, self.max_model_len):
            raise InvalidRequest(
                f"{characters} characters of prompt text cannot fit the context length of {self.max_model_len} tokens",
                param=param,
            )
        if characters > self.max_model_len * LIKELY_MAX_CHARS_PER_TOKEN:
            counted = await self.tokenizer.count_at_least(texts, self.max_model_len)
            if counted > self.max_model_len:
                raise InvalidRequest(
                    f"the prompt text is more than {counted} tokens (counted up to the context length of "
                    f"{self.max_model_len} tokens)",
                    param=param,
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


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of messages' contents (string content, or its text parts): part of what their rendering holds."""
    texts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            parts = (part.get("text") for part in content if isinstance(part, dict))
            texts += [text for text in parts if isinstance(text, str)]
    return texts
