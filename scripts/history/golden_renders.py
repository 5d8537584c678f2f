"""Record what published chat templates render for `gateway.history.check_template` (a developer's tool, never run
by the gateway or the tests): the templates are their authors' code and stay out of the repository; their renders
are kept as test data (tests/gateway/history/goldens/<name>.json), which tests/gateway/history/test_goldens.py
checks the suffix rule against.

    python scripts/history/golden_renders.py TEMPLATES_DIR [NAME ...]

TEMPLATES_DIR holds `<name>.jinja` for the names below (read them from their public sources: llama.cpp's
models/templates on GitHub, the model cards' tokenizer_config.json); each golden names its source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from transformers import AutoTokenizer

from gateway.assets import TINY_TOKENIZER_DIR
from gateway.errors import InvalidRequest
from gateway.history import check_template
from gateway.tokenization.chat_template import apply_chat_template

GOLDENS = Path(__file__).resolve().parents[2] / "tests" / "gateway" / "history" / "goldens"


@dataclass(frozen=True)
class Published:
    """A published template and what its tokenizer says ends a reply: `ends` (end-of-turn and EOS texts) and
    `next_turns` (role tokens that end a reply by opening the next message)."""

    family: str
    source: str
    ends: tuple[str, ...]
    special: tuple[str, ...] = ()
    next_turns: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


_DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
_CHATML_END = ("<|im_end|>",)

PUBLISHED = {
    "qwen3": Published("chatml", "Qwen/Qwen3-0.6B tokenizer_config.json", _CHATML_END),
    "qwen3_no_thinking": Published(
        "chatml", "Qwen/Qwen3-0.6B tokenizer_config.json", _CHATML_END, kwargs={"enable_thinking": False}
    ),
    "qwen3_coder": Published("chatml", "Qwen/Qwen3-Coder-30B-A3B-Instruct", _CHATML_END),
    "deepseek_r1": Published(
        "deepseek",
        "deepseek-ai/DeepSeek-R1 tokenizer_config.json",
        ("<｜end▁of▁sentence｜>",),
        special=_DEEPSEEK_SPECIAL,
        bos=_DEEPSEEK_SPECIAL[0],
        eos=_DEEPSEEK_SPECIAL[1],
    ),
    "deepseek_v3": Published(
        "deepseek",
        "deepseek-ai/DeepSeek-V3-0324 tokenizer_config.json",
        ("<｜end▁of▁sentence｜>",),
        special=_DEEPSEEK_SPECIAL,
        bos=_DEEPSEEK_SPECIAL[0],
        eos=_DEEPSEEK_SPECIAL[1],
    ),
    "glm45": Published(
        "glm45",
        "zai-org/GLM-4.5 chat_template.jinja",
        ("<|endoftext|>",),
        special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
        next_turns=("<|observation|>", "<|user|>"),
        eos="<|endoftext|>",
    ),
    "kimi_k2": Published(
        "kimi_k2",
        "moonshotai/Kimi-K2-Instruct tokenizer_config.json",
        ("<|im_end|>",),
        special=("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    ),
    "llama3_json": Published(
        "llama3",
        "meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json",
        ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        special=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
    ),
    "mistral": Published(
        "mistral",
        "mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json",
        ("</s>",),
        special=("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
        bos="<s>",
        eos="</s>",
    ),
}


def record(name: str, template: str) -> dict[str, Any]:
    """Run `check_template` on the published template, recording each render it asks for."""
    published = PUBLISHED[name]
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)
    if published.special:
        tokens = [AddedToken(t, special=True, normalized=False) for t in published.special]
        tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    if published.bos:
        tokenizer.bos_token = published.bos
    if published.eos:
        tokenizer.eos_token = published.eos
    tokenizer.chat_template = template
    renders: list[dict[str, Any]] = []

    def render(
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        generation: bool,
        kwargs: Mapping[str, Any] | None,
    ) -> str:
        call = {"messages": list(messages), "tools": tools, "add_generation_prompt": generation, "kwargs": kwargs}
        try:  # as the gateway renders (`ChatTokenizer.render_text`): arguments as objects, parts as text
            text = apply_chat_template(
                tokenizer, messages, tools, generation, kwargs, tokenize=False, sanitize_control_tokens=True
            )
        except InvalidRequest as refused:
            renders.append({**call, "refused": str(refused)})
            raise
        renders.append({**call, "text": text})
        return str(text)

    check = check_template(render, published.ends, published.next_turns, published.kwargs or None)
    return {
        "template": name,
        "family": published.family,
        "source": published.source,
        "end_texts": list(published.ends),
        "next_turn_texts": list(published.next_turns),
        "kwargs": published.kwargs or None,
        # What the template read besides the call: for rendering the renders again (tests/gateway/parsers/).
        "context": {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "today": datetime.date.today().isoformat(),
        },
        "problems": check.problems,
        "unwritten": check.unwritten,
        "suffixes": check.suffixes,
        "renders": renders,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("templates", type=Path, help="a folder of <name>.jinja")
    parser.add_argument("names", nargs="*", default=sorted(PUBLISHED), help="which (default: all)")
    args = parser.parse_args(argv)
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        golden = record(name, (args.templates / f"{name}.jinja").read_text())
        (GOLDENS / f"{name}.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
        verdict = "passes" if not golden["problems"] else "fails: " + "; ".join(golden["problems"])
        print(f"{name:18} {golden['family']:10} {verdict}")
        for scenario, suffix in golden["suffixes"].items():
            print(f"    {scenario:16} {suffix!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
