"""Record what published chat templates render for `gateway.history.check_template` (a developer's tool, never run
by the gateway or the tests): the templates are their authors' code and stay out of the repository; their renders
are kept as test data (tests/gateway/history/goldens/<name>.json), which tests/gateway/history/test_goldens.py
checks the suffix rule against.

    python scripts/history/golden_renders.py TEMPLATES_DIR [NAME ...]

TEMPLATES_DIR holds `<name>.jinja` for the names below (read them from their public sources: llama.cpp's
models/templates on GitHub, its copies of the models' published templates, and vLLM's examples); each golden names
its source, and a template llama.cpp edited later is the version it first copied.
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
    `next_turns` (role tokens that end a reply by opening the next message). An unverified one (`verified`
    False) is recorded under goldens/unverified/, with the problems the check finds."""

    family: str
    source: str
    ends: tuple[str, ...]
    special: tuple[str, ...] = ()
    next_turns: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    verified: bool = True


_DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
_CHATML_END = ("<|im_end|>",)
_GLM_SPECIAL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>")
_KIMI_SPECIAL = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
_LLAMA3_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")
# mistral_common's SpecialTokens (tokens/tokenizers/base.py), [THINK] and [/THINK] from its reasoning tokenizers.
# openai-harmony's formatting tokens (src/registry.rs, HARMONY_GPT_OSS): the model stops at <|return|> and <|call|>.
_HARMONY_SPECIAL = ("<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>", "<|channel|>")
_MISTRAL_SPECIAL = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
)
# Where the templates were read: llama.cpp's models/templates (its copies of the models' published templates), through
# forks whose snapshots could be fetched (the upstream repository is too large), and vLLM's examples.
_LLAMA_CPP = "ggml-org/llama.cpp models/templates/"
_FORK = " (read from the fork Raudbjorn/ggml-llama.cpp @ ae1a0b1c)"
_OLD_FORK = " (read from the fork ye-NX/llama.cpp @ 1eeb523c)"


def _chatml(source: str, **kwargs: Any) -> Published:
    return Published("chatml", source, _CHATML_END, kwargs=kwargs)


def _deepseek(source: str, **kwargs: Any) -> Published:
    ends = (_DEEPSEEK_SPECIAL[1],)
    return Published(
        "deepseek", source, ends, _DEEPSEEK_SPECIAL, bos=_DEEPSEEK_SPECIAL[0], eos=_DEEPSEEK_SPECIAL[1], kwargs=kwargs
    )


def _glm(source: str) -> Published:
    return Published(
        "glm45",
        source,
        ("<|endoftext|>",),
        _GLM_SPECIAL,
        next_turns=("<|observation|>", "<|user|>"),
        eos="<|endoftext|>",
    )


def _kimi(source: str) -> Published:
    return Published("kimi_k2", source, _CHATML_END, _KIMI_SPECIAL)


def _llama3(source: str) -> Published:
    return Published("llama3", source, _LLAMA3_ENDS, _LLAMA3_SPECIAL, bos=_LLAMA3_SPECIAL[0], eos="<|end_of_text|>")


def _mistral(source: str) -> Published:
    return Published("mistral", source, ("</s>",), _MISTRAL_SPECIAL, bos="<s>", eos="</s>")


