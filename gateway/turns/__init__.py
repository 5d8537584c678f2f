"""The turn pipeline every protocol shares: request -> render -> generate with resume -> parse -> record.

`request`: what a turn asks for (`TurnRequest`), as every protocol's adapter builds it; `runner`: `TurnRunner`,
which prepares a turn as a turn of its session(s) (`prepared`: `PreparedTurn` and its choices) and runs it
(`choices`); `prompts`: prompt checks and encoding; `group`: GRPO groups.
"""
