"""Kimi K2's reasoning (config name `kimi_k2`, vLLM's; `kimi` too): `<think>…</think>`, the start tag optional (a
reply without tags is all reasoning, as vLLM reads it), and a tool-call section (`<|tool_calls_section_begin|>`)
begun inside the reasoning ends it: the section is the answer's, for the tool parser. Kimi's tokenizer has the tags
and the tool-call markup as added tokens that are not special.
"""

from __future__ import annotations

from gateway.parsers.reasoning.think_tags import ThinkTagFormat, ThinkTagReasoningParser

__all__ = ["KIMI_K2", "KimiK2ReasoningParser"]

TOOL_SECTION_BEGIN = "<|tool_calls_section_begin|>"

KIMI_K2 = ThinkTagFormat(start_optional=True, implicit_ends=(TOOL_SECTION_BEGIN,))


class KimiK2ReasoningParser(ThinkTagReasoningParser):
    """Kimi K2's `<think>` format (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(KIMI_K2)
