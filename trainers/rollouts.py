"""Groups of samples generated through the gateway, as an asynchronous GRPO trainer's rollout workers make them.

A group is one request: `POST /v1/completions` with the prompt's token ids, `n = group_size` and `group: true`
makes its `n` answers `n` sessions that share `group_id` (the consumer's `group_by` key) and `group_size`; each
is then finished with its own reward (`POST /v1/sessions/{id}/finish`), which hands its trajectory to the
trainer. Weight updates may interrupt any answer: the gateway resumes it, and `num_resumes` says how often.

With `turns > 1` an episode is a chat (`POST /v1/chat/completions` with the prompt's text), each member in its own
session named as a group member: an answer, then a tool result (how many digits it wrote so far) and the next
answer, `turns` answers in all, the conversation sent back as the gateway answered it. The reward is the digit
share of all its answers; the trainer gets the episode as one sample (the gateway's `sessions.history: tokens`):
the answers with loss mask 1, the tool results and the template's text around them 0.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from rollout_agents.session_client import SessionsClient
from trainers.task import DigitsTask


@dataclass(frozen=True)
class SamplingConfig:
    """How each answer is sampled."""

    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0


@dataclass
class RolloutStats:
    """What the rollout workers did so far."""

    groups: int = 0
    samples: int = 0
    resumed_samples: int = 0  # answers that spanned at least one interruption (a weight update)
    resumes: int = 0
    rewards: list[float] = field(default_factory=list)


class RolloutWorkers:
    """`workers` coroutines, each generating one group after another until `stop()`; at most `max_ahead` groups
    may be finished but not yet taken by the trainer (`taken`), which bounds how stale a sample can get."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        task: DigitsTask,
        model: str,
        sampling: SamplingConfig,
        *,
        workers: int,
        max_ahead: int,
        seed: int = 0,
        run_id: str = "grpo",
        turns: int = 1,
    ) -> None:
        self.http = http
        self.sessions = SessionsClient(http)
        self.task = task
        self.model = model
        self.sampling = sampling
        self.workers = workers
        self.max_ahead = max_ahead
        self.rng = random.Random(seed)
        self.run_id = run_id
        self.turns = turns
        self.stats = RolloutStats()
        self._started = 0
        self._taken = 0
        self._room = asyncio.Condition()
        self._stopping = False

    async def run(self) -> None:
        """Generate groups until `stop()`; an error in any request ends the run with that error."""
        async with asyncio.TaskGroup() as tasks:
            for _ in range(self.workers):
                tasks.create_task(self._worker())

    async def stop(self) -> None:
        async with self._room:
            self._stopping = True
            self._room.notify_all()

    async def taken(self, groups: int) -> None:
        """The trainer took `groups` more groups: that much room for new ones."""
        async with self._room:
            self._taken += groups
            self._room.notify_all()

    async def _worker(self) -> None:
        while True:
            async with self._room:
                await self._room.wait_for(lambda: self._stopping or self._started - self._taken < self.max_ahead)
                if self._stopping:
                    return
                index = self._started
                self._started += 1
            await (self._group(index) if self.turns == 1 else self._chat_group(index))

    async def _group(self, index: int) -> None:
        """One request makes the whole group (`group: true`): its `n` answers are `n` sessions of one group."""
        group_id = f"{self.run_id}-g{index}"
        body = {
            "model": self.model,
            "prompt": self.task.prompt(self.rng),
            "n": self.sampling.group_size,
            "group": True,
            "max_tokens": self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
            "seed": self.rng.randrange(2**31),  # answer i is sampled with seed + i
        }
        response = await self.http.post("/v1/completions", json=body, headers={"X-Session-ID": group_id})
        if not response.is_success:
            raise RuntimeError(f"POST /v1/completions for group {group_id}: {response.status_code} {response.text}")
        for choice in response.json()["rollout"]["choices"]:
            reward = self.task.reward(choice["output_ids"])
            await self.sessions.finish(choice["session_id"], reward)
            resumes = int(choice["num_resumes"])
            self.stats.samples += 1
            self.stats.resumes += resumes
            self.stats.resumed_samples += resumes > 0
            self.stats.rewards.append(reward)
        self.stats.groups += 1

    async def _chat_group(self, index: int) -> None:
        """A group of `turns`-answer chats, each member in its own session named in the URL as the group's member
        (`/sessions/grp-<group>-<i>of<size>/v1/...` records `group_id` and `group_size` as `group: true` would)."""
        group_id, size = f"{self.run_id}-g{index}", self.sampling.group_size
        first = [{"role": "user", "content": self.task.text(self.rng)}]
        episodes = [self._episode(f"grp-{group_id}-{i}of{size}", first) for i in range(size)]
        for reward, resumes in await asyncio.gather(*episodes):
            self.stats.samples += 1
            self.stats.resumes += resumes
            self.stats.resumed_samples += resumes > 0
            self.stats.rewards.append(reward)
        self.stats.groups += 1

    async def _episode(self, session: str, messages: list[dict[str, Any]]) -> tuple[float, int]:
        """One member's episode: an answer, then a tool result and an answer per further turn, the conversation sent
        back as the gateway answered it; finished with the digit share of all its answers. Its reward and resumes."""
        outputs: list[int] = []
        resumes = 0
        for turn in range(self.turns):
            if turn:
                digits = sum(token in self.task.digit_ids for token in outputs)
                messages = [*messages, {"role": "tool", "tool_call_id": "count", "content": f"{digits} digits so far"}]
            answer = await self._chat(self._sampling(messages), session)
            rollout = answer["rollout"]["choices"][0]
            outputs += rollout["output_ids"]
            resumes += int(rollout["num_resumes"])
            messages = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""}]
        reward = self.task.reward(outputs)
        await self.sessions.finish(session, reward)
        return reward, resumes

    def _sampling(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """A chat turn's body: one answer, no `seed` (nor `n`, which the gateway seeds): vLLM 0.32 on the CPU fails a
        seeded request whose prefill it splits across steps (`CPU Generator does not use offset`, seen with chat
        prompts under load), so chat episodes are sampled from the engine's own generator."""
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
        }

    async def _chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
        # The session in the path: a `grp-` name given there makes the session a member of its group.
        response = await self.http.post(f"/sessions/{session_id}/v1/chat/completions", json=body)
        if not response.is_success:
            raise RuntimeError(f"POST /v1/chat/completions for {session_id}: {response.status_code} {response.text}")
        answer: dict[str, Any] = response.json()
        return answer
