"""The tiny tokenizer dressed as a model family: its chat template and its special tokens, saved to a folder the
gateway loads like any model's (`model.tokenizer`). The templates (`templates/`) are the project's own, written for
the tests in each family's format: test_own_templates.py checks that they render what the families' published
templates rendered (goldens/, recorded by scripts/parsers/golden_renders.py) and that `auto` detects the same formats
in them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer

from gateway.assets import TINY_TOKENIZER_DIR

TEMPLATES = Path(__file__).parent / "templates"


def template_text(name: str) -> str:
    """`templates/<name>.jinja`: the tests' template in the family's format, after a jinja comment (`{#- ... -#}`,
    renders nothing) that says so."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def family_tokenizer_dir(
    folder: Path,
    template: str,
    *,
    special: Sequence[str] = (),
    plain: Sequence[str] = (),
    eos: str | None = None,
) -> Path:
    """The tiny tokenizer with `template`, `special` added as special tokens (left out of the text an OpenAI client
    sees) and `plain` as added tokens that are not special (Qwen's `<think>`, `<tool_call>`: they stay in the text),
    `eos` its end-of-sequence token (one of them, or one it has)."""
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)
    if plain:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if special:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in special]},
            replace_extra_special_tokens=False,
        )
    if eos is not None:
        tokenizer.eos_token = eos
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    return folder
