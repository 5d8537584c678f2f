"""Tool-call parsers, one module per model family's format, each registered by its vLLM name in
`gateway.parsers.registry`: `hermes`, `qwen3_coder`, `glm45` (blocks in hermes's `<tool_call>` tags), `kimi_k2`,
`deepseek_v3` (special-token blocks in a section), `mistral` (`[TOOL_CALLS]` and JSON), `llama3_json` (bare JSON).

What they share: `stream` (the deltas a parser writes, partial markup held back, `parse` as one streaming pass),
`tagged` (the parser of every start/end-marker format), `json_scan` (where streamed JSON ends), `arguments`
(call objects, and argument text typed by the request's tool schemas).
"""
