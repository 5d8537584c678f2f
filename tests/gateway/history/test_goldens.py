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

GOLDENS = sorted((Path(__file__).parent / "goldens").glob("*.json"))


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


def test_what_follows_a_reply_per_family() -> None:
    """A few suffixes spelled out: what each family's template writes after a reply for a user message."""
    user = {path.stem: json.loads(path.read_text())["suffixes"]["user"] for path in GOLDENS}
    assert user["qwen3"] == "\n<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    assert user["qwen3_no_thinking"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert user["deepseek_r1"] == "<｜User｜>And Rome?<｜Assistant｜><think>\n"
    assert user["glm45"] == "<|user|>And Rome?<|assistant|>"  # starts with the role token that ended the reply
    assert user["kimi_k2"] == "<|im_user|>user<|im_middle|>And Rome?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert user["llama3_json"].startswith("<|start_header_id|>user<|end_header_id|>\n\nAnd Rome?<|eot_id|>")


def test_a_template_that_writes_a_new_message_elsewhere_is_not_continued_for_it() -> None:
    """DeepSeek's templates gather every system message at the top: a system reminder after a reply cannot be
    appended, so such a turn goes the template's way."""
    golden = json.loads((GOLDENS[0].parent / "deepseek_r1.json").read_text())
    assert golden["unwritten"] == ["system_reminder"] and golden["suffixes"]["system_reminder"] is None
