"""Parsers by the name the config selects them with (vLLM's names), one `ParserRegistry` per kind of parser.

Tool-call parsers are registered in `TOOL_PARSERS`; reasoning parsers (`gateway.parsers.reasoning`) will get a
registry of their own here, of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from gateway.errors import ConfigError
from gateway.parsers.base import ToolParser
from gateway.parsers.tool_calls.hermes import HermesToolParser

__all__ = ["TOOL_PARSERS", "ParserRegistry", "get_tool_parser"]

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
    "model.tool_parser", "tool parser", {"hermes": HermesToolParser}
)


def get_tool_parser(name: str) -> ToolParser:
    """The tool parser registered under `name` (config `model.tool_parser`)."""
    return TOOL_PARSERS.get(name)
