"""GLM-4.5's reasoning (config name `glm45`, vLLM's): the model opens `<think>` itself right after `<|assistant|>`
(often after a newline, dropped with the tag); with thinking off the template writes `<think></think>` into the
prompt. A reply without a start tag is content. The tags are not special tokens in GLM-4.5's tokenizer.
"""

from __future__ import annotations

from gateway.parsers.reasoning.think_tags import ThinkTagFormat, ThinkTagReasoningParser

__all__ = ["GLM45", "Glm45ReasoningParser"]

GLM45 = ThinkTagFormat()


class Glm45ReasoningParser(ThinkTagReasoningParser):
    """GLM-4.5's `<think>` format (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(GLM45)
