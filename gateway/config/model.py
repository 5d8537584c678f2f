"""`model:`: the served model as the gateway sees it (tokenizer, chat template, reasoning and tool-call formats)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

import orjson
from pydantic import AfterValidator, Field, PlainSerializer

from gateway.config.section import Section

#: The tiny tokenizer shipped inside the package (offline tests and the demo).
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"


def _known_tool_parser(name: str) -> str:
    from gateway.parsers.registry import TOOL_PARSERS  # the parsers import the errors, not the config

    return _known(TOOL_PARSERS.names, name)


def _known_reasoning_parser(name: str | None) -> str | None:
    from gateway.parsers.registry import REASONING_PARSERS

    return None if name is None else _known(REASONING_PARSERS.names, name)


def _template_arguments(arguments: Mapping[str, Any]) -> Mapping[str, Any]:
    """Read-only, as the rest of the settings; a name the gateway sets itself refused."""
    from gateway.tokenization.chat_template import reserved_in

    refused = reserved_in(arguments)
    if refused is not None:
        raise ValueError(refused)
    return MappingProxyType(dict(arguments))


def _known(names: tuple[str, ...], name: str) -> str:
    if name != "auto" and name not in names:
        raise ValueError(f"unknown parser {name!r} (known: {', '.join((*names, 'auto'))})")
    return name


class ModelConfig(Section):
    """The served model as the gateway sees it: tokenizer, chat template, reasoning and tool-call formats."""

    name: str = Field("tiny", min_length=1, description="Model name sent to the engines and shown to agents.")
    base_model: str | None = Field(
        None,
        min_length=1,
        description=(
            "null: the engines serve this model. A name: this model is a LoRA adapter the gateway loads, a version "
            "at a time, onto engines serving base_model (docs/features.md, LoRA policies)."
        ),
    )
    tokenizer: Path = Field(DEFAULT_TOKENIZER, description="Local tokenizer folder (read offline).")
    tool_parser: Annotated[str, AfterValidator(_known_tool_parser)] = Field(
        "hermes", description="Tool-call format parsed from completions (vLLM's names; auto: from the chat template)."
    )
    reasoning_parser: Annotated[str | None, AfterValidator(_known_reasoning_parser)] = Field(
        None, description="Reasoning format split from completions (vLLM's names; auto: from the chat template)."
    )
    chat_template_kwargs: Annotated[Mapping[str, Any], AfterValidator(_template_arguments), PlainSerializer(dict)] = (
        Field(
            default_factory=dict,
            description=(
                "Extra arguments of the chat template for every chat turn (vLLM's chat_template_kwargs, e.g. "
                "enable_thinking: false); a request's own override them key by key."
            ),
        )
    )
    max_model_len: int = Field(4096, ge=1, description="Context length: prompt + completion tokens.")
    encode_threads: int = Field(
        2, ge=0, le=64, description="Worker threads that tokenize long texts off the event loop (0: none)."
    )
    encode_thread_min_chars: int = Field(
        4096, ge=0, description="Texts of at least this many characters are tokenized in those threads."
    )

    def __hash__(self) -> int:
        # The template arguments are a JSON mapping, which does not hash: their canonical JSON does.
        fields = tuple(value for name, value in self if name != "chat_template_kwargs")
        return hash((fields, orjson.dumps(dict(self.chat_template_kwargs), option=orjson.OPT_SORT_KEYS)))
