"""`gateway.parsers`: the package's names and the registry by config name (the parsers themselves:
tests/gateway/tokenization/test_tokenization.py)."""

from __future__ import annotations

import pytest

import gateway.parsers as parsers
import gateway.tokenization as tokenization
from gateway.config import load_config
from gateway.errors import ConfigError
from gateway.parsers import REASONING_PARSERS, TOOL_PARSERS, HermesToolParser, ParserRegistry


def test_public_names_are_exported() -> None:
    for module in (parsers, tokenization):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


@pytest.mark.parametrize(
    ("setting", "registry"), [("tool_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)]
)
def test_the_config_takes_every_registered_parser_and_auto(setting: str, registry: ParserRegistry[object]) -> None:
    for name in (*registry.names, "auto"):
        assert getattr(load_config(model={setting: name}).model, setting) == name
    with pytest.raises(ConfigError, match=rf"model\.{setting}.*unknown parser 'nope' \(known: .*auto\)"):
        load_config(model={setting: "nope"})


def test_a_registry_makes_a_new_parser_per_lookup() -> None:
    first, second = TOOL_PARSERS.get("hermes"), TOOL_PARSERS.get("hermes")
    assert isinstance(first, HermesToolParser) and first is not second


def test_an_unknown_name_is_a_config_error_naming_the_setting() -> None:
    registry = ParserRegistry[object]("model.reasoning_parser", "reasoning parser", {"b": object, "a": object})
    with pytest.raises(ConfigError, match=r"^model\.reasoning_parser: unknown reasoning parser 'c' \(known: a, b\)$"):
        registry.get("c")