PUBLISHED = {
    "qwen3": _chatml(
        _LLAMA_CPP + "Qwen-Qwen3-0.6B.jinja (Qwen/Qwen3-0.6B) (read from the fork ye-NX/llama.cpp @ b354d7c9)"
    ),
    "qwen3_no_thinking": _chatml(
        _LLAMA_CPP + "Qwen-Qwen3-0.6B.jinja (Qwen/Qwen3-0.6B) (read from the fork ye-NX/llama.cpp @ b354d7c9)",
        enable_thinking=False,
    ),
    "qwen3_coder": _chatml("vllm-project/vllm examples/tool_chat_template_qwen3coder.jinja @ 7a3bde4c"),
    "qwen2_5": _chatml(_LLAMA_CPP + "Qwen-Qwen2.5-7B-Instruct.jinja (Qwen/Qwen2.5-7B-Instruct)" + _FORK),
    "qwen3_5": _chatml(_LLAMA_CPP + "Qwen3.5-4B.jinja (Qwen/Qwen3.5-4B)" + _FORK),
    "qwen3_5_no_thinking": _chatml(_LLAMA_CPP + "Qwen3.5-4B.jinja (Qwen/Qwen3.5-4B)" + _FORK, enable_thinking=False),
    "nemotron_3_nano": _chatml(
        _LLAMA_CPP
        + "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja as added in c05aa69f3 (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B)"
        + _FORK
    ),
    "deepseek_r1": _deepseek(
        _LLAMA_CPP
        + "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja @ 20bdc4fa (deepseek-ai/DeepSeek-R1-Distill-Qwen-32B)"
    ),
    "deepseek_v3": _deepseek("vllm-project/vllm examples/tool_chat_template_deepseekv3.jinja @ 7531ada7"),
    "deepseek_v3_1": _deepseek(
        _LLAMA_CPP + "deepseek-ai-DeepSeek-V3.1.jinja as added in 88021565f (deepseek-ai/DeepSeek-V3.1)" + _OLD_FORK
    ),
    "deepseek_v3_1_thinking": _deepseek(
        _LLAMA_CPP + "deepseek-ai-DeepSeek-V3.1.jinja as added in 88021565f (deepseek-ai/DeepSeek-V3.1)" + _OLD_FORK,
        thinking=True,
    ),
    "glm45": _glm(_LLAMA_CPP + "glm_4_5.jinja @ 623f3dd0 (zai-org/GLM-4.5, as llama.cpp adapted it)"),
    "glm46": _glm(_LLAMA_CPP + "GLM-4.6.jinja (zai-org/GLM-4.6)" + _FORK),
    "glm47": _glm(_LLAMA_CPP + "GLM-4.7-Flash.jinja (zai-org/GLM-4.7-Flash)" + _FORK),
    "kimi_k2": _kimi(_LLAMA_CPP + "moonshotai-Kimi-K2-Thinking.jinja @ 0c3c896e (moonshotai/Kimi-K2-Thinking)"),
    "kimi_k2_instruct": _kimi(
        _LLAMA_CPP + "moonshotai-Kimi-K2.jinja before 566059a26 (moonshotai/Kimi-K2-Instruct)" + _OLD_FORK
    ),
    "kimi_k2_0905": _kimi(
        _LLAMA_CPP + "Kimi-K2-Instruct.jinja as added in 1920345c3 (moonshotai/Kimi-K2-Instruct-0905)" + _FORK
    ),
    "kimi_k2_thinking": _kimi(
        _LLAMA_CPP + "Kimi-K2-Thinking.jinja as added in 1920345c3 (moonshotai/Kimi-K2-Thinking)" + _FORK
    ),
    "llama3_json": _llama3("vllm-project/vllm examples/tool_chat_template_llama3.1_json.jinja @ 54522760"),
    "llama3_1": _llama3(
        _LLAMA_CPP + "meta-llama-Llama-3.1-8B-Instruct.jinja (meta-llama/Llama-3.1-8B-Instruct)" + _FORK
    ),
    "llama3_2": _llama3(
        _LLAMA_CPP + "meta-llama-Llama-3.2-3B-Instruct.jinja (meta-llama/Llama-3.2-3B-Instruct)" + _FORK
    ),
    "llama3_3": _llama3(
        _LLAMA_CPP + "meta-llama-Llama-3.3-70B-Instruct.jinja (meta-llama/Llama-3.3-70B-Instruct)" + _FORK
    ),
    "nemotron_super_v1_5": _llama3(
        _LLAMA_CPP
        + "nvidia-Llama-3_3-Nemotron-Super-49B-v1_5.jinja @ 1035d607 (nvidia/Llama-3_3-Nemotron-Super-49B-v1_5)"
    ),
    "mistral": _mistral("vllm-project/vllm examples/tool_chat_template_mistral_parallel.jinja @ 9e21b671"),
    "mistral_small_3_1": _mistral(
        _LLAMA_CPP + "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja @ 9190da22 "
        "(mistralai/Mistral-Small-3.1-24B-Instruct-2503)"
    ),
    "mistral_small_3_2": _mistral(
        _LLAMA_CPP + "Mistral-Small-3.2-24B-Instruct-2506.jinja (contributed to llama.cpp in 901e20bbe)" + _FORK
    ),
    "ministral3_reasoning": _mistral(
        _LLAMA_CPP + "mistralai-Ministral-3-14B-Reasoning-2512.jinja (mistralai/Ministral-3-14B-Reasoning-2512)" + _FORK
    ),
    # Not verified (gateway/history/families.py says why): after a final answer its model samples <|return|>, which
    # the template writes as <|end|> in a history.
    "gpt_oss": Published(
        "harmony",
        _LLAMA_CPP + "openai-gpt-oss-120b.jinja (openai/gpt-oss-120b; the same as openai/gpt-oss-20b's)" + _FORK,
        ("<|return|>", "<|call|>"),
        _HARMONY_SPECIAL,
        eos="<|return|>",
        verified=False,
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
        "context": tokenizer_context(tokenizer),
        "problems": check.problems,
        "unwritten": check.unwritten,
        "suffixes": check.suffixes,
        "renders": renders,
    }


def tokenizer_context(tokenizer: Any) -> dict[str, Any]:
    """What a render depends on beside the template and the call: the tokenizer's BOS and EOS texts, and the day
    (templates that write today's date); the own-template tests render again with it."""
    return {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "today": datetime.date.today().isoformat(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("templates", type=Path, help="a folder of <name>.jinja")
    parser.add_argument("names", nargs="*", default=sorted(PUBLISHED), help="which (default: all)")
    args = parser.parse_args(argv)
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        golden = record(name, (args.templates / f"{name}.jinja").read_text())
        folder = GOLDENS if PUBLISHED[name].verified else GOLDENS / "unverified"
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
        verdict = "passes" if not golden["problems"] else "fails: " + "; ".join(golden["problems"])
        print(f"{name:18} {golden['family']:10} {verdict}")
        for scenario, suffix in golden["suffixes"].items():
            print(f"    {scenario:16} {suffix!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
