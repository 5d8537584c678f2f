"""What every agent shares: the episode signature, the per-episode trace, and the session header."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import openai
from openai.types.chat import ChatCompletion

from rollout_agents.tasks import Task

SESSION_HEADER = "X-Session-ID"


def session_headers(session_id: str) -> dict[str, str]:
    """Headers that put a request into the gateway session `session_id` (one episode = one session)."""
    return {SESSION_HEADER: session_id}


@dataclass(slots=True)
class EpisodeTrace:
    """What an episode did, filled in by the agent as it goes (the runner sums it over a run).

    Token counts come from each response's `usage`; `prompt_tokens` is the sum over turns of each turn's
    whole prompt, as the API reports it.
    """

    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    final_text: str | None = None

    def record(self, completion: ChatCompletion) -> None:
        self.turns += 1
        if completion.usage is not None:
            self.prompt_tokens += completion.usage.prompt_tokens
            self.completion_tokens += completion.usage.completion_tokens


class Agent(Protocol):
    """An episode: talk to the model in session `session_id` about `task`; return the reward.

    `seed` is the sampling seed of every request (the runner gives each sample of a group its own).
    """

    async def __call__(
        self,
        client: openai.AsyncOpenAI,
        task: Task,
        *,
        model: str = ...,
        session_id: str,
        max_tokens: int = ...,
        seed: int | None = None,
        trace: EpisodeTrace | None = None,
    ) -> float: ...
