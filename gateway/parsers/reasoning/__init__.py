"""Reasoning parsers, one module per model family (vLLM's names: `gpt_oss`; `qwen3`, `deepseek_r1`, ... as they
come): each splits a completion's reasoning from its answer and is registered in `REASONING_PARSERS` of
`gateway.parsers.registry`, as the tool-call parsers are."""
