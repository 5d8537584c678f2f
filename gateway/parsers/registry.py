"""Parsers by the name the config selects them with (vLLM's names), one `ParserRegistry` per kind of parser.

`TOOL_PARSERS` (config `model.tool_parser`) and `REASONING_PARSERS` (config `model.reasoning_parser`); `auto`
picks the format from the chat template (`gateway.parsers.detect`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from gateway.errors import ConfigError
from gateway.parsers.base import ReasoningParser, ToolParser
from gateway.parsers.detect import detect_reasoning_format, detect_tool_format
from gateway.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    GptOssReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)
from gateway.parsers.tool_calls.deepseek_v3 import DeepSeekV3ToolParser
from gateway.parsers.tool_calls.glm45 import Glm45ToolParser
from gateway.parsers.tool_calls.hermes import HermesToolParser
from gateway.parsers.tool_calls.kimi_k2 import KimiK2ToolParser
from gateway.parsers.tool_calls.llama3_json import Llama3JsonToolParser
from gateway.parsers.tool_calls.mistral import MistralToolParser
from gateway.parsers.tool_calls.openai import OpenAIToolParser
from gateway.parsers.tool_calls.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "AUTO",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParserRegistry",
    "get_reasoning_parser",
    "get_tool_parser",
    "resolve_reasoning_parser",
    "resolve_tool_parser",
]

AUTO = "auto"

P = TypeVar("P")


class ParserRegistry(Generic[P]):
    """Factories of one kind of parser by name; each `get` makes a new parser."""

    def __init__(self, setting: str, kind: str, factories: Mapping[str, Callable[[], P]]) -> None:
        self._setting = setting  # the config key that names a parser of this kind
        self._kind = kind
        self._factories = dict(factories)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._factories))

    def get(self, name: str) -> P:
        """A new parser of the one registered under `name`; `ConfigError` naming the setting when there is none."""
        factory = self._factories.get(name)
        if factory is None:
            known = ", ".join(self.names)
            raise ConfigError(f"{self._setting}: unknown {self._kind} {name!r} (known: {known})")
        return factory()


TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry(
    "model.tool_parser",
    "tool parser",
    {
        "hermes": HermesToolParser,
        "qwen3_coder": Qwen3CoderToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
        "deepseek_v3": DeepSeekV3ToolParser,
        "kimi_k2": KimiK2ToolParser,
        "glm45": Glm45ToolParser,
        "openai": OpenAIToolParser,
    },
)

REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry(
    "model.reasoning_parser",
    "reasoning parser",
    {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "glm45": Glm45ReasoningParser,
        "gpt_oss": GptOssReasoningParser,
        "kimi": KimiK2ReasoningParser,  # the name for vLLM's `kimi_k2`
        "kimi_k2": KimiK2ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
    },
)


def get_tool_parser(name: str) -> ToolParser:
    """The tool parser registered under `name` (config `model.tool_parser`)."""
    return TOOL_PARSERS.get(name)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser registered under `name` (config `model.reasoning_parser`)."""
    return REASONING_PARSERS.get(name)


def resolve_tool_parser(name: str, chat_template: str) -> ToolParser:
    """The configured tool parser; for `auto`, the one the chat template shows (hermes when it shows none)."""
    if name == AUTO:
        name = detect_tool_format(chat_template) or "hermes"
    return get_tool_parser(name)


def resolve_reasoning_parser(name: str | None, chat_template: str) -> ReasoningParser | None:
    """The configured reasoning parser (None: the completion's text is all answer); for `auto`, the one the chat
    template shows, or none."""
    if name == AUTO:
        name = detect_reasoning_format(chat_template)
    return None if name is None else get_reasoning_parser(name)
