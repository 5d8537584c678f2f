"""Multi-turn tool agent: the model may call `calculator` (OpenAI tool calls) before it gives its answer.

Each turn resends the whole conversation with the assistant message appended exactly as returned
(`message.model_dump(exclude_none=True)`) and one `tool` message per call, so the gateway sees every request
extend the previous one and keeps the episode as ONE sample. A malformed call gets an `error: ...` tool
result and the episode goes on; the reward is the exact-match score of the first reply without tool calls
(0.0 if `max_turns` run out first).
"""

from __future__ import annotations

from typing import Any, Protocol

import openai

from rollout_agents.calculator import run_tool
from rollout_agents.episode import EpisodeTrace, session_headers
from rollout_agents.tasks import Task, reward

TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then reply with the final integer."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": (
                'Evaluate integer arithmetic. Either {"expression": "3 * (4 + 5)"} (integers, + - * and '
                'parentheses) or {"a": 3, "b": 4, "op": "*"}.'
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "An expression over integers with + - *."},
                    "a": {"type": "integer"},
                    "b": {"type": "integer"},
                    "op": {"type": "string", "enum": ["+", "-", "*"]},
                },
            },
        },
    }
]


def build_messages(task: Task) -> list[dict[str, Any]]:
    """The opening conversation for `task` (tests render it to script the simulator)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {task.question}? Use the calculator."},
    ]


class _ToolCall(Protocol):
    """A tool call of any `openai` version (a function call has `.function`; newer `custom` calls do not)."""

    @property
    def id(self) -> str: ...

    @property
    def type(self) -> str: ...


def execute(call: _ToolCall, trace: EpisodeTrace) -> dict[str, Any]:
    """The `tool` message answering one call; unknown tools and bad arguments answer with an error string."""
    trace.tool_calls += 1
    function = getattr(call, "function", None)
    if function is None or function.name != TOOL_NAME:
        content, ok = f"error: unknown tool {getattr(function, 'name', call.type)!r}; use {TOOL_NAME!r}", False
    else:
        content, ok = run_tool(function.arguments)
    trace.tool_errors += not ok
    return {"role": "tool", "tool_call_id": call.id, "content": content}


async def episode(
    client: openai.AsyncOpenAI,
    task: Task,
    *,
    model: str = "tiny",
    session_id: str,
    max_tokens: int = 256,
    max_turns: int = 4,
    temperature: float = 1.0,
    seed: int | None = None,
    trace: EpisodeTrace | None = None,
) -> float:
    """Up to `max_turns` chat turns in session `session_id`, executing the calculator calls in between."""
    trace = trace if trace is not None else EpisodeTrace()
    messages = build_messages(task)
    for _ in range(max_turns):
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]  # plain dicts, as the API accepts
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            extra_headers=session_headers(session_id),
        )
        trace.record(completion)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            trace.final_text = message.content
            return reward(task, message.content)
        messages.extend(execute(call, trace) for call in message.tool_calls)
    return 0.0
