"""Reasoning parsers, one module per model family (vLLM's names): `qwen3`, `deepseek_r1`, `glm45`, `kimi_k2`, all
on one think-tag parser (`think_tags`) with the family's settings, and `gpt_oss` (harmony's `analysis` channel). Each
splits a completion's reasoning from its answer and is registered in `gateway.parsers.registry.REASONING_PARSERS`."""

from __future__ import annotations

from gateway.parsers.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from gateway.parsers.reasoning.glm45 import Glm45ReasoningParser
from gateway.parsers.reasoning.gpt_oss import GptOssReasoningParser
from gateway.parsers.reasoning.kimi_k2 import KimiK2ReasoningParser
from gateway.parsers.reasoning.qwen3 import Qwen3ReasoningParser
from gateway.parsers.reasoning.think_tags import ThinkTagFormat, ThinkTagReasoningParser, ThinkTagStreamingParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "Glm45ReasoningParser",
    "GptOssReasoningParser",
    "KimiK2ReasoningParser",
    "Qwen3ReasoningParser",
    "ThinkTagFormat",
    "ThinkTagReasoningParser",
    "ThinkTagStreamingParser",
]
