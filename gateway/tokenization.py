"""The model's tokenizer, loaded from a local path (offline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.errors import ConfigError


@dataclass(frozen=True, slots=True)
class VocabInfo:
    """What request validation needs to know about the vocabulary."""

    vocab_size: int

    @classmethod
    def from_tokenizer_dir(cls, path: Path) -> VocabInfo:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for unreadable files
            raise ConfigError(f"model.tokenizer: cannot load {file}: {exc}") from exc
        return cls(vocab_size=int(tokenizer.get_vocab_size(with_added_tokens=True)))
