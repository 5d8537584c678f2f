"""The project's own chat templates (templates/<name>.jinja, written for the tests) against the published templates
of their families, through the published templates' recorded renders: the parser tests' conversations (goldens/,
scripts/parsers/golden_renders.py) and the history scenarios (tests/gateway/history/goldens/). Where the published
template rendered, the own one renders the same text; where it refused, the own one refuses; `auto` finds the same
formats in both."""

from __future__ import annotations

import datetime
import difflib
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gateway.assets import TINY_TOKENIZER_DIR
from gateway.errors import InvalidRequest
from gateway.parsers.detect import detect_reasoning_format, detect_tool_format
from gateway.tokenization.chat_template import apply_chat_template
from tests.gateway.parsers.family_tokenizers import TEMPLATES, template_text
from tests.gateway.parsers.render_cases import CASES, render_key

PARSER_GOLDENS = sorted((Path(__file__).parent / "goldens").glob("*.json"))
# The history goldens of a template the tests have their own of (the same template with other arguments included).
OWN_TEMPLATE_OF = {"qwen3_no_thinking": "qwen3"}
HISTORY_GOLDENS = [
    path
    for path in sorted((Path(__file__).parents[1] / "history" / "goldens").glob("*.json"))
    if (TEMPLATES / f"{OWN_TEMPLATE_OF.get(path.stem, path.stem)}.jinja").exists()
]
# The date formats of the templates that write the day they render on (Llama 3.1's, gpt-oss's).
DAY_FORMATS = ("%d %b %Y", "%Y-%m-%d")


@pytest.fixture(scope="module")
def tiny() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)


def own_render(
    tokenizer: PreTrainedTokenizerFast, template: str, render: dict[str, Any], context: dict[str, Any]
) -> str:
    """The text of `template` for a recorded call, read with the special tokens it was recorded with (or
    `InvalidRequest`, the gateway's refusal)."""
    tokens = {key: context[key] for key in ("bos_token", "eos_token") if context[key] is not None}
    tokenizer.chat_template = template
    text = apply_chat_template(
        tokenizer,
        render["messages"],
        render["tools"],
        render["add_generation_prompt"],
        {**(render["kwargs"] or {}), **tokens},
        tokenize=False,
        sanitize_control_tokens=False,
    )
    return str(text)


def on_today(text: str, recorded_on: str) -> str:
    """`text` as its template would write it today: the day of the recording written as today's."""
    then, today = datetime.date.fromisoformat(recorded_on), datetime.date.today()
    for day_format in DAY_FORMATS:
        text = text.replace(then.strftime(day_format), today.strftime(day_format))
    return text


def differences(tokenizer: PreTrainedTokenizerFast, template: str, golden: dict[str, Any]) -> tuple[int, list[str]]:
    """How many of the golden's texts `template` renders the same, and where it does otherwise (a diff, or a
    refusal where the published template rendered, or the reverse)."""
    matched, found = 0, []
    for index, render in enumerate(golden["renders"]):
        try:
            text = own_render(tokenizer, template, render, golden["context"])
        except InvalidRequest as refused:
            if "text" in render:
                found.append(f"render {index}: refused where the published template renders: {refused}")
            continue
        if "refused" in render:
            found.append(f"render {index}: rendered where the published template refuses")
            continue
        expected = on_today(render["text"], golden["context"]["today"])
        if text != expected:
            diff = difflib.unified_diff(expected.splitlines(), text.splitlines(), "published", "own", lineterm="")
            found.append(f"render {index}:\n" + "\n".join(diff))
            continue
        matched += 1
    return matched, found


def own_template_of(golden: dict[str, Any]) -> str:
    return template_text(OWN_TEMPLATE_OF.get(golden["template"], golden["template"]))


@pytest.mark.parametrize(
    "path",
    [*PARSER_GOLDENS, *HISTORY_GOLDENS],
    ids=lambda p: f"{p.parents[1].name}-{p.stem}",
)
def test_the_own_template_renders_what_the_published_one_did(tiny: PreTrainedTokenizerFast, path: Path) -> None:
    golden = json.loads(path.read_text())
    matched, found = differences(tiny, own_template_of(golden), golden)
    assert found == []
    assert matched == sum("text" in r for r in golden["renders"]) > 0


@pytest.mark.parametrize("path", PARSER_GOLDENS, ids=lambda p: p.stem)
def test_auto_finds_the_same_formats_in_the_own_template(path: Path) -> None:
    golden = json.loads(path.read_text())
    own = template_text(golden["template"])
    assert {"reasoning": detect_reasoning_format(own), "tool": detect_tool_format(own)} == golden["detected"]


def test_every_own_template_has_the_renders_of_its_cases() -> None:
    """Each template of templates/ has its goldens, recorded from the cases the tests render now (a case added or
    changed since the recording fails here: record again)."""
    assert {p.stem for p in TEMPLATES.glob("*.jinja")} == {p.stem for p in PARSER_GOLDENS} == set(CASES)
    for path in PARSER_GOLDENS:
        renders = json.loads(path.read_text())["renders"]
        recorded = [render_key(r["messages"], r["tools"], r["add_generation_prompt"], r["kwargs"]) for r in renders]
        assert recorded == [case.key() for case in CASES[path.stem]], path.stem


def test_a_template_that_drifts_is_caught(tiny: PreTrainedTokenizerFast) -> None:
    """A tool result's end tag without the newline before it: every render with a tool result is named, with its
    diff; the others still match."""
    golden = json.loads((Path(__file__).parent / "goldens" / "qwen3.json").read_text())
    drifted = template_text("qwen3").replace("'\\n</tool_response>'", "'</tool_response>'")
    assert drifted != template_text("qwen3")
    matched, found = differences(tiny, drifted, golden)
    with_results = [i for i, r in enumerate(golden["renders"]) if "\n</tool_response>" in r["text"]]
    assert with_results and [f.split(":")[0] for f in found] == [f"render {i}" for i in with_results]
    assert "+result</tool_response><|im_end|>" in found[0]
    assert matched == len(golden["renders"]) - len(with_results) > 0
