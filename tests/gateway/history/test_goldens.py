"""The suffix rule against the families' published chat templates, through their renders (goldens/, recorded by
scripts/history/golden_renders.py from the templates it names; the templates themselves are not in the repository):
`check_template` passes on each, finds the same text after a reply for each scenario, and every verified family
has its goldens."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.history import FAMILIES, check_template
from gateway.parsers.registry import REASONING_PARSERS, TOOL_PARSERS

GOLDENS = sorted((Path(__file__).parent / "goldens").glob("*.json"))
UNVERIFIED = Path(__file__).parent / "goldens" / "unverified"


def _key(messages: Sequence[Any], tools: Any, generation: bool, kwargs: Mapping[str, Any] | None) -> str:
    return json.dumps([list(messages), tools, generation, kwargs], sort_keys=True, ensure_ascii=False)


def recorded(golden: dict[str, Any]) -> Any:
    """The template as its renders recorded it: the text for each call `check_template` makes, or its refusal."""
    renders = {_key(r["messages"], r["tools"], r["add_generation_prompt"], r["kwargs"]): r for r in golden["renders"]}

    def render(messages: Sequence[Any], tools: Any, generation: bool, kwargs: Mapping[str, Any] | None) -> str:
        found = renders[_key(messages, tools, generation, kwargs)]  # a KeyError: the check asks for other renders
        if "refused" in found:
            raise InvalidRequest(found["refused"], param="messages")
        return str(found["text"])

    return render


@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_the_suffix_rule_holds_for_the_published_template(path: Path) -> None:
    golden = json.loads(path.read_text())
    check = check_template(recorded(golden), golden["end_texts"], golden["next_turn_texts"], golden["kwargs"])
    assert check.problems == []
    assert check.suffixes == golden["suffixes"] and check.unwritten == golden["unwritten"]
    written = [suffix for suffix in check.suffixes.values() if suffix is not None]
    assert written and all(suffix.strip() for suffix in written)


def test_each_verified_family_has_goldens() -> None:
    assert {json.loads(path.read_text())["family"] for path in GOLDENS} == set(FAMILIES.values())


def test_each_parser_but_harmony_names_a_verified_family() -> None:
    """A parser name missing from FAMILIES would run its verified templates in template mode."""
    names = set(TOOL_PARSERS.names) | set(REASONING_PARSERS.names)
    assert names - set(FAMILIES) == {"openai", "gpt_oss"}


def test_what_follows_a_reply_per_family() -> None:
    """A few suffixes spelled out: what each family's template writes after a reply for a user message."""
    user = {path.stem: json.loads(path.read_text())["suffixes"]["user"] for path in GOLDENS}
    chatml = "\n<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    assert user["qwen3"] == user["qwen2_5"] == chatml
    assert user["qwen3_no_thinking"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert user["qwen3_5"] == user["nemotron_3_nano"] == chatml + "<think>\n"  # the generation prompt opens it
    assert user["qwen3_5_no_thinking"] == chatml + "<think>\n\n</think>\n\n"
    assert user["deepseek_r1"] == "<｜User｜>And Rome?<｜Assistant｜><think>\n"
    assert user["deepseek_v3_1"] == "<｜User｜>And Rome?<｜Assistant｜></think>"
    assert user["deepseek_v3_1_thinking"] == "<｜User｜>And Rome?<｜Assistant｜><think>"
    assert user["glm45"] == "<|user|>And Rome?<|assistant|>"  # starts with the role token that ended the reply
    assert user["glm46"] == "<|user|>\nAnd Rome?<|assistant|>"
    assert user["glm47"] == "<|user|>And Rome?<|assistant|><think>"
    kimi = "<|im_user|>user<|im_middle|>And Rome?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert user["kimi_k2"] == user["kimi_k2_instruct"] == user["kimi_k2_0905"] == user["kimi_k2_thinking"] == kimi
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    llama3 = header.format("user") + "And Rome?<|eot_id|>" + header.format("assistant")
    assert user["llama3_json"] == user["llama3_1"] == user["llama3_2"] == user["llama3_3"] == llama3
    assert user["nemotron_super_v1_5"] == llama3
    assert user["mistral_small_3_1"].endswith("[/AVAILABLE_TOOLS][INST]And Rome?[/INST]")  # tools before the last
    assert user["ministral3_reasoning"] == "[INST]And Rome?[/INST]"
    tool_result = json.loads((GOLDENS[0].parent / "mistral_small_3_2.json").read_text())["suffixes"]["tool_result"]
    assert tool_result == "[TOOL_RESULTS]call00001[TOOL_CONTENT]18 C, sunny[/TOOL_RESULTS]"


def test_harmony_is_not_verified_a_final_answer_ends_otherwise_in_the_history() -> None:
    """gpt-oss's model ends a final answer with <|return|>; its template writes the answer in a history ending with
    <|end|> (as harmony's format asks), so no end of the reply is found after it: the family stays unverified."""
    golden = json.loads((UNVERIFIED / "gpt_oss.json").read_text())
    assert golden["family"] not in FAMILIES.values()
    check = check_template(recorded(golden), golden["end_texts"], golden["next_turn_texts"], golden["kwargs"])
    assert check.problems == golden["problems"]
    assert "user: no end of the reply in the template's text" in check.problems
    user = next(r["text"] for r in golden["renders"] if r["messages"][-1]["content"] == "And Rome?" and "text" in r)
    assert "<|channel|>final<|message|>rg-reply-mark-5c1e9b<|end|><|start|>user" in user


def test_a_template_that_writes_a_new_message_elsewhere_is_not_continued_for_it() -> None:
    """DeepSeek's templates gather every system message at the top: a system reminder after a reply cannot be
    appended, so such a turn goes the template's way."""
    golden = json.loads((GOLDENS[0].parent / "deepseek_r1.json").read_text())
    assert golden["unwritten"] == ["system_reminder"] and golden["suffixes"]["system_reminder"] is None
