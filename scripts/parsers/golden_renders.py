"""Record what the published chat templates of the parser tests' families render for the conversations those tests
render (tests/gateway/parsers/render_cases.py), and which formats `auto` finds in them (a developer's tool, never run
by the gateway or the tests): the templates are their authors' code and stay out of the repository; their renders
are test data (tests/gateway/parsers/goldens/<name>.json), which tests/gateway/parsers/test_own_templates.py checks
the project's own templates (tests/gateway/parsers/templates/<name>.jinja) against.

    python -m scripts.parsers.golden_renders TEMPLATES_DIR [NAME ...]

Run it from the repository root (it reads the tests' conversations). TEMPLATES_DIR holds `<name>.jinja` for the names
below, read from the public sources each golden names. Each is rendered as the gateway renders it (the gateway's
`apply_chat_template` on the tiny tokenizer dressed as the tests dress it: the family's added tokens and
end-of-sequence token), with today's date for the templates that write it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from gateway.errors import InvalidRequest
from gateway.parsers.detect import detect_reasoning_format, detect_tool_format
from gateway.tokenization.chat_template import apply_chat_template
from scripts.history.golden_renders import tokenizer_context
from tests.gateway.parsers.family_tokenizers import family_tokenizer_dir
from tests.gateway.parsers.reasoning_families import DEEPSEEK_R1, QWEN3
from tests.gateway.parsers.render_cases import CASES
from tests.gateway.parsers.test_harmony import HARMONY_TOKENS
from tests.gateway.parsers.tool_families import FAMILIES

GOLDENS = Path(__file__).resolve().parents[2] / "tests" / "gateway" / "parsers" / "goldens"

_LLAMA_CPP = "ggml-org/llama.cpp models/templates/"
PUBLISHED = {
    "qwen3": "ye-NX/llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja @ b354d7c9ecb76c97c07098617cdebbdfffa2583e "
    "(llama.cpp's copy of Qwen/Qwen3-0.6B tokenizer_config.json chat_template)",
    "qwen3_coder": "vllm-project/vllm examples/tool_chat_template_qwen3coder.jinja, commit "
    "7a3bde4c9988d419449263a80f79e5d586e872a4",
    "deepseek_r1": f"{_LLAMA_CPP}deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja @ "
    "20bdc4fac4e8779e5b73646f4b3b24a9964aa566 (llama.cpp's layout of deepseek-ai/DeepSeek-R1-Distill-Qwen-32B's chat "
    "template)",
    "deepseek_v3": "vllm-project/vllm examples/tool_chat_template_deepseekv3.jinja, commit "
    "7531ada7db299214b688d5ea9a316572863edccf",
    "glm45": f"{_LLAMA_CPP}glm_4_5.jinja @ 623f3dd04b05999ffcb598a88d4f79fa9c3af849 (llama.cpp's copy of "
    "zai-org/GLM-4.5's chat template)",
    "kimi_k2": f"{_LLAMA_CPP}moonshotai-Kimi-K2-Thinking.jinja @ 0c3c896ea80643608b4e961eec7e1efcd844e109 "
    "(moonshotai/Kimi-K2-Thinking's chat template)",
    "llama3_json": "vllm-project/vllm examples/tool_chat_template_llama3.1_json.jinja, commit "
    "545227602f2569dfe61adb608beb7bb69fc55fa8",
    "mistral": "vllm-project/vllm examples/tool_chat_template_mistral_parallel.jinja, commit "
    "9e21b671ed5d86d8ffc59f9758d8a37128a2bbea",
    "gpt_oss": "openai/gpt-oss-20b chat_template.jinja (mirrored at github.com/EchoCog/gpt-oss-20b)",
}


def _dressing(name: str) -> tuple[Sequence[str], Sequence[str], str | None]:
    """The special tokens, plain added tokens and end-of-sequence token the tests give the family's tokenizer."""
    if name == "gpt_oss":
        return HARMONY_TOKENS, (), "<|return|>"
    family = FAMILIES.get(name)
    if family is not None:
        return family.special, family.plain, family.eos
    reasoning = {"qwen3": QWEN3, "deepseek_r1": DEEPSEEK_R1}[name]
    return reasoning.special, reasoning.plain, reasoning.eos


def record(name: str, template: str) -> dict[str, Any]:
    """Render each of the name's cases with the published `template`, recording the text or the refusal."""
    special, plain, eos = _dressing(name)
    with tempfile.TemporaryDirectory() as folder:
        dressed = family_tokenizer_dir(Path(folder), template, special=special, plain=plain, eos=eos)
        tokenizer = AutoTokenizer.from_pretrained(str(dressed), local_files_only=True)
    renders: list[dict[str, Any]] = []
    for case in CASES[name]:
        call = {
            "messages": case.messages,
            "tools": case.tools,
            "add_generation_prompt": case.add_generation_prompt,
            "kwargs": case.kwargs,
        }
        try:  # as the gateway renders (`ChatTokenizer.render_text`): arguments as objects, parts as text
            text = apply_chat_template(
                tokenizer,
                case.messages,
                case.tools,
                case.add_generation_prompt,
                case.kwargs,
                tokenize=False,
                sanitize_control_tokens=False,
            )
        except InvalidRequest as refused:
            renders.append({**call, "refused": str(refused)})
            continue
        renders.append({**call, "text": text})
    return {
        "template": name,
        "source": PUBLISHED[name],
        "detected": {"reasoning": detect_reasoning_format(template), "tool": detect_tool_format(template)},
        "context": tokenizer_context(tokenizer),
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
        refused = sum("refused" in r for r in golden["renders"])
        print(f"{name:12} {len(golden['renders'])} renders ({refused} refused), detected {golden['detected']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
