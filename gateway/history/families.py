"""The chat-template families whose suffix rule is verified: for each, representative conversations rendered by
the family's published templates (tests/gateway/history/goldens/, one golden per template) pass `check_template`,
so a turn's prompt in `tokens` mode is what that template writes after a reply.

The family is the parsers' (`model.reasoning_parser`, else `model.tool_parser`, `auto` resolved from the template):
no setting of its own. Templates verified per family (docs/architecture.md §7 lists them with their sources):

- chatml: Qwen2.5, Qwen3 (thinking on and off), Qwen3-Coder, Qwen3.5 (on and off), Nemotron 3 Nano.
- deepseek: DeepSeek-R1, V3, V3.1 (thinking on and off).
- glm45: GLM-4.5, GLM-4.6, GLM-4.7.
- kimi_k2: Kimi-K2-Instruct, K2-Instruct-0905, K2-Thinking.
- llama3: Llama 3.1, 3.2, 3.3 (Meta's and vLLM's JSON tool template), Llama-3.3-Nemotron-Super-49B-v1.5.
- mistral: Mistral-7B-v0.3 (vLLM's parallel tool template), Mistral-Small-3.1, 3.2, Ministral-3 Reasoning.

gpt-oss (harmony) is not among them. Its model ends a final answer with `<|return|>`, a decode-time stop token only:
harmony's format (openai/harmony docs/format.md) says a reply added to the history ends with `<|end|>` instead, and
the analysis before a final answer is dropped; its template (and vLLM, which renders the history with
openai-harmony) writes it so. A prompt that keeps the sampled ids keeps `<|return|>` inside the history, which the
format rules out, so no text after a final answer is one the template writes (the check finds no end of the reply
for a user message): gpt-oss runs in `template` mode. Only inside a tool loop does the history keep what was sampled
(a tool call ends with `<|call|>` in both), and a family is verified for a user message too or not at all.
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
        "qwen3_coder": "chatml",  # Qwen3-Coder, Qwen3.5, Nemotron 3 Nano
        "deepseek_r1": "deepseek",  # DeepSeek-R1, V3.1
        "deepseek_v3": "deepseek",
        "glm45": "glm45",  # GLM-4.5, 4.6, 4.7
        "kimi": "kimi_k2",  # the reasoning parser's other name
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
