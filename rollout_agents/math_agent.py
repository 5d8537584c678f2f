"""Single-turn math agent: ask once, reward 1.0 when the last integer of the reply is the exact answer."""

from __future__ import annotations

from typing import Any

import openai

from rollout_agents.episode import EpisodeTrace, session_headers
from rollout_agents.tasks import Task, reward

SYSTEM_PROMPT = "You are a careful mathematician. Think briefly, then end your reply with the final integer."


def build_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation the agent sends for `task` (tests render it to script the simulator)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {task.question}?"},
    ]


async def episode(
    client: openai.AsyncOpenAI,
    task: Task,
    *,
    model: str = "tiny",
    session_id: str,
    max_tokens: int = 256,
    temperature: float = 1.0,
    seed: int | None = None,
    trace: EpisodeTrace | None = None,
) -> float:
    """One chat turn in session `session_id`; the reward is `rollout_agents.tasks.reward` of the reply.

    API errors propagate (the runner records the episode as failed); a reply without an integer is reward 0.0.
    """
    trace = trace if trace is not None else EpisodeTrace()
    completion = await client.chat.completions.create(
        model=model,
        messages=build_messages(task),  # type: ignore[arg-type]  # plain dicts, as the API accepts
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        extra_headers=session_headers(session_id),
    )
    trace.record(completion)
    trace.final_text = completion.choices[0].message.content
    return reward(task, trace.final_text)
