"""Tool-call parsers, one module per model family's format, each registered by its vLLM name in
`gateway.parsers.registry` (`hermes` today; `qwen3_coder`, `llama3_json`, `mistral`, ... as they come)."""
