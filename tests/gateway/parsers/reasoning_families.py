"""The four think-tag families as the tests dress the tiny tokenizer: a chat template in the family's format
(`templates/<name>.jinja`, rendering what the published one renders), its turn markup as special tokens and its
think tags (and Kimi's tool-call markup) as added tokens that are not special, as in the family's real tokenizer, and
its end-of-sequence token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.gateway.parsers.family_tokenizers import family_tokenizer_dir, template_text

THINK = ("<think>", "</think>")


@dataclass(frozen=True)
class Family:
    """A reasoning family: its parser's config name, template file, tokens and end-of-sequence token."""

    parser: str
    template: str
    special: tuple[str, ...]
    plain: tuple[str, ...] = THINK
    eos: str = "<|im_end|>"
    opens_reasoning: bool = False  # the generation prompt ends in `<think>`

    def tokenizer_dir(self, folder: Path) -> Path:
        return family_tokenizer_dir(
            folder / self.parser,
            template_text(self.template),
            special=self.special,
            plain=self.plain,
            eos=self.eos,
        )


QWEN3 = Family("qwen3", "qwen3", special=(), plain=(*THINK, "<tool_call>", "</tool_call>"))
DEEPSEEK_R1 = Family(
    "deepseek_r1",
    "deepseek_r1",
    special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    eos="<｜end▁of▁sentence｜>",
    opens_reasoning=True,
)
GLM45 = Family(
    "glm45",
    "glm45",
    special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    eos="<|endoftext|>",
)
KIMI_K2 = Family(
    "kimi_k2",
    "kimi_k2",
    special=("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    plain=(
        *THINK,
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
)

FAMILIES = (QWEN3, DEEPSEEK_R1, GLM45, KIMI_K2)
