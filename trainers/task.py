"""The task the reference trainer learns: answer with digits.

The reward of an answer is the share of its tokens that are digit tokens (a token whose text, spaces aside, is
all digits). A random tiny model almost never samples one (about 0.3 % of its tokens), a policy that learned
the task samples nothing else, so the reward's rise from ~0 to ~1 shows that every part of the path carried the
right tokens, masks, log-probabilities and versions. The reward needs the token ids only: it is computed from
the ids the engine sampled, as a trainer would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

PROMPTS = (
    "Write numbers:",
    "Count with me:",
    "The digits are",
    "Numbers only, please:",
    "List some figures:",
    "Answer with digits:",
    "Here is a sequence:",
    "Give me a code:",
)


@dataclass(frozen=True)
class DigitsTask:
    """Prompts as token ids and the digit-share reward, for one tokenizer."""

    prompts: tuple[tuple[int, ...], ...]
    digit_ids: frozenset[int]
    texts: tuple[str, ...] = PROMPTS

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> DigitsTask:
        prompts = tuple(tuple(tokenizer.encode(text, add_special_tokens=False)) for text in PROMPTS)
        digits = frozenset(i for i in range(len(tokenizer)) if _is_digits(str(tokenizer.decode([i]))))
        if not digits:
            raise ValueError("the tokenizer has no digit tokens: the digits task cannot be learned with it")
        return cls(prompts, digits)

    def prompt(self, rng: random.Random) -> list[int]:
        return list(rng.choice(self.prompts))

    def text(self, rng: random.Random) -> str:
        """A prompt as text, for a chat's first message."""
        return rng.choice(self.texts)

    def reward(self, output_ids: Sequence[int]) -> float:
        """The share of digit tokens among the answer's tokens (0.0 for an empty answer)."""
        if not output_ids:
            return 0.0
        return sum(token in self.digit_ids for token in output_ids) / len(output_ids)


def _is_digits(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and stripped.isdigit()
