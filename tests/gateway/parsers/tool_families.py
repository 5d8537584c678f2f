"""The tool-call formats under test, each with what its model family writes: the markup of a reply's calls (as the
family's chat template renders them), its special and plain added tokens, its end-of-sequence token."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gateway.parsers.family_tokenizers import family_tokenizer_dir, template_text

Args = dict[str, Any]
Calls = Sequence[tuple[str, Args]]

ADD: tuple[str, Args] = ("add", {"a": 2, "b": 3})
WEATHER: tuple[str, Args] = ("get_weather", {"city": "Zürich 🏔"})
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Family:
    """A tool-call format (`name`, the config's) and the model family that writes it.

    `markup(calls)`: a reply that is these calls. `opener`: the markup that opens a reply's calls, `closer` what
    closes them after the last call's own end (a section's end marker). `prose_first`:
    text may come before the calls (not Llama's, whose reply is all JSON or all text). `malformed`: markup that
    looks like calls and is not. `reasoning`: the family's reasoning parser, where its template writes (empty)
    reasoning before calls. Tokenizer: `special`, `plain`, `eos`."""

    name: str
    markup: Callable[[Calls], str]
    opener: str
    malformed: tuple[str, ...]
    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()
    eos: str | None = None
    prose_first: bool = True
    reasoning: str | None = None
    closer: str = ""

    def tokenizer_dir(self, folder: Path) -> Path:
        """The tiny tokenizer dressed as this family (template, added tokens, EOS) in `folder`."""
        return family_tokenizer_dir(
            folder, template_text(self.name), special=self.special, plain=self.plain, eos=self.eos
        )


def _qwen3_coder(calls: Calls) -> str:
    def one(name: str, args: Args) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else _dumps(v)}\n</parameter>\n" for k, v in args.items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

    return "\n".join(one(*c) for c in calls)


def _glm45(calls: Calls) -> str:
    def one(name: str, args: Args) -> str:
        pairs = "".join(
            f"\n<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _dumps(v)}</arg_value>"
            for k, v in args.items()
        )
        return f"<tool_call>{name}{pairs}</tool_call>"

    return "\n".join(one(*c) for c in calls)


def _kimi_k2(calls: Calls) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{_dumps(args)}<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def _deepseek_v3(calls: Calls) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_dumps(args)}\n```<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _mistral(calls: Calls) -> str:
    items = ", ".join(
        _dumps({"name": name, "arguments": args, "id": f"call{i:05d}"}) for i, (name, args) in enumerate(calls)
    )
    return f"[TOOL_CALLS] [{items}]"


def _llama3_json(calls: Calls) -> str:
    return "; ".join(_dumps({"name": name, "parameters": args}) for name, args in calls)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_coder",
            _qwen3_coder,
            "<tool_call>",
            (
                "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n</tool_call>",
                "<tool_call>\nno function here\n</tool_call>",
                "<tool_call>\n<function=add>\njunk\n</function>\n</tool_call>",
                '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
            ),
            eos="<|im_end|>",
        ),
        Family(
            "glm45",
            _glm45,
            "<tool_call>",
            (
                "<tool_call>add\n<arg_key>a</arg_key>\n</tool_call>",
                "<tool_call>\n</tool_call>",
                '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
                "<tool_call>add\nstray text\n</tool_call>",
            ),
            special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
            plain=(
                "<think>",
                "</think>",
                "<arg_key>",
                "</arg_key>",
                "<arg_value>",
                "</arg_value>",
            ),
            eos="<|observation|>",  # GLM's end of a tool-calling turn (one of its generation config's EOS ids)
            reasoning="glm45",
        ),
        Family(
            "kimi_k2",
            _kimi_k2,
            "<|tool_calls_section_begin|>",
            (
                "<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{oops}<|tool_call_end|>",
                "<|tool_call_begin|>add<|tool_call_argument_begin|>{}<|tool_call_end|>",
                "<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>[1, 2]<|tool_call_end|>",
            ),
            special=(  # the tool markup special too: the parser reads it either way
                "<|im_system|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|im_middle|>",
                "<|tool_calls_section_begin|>",
                "<|tool_calls_section_end|>",
                "<|tool_call_begin|>",
                "<|tool_call_end|>",
                "<|tool_call_argument_begin|>",
            ),
            plain=("<think>", "</think>"),
            eos="<|im_end|>",
            closer="<|tool_calls_section_end|>",
            reasoning="kimi_k2",
        ),
        Family(
            "deepseek_v3",
            _deepseek_v3,
            "<｜tool▁calls▁begin｜>",
            (
                '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n{"a": 2}<｜tool▁call▁end｜>',
                "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{oops}\n```<｜tool▁call▁end｜>",
                '<｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{"a": 2}\n```<｜tool▁call▁end｜>',
            ),
            special=(
                "<｜begin▁of▁sentence｜>",
                "<｜end▁of▁sentence｜>",
                "<｜User｜>",
                "<｜Assistant｜>",
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁calls▁end｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁outputs▁begin｜>",
                "<｜tool▁outputs▁end｜>",
                "<｜tool▁output▁begin｜>",
                "<｜tool▁output▁end｜>",
            ),
            eos="<｜end▁of▁sentence｜>",
            closer="<｜tool▁calls▁end｜>",
        ),
        Family(
            "mistral",
            _mistral,
            "[TOOL_CALLS]",
            (
                '[TOOL_CALLS] [{"name": 3, "arguments": {}}]',
                '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"arguments": {}}]',
                "[TOOL_CALLS] not a call",
                '[TOOL_CALLS][ARGS]{"a": 2}',
                "[TOOL_CALLS]add[ARGS][1, 2]",
            ),
            special=(
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            eos="</s>",
            closer="]",
        ),
        Family(
            "llama3_json",
            _llama3_json,
            "{",
            ('{"name": 3, "parameters": {}}', '{"answer": 42}', '{"name": "add", "parameters": [1]}'),
            special=(
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            eos="<|eot_id|>",
            prose_first=False,
        ),
    )
}
