"""The tiny tokenizer in ``gateway/assets/tiny_tokenizer`` (built by ``scripts/build_tokenizer.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.assets import TINY_TOKENIZER_DIR
from tests import REPO
from tests.tool_schemas import ADD_TOOL, WEATHER_TOOL

REPO_ROOT = REPO
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_tokenizer.py"

EXPECTED_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<tool_call>": 3,
    "</tool_call>": 4,
    "<tool_response>": 5,
    "</tool_response>": 6,
}

TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        yield AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def assistant_turns(prompt: str) -> list[str]:
    return re.findall(r"<\|im_start\|>assistant\n?(.*?)<\|im_end\|>", prompt, re.DOTALL)


def test_asset_files_present_and_small() -> None:
    names = {p.name for p in TINY_TOKENIZER_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    total = sum(p.stat().st_size for p in TINY_TOKENIZER_DIR.iterdir() if p.is_file())
    assert total < 1_000_000


def test_inline_and_file_chat_templates_agree() -> None:
    # tokenizer_config.json carries the template too, for transformers < 4.51.
    config = json.loads((TINY_TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (TINY_TOKENIZER_DIR / "chat_template.jinja").read_text(encoding="utf-8")


def test_loads_as_fast_tokenizer(tokenizer: Any) -> None:
    assert tokenizer.is_fast
    assert tokenizer.chat_template


def test_special_token_ids(tokenizer: Any) -> None:
    for token, expected in EXPECTED_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == expected, token
        assert tokenizer.convert_ids_to_tokens(expected) == token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id == 0
    assert tokenizer.bos_token is None
    assert tokenizer.bos_token_id is None


def test_vocab_size(tokenizer: Any) -> None:
    assert len(tokenizer) <= 4096
    assert len(tokenizer) == 2048
    assert max(tokenizer.get_vocab().values()) == len(tokenizer) - 1


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def f(x: int) -> int:\n    return x * 2  # double\n\n\tif x:\r\n        pass\n",
        "héllo — 你好 🙂",
        "👩‍💻 Ünïcödé ∑∫√ العربية עברית 日本語テキスト \u200b\u00a0",
        "   leading and trailing spaces   ",
        "",
    ],
)
def test_encode_decode_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_added_tokens_encode_as_single_ids(tokenizer: Any) -> None:
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "add"}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1
    assert ids[-1] == 2
    assert 3 in ids and 4 in ids
    assert tokenizer.decode(ids) == text
    # Control tokens are special; the tool tags are not, so tool calls survive skip_special_tokens.
    assert tokenizer.decode(ids, skip_special_tokens=True) == 'assistant\n<tool_call>\n{"name": "add"}\n</tool_call>'


def test_generation_prompt(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render(tokenizer, messages).endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1


def test_default_system_prompt(tokenizer: Any) -> None:
    prompt = render(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tools_listed_in_system_block(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "Add 2 and 3."},
    ]
    prompt = render(tokenizer, messages, tools=[ADD_TOOL, WEATHER_TOOL], add_generation_prompt=True)
    system = prompt.split("<|im_end|>", 1)[0]
    assert system.startswith("<|im_start|>system\nYou are a calculator.")
    match = re.search(r"<tools>\n(.*?)\n</tools>", system, re.DOTALL)
    assert match is not None
    assert [json.loads(line) for line in match.group(1).splitlines()] == [ADD_TOOL, WEATHER_TOOL]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert prompt.endswith("<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "arguments",
    [{"a": 2, "b": 3}, '{"a": 2, "b": 3}'],
    ids=["dict-arguments", "json-string-arguments"],
)
def test_assistant_tool_calls_render_as_json(tokenizer: Any, arguments: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Add 2 and 3, and get the weather in Zürich."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": arguments}},
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                },
            ],
        },
    ]
    prompt = render(tokenizer, messages, tools=[ADD_TOOL, WEATHER_TOOL])
    [turn] = assistant_turns(prompt)
    calls = [json.loads(body) for body in TOOL_CALL_RE.findall(turn)]
    assert calls == [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "get_weather", "arguments": {"city": "Zürich"}},
    ]
    assert prompt.endswith("</tool_call><|im_end|>\n")


def test_tool_messages_render_in_tool_response(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Add 2 and 3, twice."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 5}'},
        {"role": "assistant", "content": "Both are 5."},
    ]
    prompt = render(tokenizer, messages, tools=[ADD_TOOL], add_generation_prompt=True)
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        '<tool_response>\n{"result": 5}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nBoth are 5.<|im_end|>\n"
    ) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def _build(out: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--out", str(out)],
        check=True,
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=120,
    )


def test_build_script_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    _build(first)
    _build(second)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    # Same layout as the committed assets.
    assert files == sorted(p.name for p in TINY_TOKENIZER_DIR.iterdir() if p.is_file())
