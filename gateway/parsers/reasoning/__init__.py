"""Reasoning parsers, one module per model family (vLLM's names: `qwen3`, `deepseek_r1`, ...), will live here: each
splits a completion's reasoning from its answer and is registered in a `ParserRegistry` of `gateway.parsers.registry`,
as the tool-call parsers are. None exists yet."""
