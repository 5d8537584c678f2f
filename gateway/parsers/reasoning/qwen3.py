"""Qwen3's reasoning: `<think>…</think>` at the start of the reply (config name `qwen3`, vLLM's).

The model writes the start tag itself (Qwen3's template opens nothing; with `enable_thinking=False` it renders an
empty `<think>\\n\\n</think>\\n\\n` into the prompt), or the template opens it (Qwen3-Thinking-2507, Qwen3.5: the
generation prompt ends in `<think>\\n`). A reply with neither is all content. The tags are added tokens that are not
special in Qwen3's tokenizer, so they are in the text an OpenAI client sees.
"""

from __future__ import annotations

from gateway.parsers.reasoning.think_tags import ThinkTagFormat, ThinkTagReasoningParser

__all__ = ["QWEN3", "Qwen3ReasoningParser"]

QWEN3 = ThinkTagFormat()


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3's `<think>` format (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(QWEN3)
