"""The chat-template families whose suffix rule is verified: for each, representative conversations rendered by
the family's published template (tests/gateway/history/goldens/) pass `check_template`, so a turn's prompt in
`tokens` mode is what that template writes after a reply.

The family is the parsers' (`model.reasoning_parser`, else `model.tool_parser`, `auto` resolved from the template):
no setting of its own. gpt-oss (harmony) is not among them: its model ends a final answer with `<|return|>`, which
its template writes as `<|end|>` in a history, and which of the two a continued prompt should hold is not settled.
"""

from __future__ import annotations

from types import MappingProxyType

from gateway.parsers.detect import detect_reasoning_format, detect_tool_format

__all__ = ["FAMILIES", "family_of"]

# parser name -> the family whose published templates were verified (goldens named after the family's templates).
FAMILIES = MappingProxyType(
    {
        "hermes": "chatml",  # Qwen2.5, Qwen3 (with the qwen3 reasoning parser), Hermes
        "qwen3": "chatml",
        "qwen3_coder": "chatml",
        "deepseek_r1": "deepseek",
        "deepseek_v3": "deepseek",
        "glm45": "glm45",
        "kimi_k2": "kimi_k2",
        "llama3_json": "llama3",
        "mistral": "mistral",
    }
)

_AUTO = "auto"


def family_of(chat_template: str, tool_parser: str, reasoning_parser: str | None) -> str | None:
    """The verified family the parsers name, or None. The reasoning parser decides where there is one (gpt-oss's
    with the default hermes tool parser is harmony, not ChatML); else the tool parser."""
    reasoning = detect_reasoning_format(chat_template) if reasoning_parser == _AUTO else reasoning_parser
    tools = (detect_tool_format(chat_template) or "hermes") if tool_parser == _AUTO else tool_parser
    return FAMILIES.get(reasoning if reasoning is not None else tools)
