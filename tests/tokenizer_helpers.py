"""Helpers for tests that need a variant of the tiny tokenizer on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.assets import TINY_TOKENIZER_DIR


def tokenizer_dir(
    folder: Path,
    *,
    config: dict[str, Any] | None = None,
    vocab: dict[str, int] | None = None,
    decoder: dict[str, Any] | None = None,
) -> Path:
    """A copy of the tiny tokenizer with `config` merged into tokenizer_config.json, `vocab` added and another
    `decoder` after the byte-level one."""
    model = json.loads((TINY_TOKENIZER_DIR / "tokenizer.json").read_text())
    model["model"]["vocab"].update(vocab or {})
    if decoder is not None:
        model["decoder"] = {"type": "Sequence", "decoders": [model["decoder"], decoder]}
    (folder / "tokenizer.json").write_text(json.dumps(model))
    settings = json.loads((TINY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    settings.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def metaspace_first_dir(folder: Path) -> Path:
    """The tiny tokenizer behind SentencePiece's `Metaspace` (prepend_scheme "first", as transformers builds for
    Llama-style tokenizers with `legacy: false`): only the input's first piece gets a "▁"."""
    tokenizer_dir(folder)
    model = json.loads((folder / "tokenizer.json").read_text())
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    model["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [metaspace, model["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(model))
    return folder
