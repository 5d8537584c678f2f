"""`gateway.parsers`: the package's names and the registry by config name (the parsers themselves:
tests/gateway/tokenization/test_tokenization.py)."""

from __future__ import annotations

from typing import get_args

import pytest

import gateway.parsers as parsers
import gateway.tokenization as tokenization
from gateway.config import ToolParser as ToolParserName
from gateway.errors import ConfigError
from gateway.parsers import TOOL_PARSERS, HermesToolParser, ParserRegistry


def test_public_names_are_exported() -> None:
    for module in (parsers, tokenization):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_every_configurable_tool_parser_is_registered() -> None:
    assert TOOL_PARSERS.names == tuple(sorted(get_args(ToolParserName)))


def test_a_registry_makes_a_new_parser_per_lookup() -> None:
    first, second = TOOL_PARSERS.get("hermes"), TOOL_PARSERS.get("hermes")
    assert isinstance(first, HermesToolParser) and first is not second


def test_an_unknown_name_is_a_config_error_naming_the_setting() -> None:
    registry = ParserRegistry[object]("model.reasoning_parser", "reasoning parser", {"b": object, "a": object})
    with pytest.raises(ConfigError, match=r"^model\.reasoning_parser: unknown reasoning parser 'c' \(known: a, b\)$"):
        registry.get("c")
