"""`auto`: which tool-call and reasoning formats a chat template shows, by markup only its family writes.

Each table is checked in order, first match wins; a template that shows none gives None (the caller's default). A
marker is a text the template holds, or a tuple of texts it holds all of (a family's turn markup and the think tag
that several families share).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["REASONING_MARKERS", "TOOL_MARKERS", "detect_reasoning_format", "detect_tool_format"]

# (text the template holds, parser name): the more specific markers first.
TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),  # inside hermes's <tool_call>: before it
    ("<arg_key>", "glm45"),  # likewise
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),  # also V3.1's templates, whose format has no parser yet
    ("[TOOL_CALLS]", "mistral"),
    ('{"name": function name, "parameters": dictionary of argument name and its value}', "llama3_json"),
    ("<|channel|>", "openai"),  # gpt-oss's harmony messages
    ("<tool_call>", "hermes"),
)

Marker = str | tuple[str, ...]

REASONING_MARKERS: tuple[tuple[Marker, str], ...] = (
    ("<|channel|>", "gpt_oss"),  # gpt-oss's harmony messages
    (("<｜Assistant｜>", "</think>"), "deepseek_r1"),
    (("<|im_assistant|>", "<think>"), "kimi_k2"),
    (("[gMASK]<sop>", "<think>"), "glm45"),
    (("<|im_start|>", "<think>"), "qwen3"),
)


def _shows(template: str, marker: Marker) -> bool:
    return marker in template if isinstance(marker, str) else all(text in template for text in marker)


def _first(template: str, markers: Sequence[tuple[Marker, str]]) -> str | None:
    return next((name for marker, name in markers if _shows(template, marker)), None)


def detect_tool_format(chat_template: str) -> str | None:
    """The tool parser the template's markup names, or None."""
    return _first(chat_template, TOOL_MARKERS)


def detect_reasoning_format(chat_template: str) -> str | None:
    """The reasoning parser the template's markup names, or None."""
    return _first(chat_template, REASONING_MARKERS)
