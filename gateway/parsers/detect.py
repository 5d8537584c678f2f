"""`auto`: which tool-call and reasoning formats a chat template shows, by markup only its family writes.

Each table is checked in order, first match wins; a template that shows none gives None (the caller's default).
"""

from __future__ import annotations

__all__ = ["REASONING_MARKERS", "TOOL_MARKERS", "detect_reasoning_format", "detect_tool_format"]

# (text the template holds, parser name): the more specific markers first.
TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "openai"),  # gpt-oss's harmony messages
    ("<tool_call>", "hermes"),
)

REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "gpt_oss"),  # gpt-oss's harmony messages
)


def _first(template: str, markers: tuple[tuple[str, str], ...]) -> str | None:
    return next((name for marker, name in markers if marker in template), None)


def detect_tool_format(chat_template: str) -> str | None:
    """The tool parser the template's markup names, or None."""
    return _first(chat_template, TOOL_MARKERS)


def detect_reasoning_format(chat_template: str) -> str | None:
    """The reasoning parser the template's markup names, or None."""
    return _first(chat_template, REASONING_MARKERS)
