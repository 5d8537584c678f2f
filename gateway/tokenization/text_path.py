"""The text path: where a tokenizer's input can be cut right after a stop token and each part tokenized apart.

The tokenizer splits its input at added tokens before normalizing and pre-tokenizing, so the ids of a text cut right
after a stop token are the ids of its two parts, provided the stop token strips no whitespace around it, no longer
added token holds its text, and the text after it is tokenized as within the whole text. `TextPath.probe` checks
that once, when the tokenizer loads. Multi-turn rests on it twice: `ConversationMatch.by_text` tokenizes only a
turn's new tail, and `ChatTokenizer.encode_continuing` reuses the ids of a raw prompt's beginning (`EncodedPrefix`).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE

from gateway.encode_threads import encode_ids
from gateway.text_search import AnyOf

__all__ = ["EncodedPrefix", "TextPath"]


@dataclass(frozen=True, slots=True)
class TextPath:
    """What the text path may rely on for one tokenizer (`probe`)."""

    stop_texts: tuple[str, ...]
    """The texts of the stop tokens a text may be cut after; empty: no text path, every text is tokenized whole."""
    lead: str
    """How a text that follows a stop token is tokenized apart, as within the whole text (`encode_tail`): alone
    (""), or after this stop token's text, whose id is then dropped."""
    exact_decoding: bool
    """Whether different texts always give different ids (`_decodes_exactly`)."""
    added_text_in: Callable[[object], bool]
    """Whether a value (a conversation, its tools) holds the text of any added token, in one pass over it: such a
    text would be encoded as plain text by sanitization, and could fake a cut."""

    @classmethod
    def probe(cls, backend: Tokenizer, stop_token_ids: Sequence[int]) -> TextPath:
        """The text path of `backend`, whose generation ends at `stop_token_ids`."""
        added = backend.get_added_tokens_decoder()
        # The texts of every added token, and of the stop tokens that can end a turn's rendering, provided none of
        # those strips whitespace around it (else: no text path).
        added_texts = tuple(token.content for token in added.values() if token.content)
        stops = [added.get(i) for i in stop_token_ids]
        exact = all(t is not None and not t.rstrip and not t.lstrip and not t.normalized for t in stops)
        stop_texts = tuple(t.content for t in stops if t is not None) if exact else ()
        # An added token that holds a stop token's text (and is longer) could match across the cut after it.
        inside = any(stop in text and stop != text for stop in stop_texts for text in added_texts)
        # None: a text after a stop token is tokenized apart neither alone nor after one, so no text path.
        lead = _tail_lead(backend, stop_texts) if stop_texts and not inside else None
        return cls(
            stop_texts=stop_texts if lead is not None else (),
            lead=lead or "",
            exact_decoding=_decodes_exactly(backend),
            added_text_in=AnyOf(added_texts).in_value,
        )


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
