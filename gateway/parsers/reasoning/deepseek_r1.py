"""DeepSeek-R1's reasoning (config name `deepseek_r1`, vLLM's): the template's generation prompt opens `<think>\\n`
and the model writes only `</think>`; the start tag is optional, so a reply without any tag is all reasoning, as vLLM
reads it (R1 reasons before every answer). A prompt ending in `</think>` (DeepSeek-V3.1's non-thinking mode) starts
the reply as content. The tags are not special tokens in R1's tokenizers.
"""

from __future__ import annotations

from gateway.parsers.reasoning.think_tags import ThinkTagFormat, ThinkTagReasoningParser

__all__ = ["DEEPSEEK_R1", "DeepSeekR1ReasoningParser"]

DEEPSEEK_R1 = ThinkTagFormat(start_optional=True)


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1's `<think>` format (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(DEEPSEEK_R1)
