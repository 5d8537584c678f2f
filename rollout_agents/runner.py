"""Run many agent episodes concurrently against the gateway, in GRPO groups, and summarise them.

For each task, `group_size` episodes (one GRPO group) run with their own session: the runner creates it
(`POST /v1/sessions`, metadata `task_id`, `group_id`, `group_size`, `sample_index`), runs the agent with that
session id, and finishes it with the reward (`POST /v1/sessions/{id}/finish`), which hands the trajectory to
the trainer. At most `concurrency` episodes run at once. New sessions get 429 while the trainer lags; the
runner waits as `Retry-After` says (capped), so the run slows down instead of failing.

An episode that raises is recorded as failed with its error and the run goes on; its session is NOT finished
(the gateway closes it as abandoned after its idle TTL and never delivers it), so a failed episode never
reaches the trainer with a made-up reward. Chat requests are not retried (`max_retries=0`): a resent turn
would reach the gateway as a rewritten history and start a new sample.

    python -m rollout_agents.runner --base-url http://127.0.0.1:8000 --agent tool --tasks 8 --group-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import httpx
import openai
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from rollout_agents import math_agent, tool_agent
from rollout_agents.episode import Agent
from rollout_agents.session_client import RetryPolicy, SessionsClient
from rollout_agents.summary import EpisodeResult, RunSummary, print_summary
from rollout_agents.tasks import generate_tasks

logger = logging.getLogger(__name__)

AgentName = Literal["math", "tool"]
AGENTS: dict[str, Agent] = {"math": math_agent.episode, "tool": tool_agent.episode}


@dataclass(slots=True)
class RunStats:
    """Live counters of a run in progress (the progress bar shows them; tests wait on them)."""

    done: int = 0
    failed: int = 0
    throttled: int = 0
    reward_sum: float = 0.0

    @property
    def mean_reward(self) -> float:
        finished = self.done - self.failed
        return self.reward_sum / finished if finished else 0.0


def gateway_root(base_url: str) -> str:
    """The gateway's root URL, whether given as `http://host:port` or as the OpenAI base `.../v1`."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def episode_seed(seed: int, task_id: str, sample_index: int) -> int:
    """A reproducible sampling seed per (run seed, task, sample): the samples of a group differ."""
    return random.Random(f"{seed}:{task_id}:{sample_index}").getrandbits(31)


class Runner:
    """One run: `tasks` generated tasks × `group_size` samples, at most `concurrency` episodes at a time."""

    def __init__(
        self,
        base_url: str,
        *,
        agent: AgentName = "math",
        tasks: int = 8,
        group_size: int = 4,
        concurrency: int = 16,
        model: str = "tiny",
        api_key: str = "unused",
        seed: int = 0,
        max_tokens: int = 256,
        retry: RetryPolicy | None = None,
        request_timeout_s: float = 300.0,
        run_id: str | None = None,
        console: Console | None = None,
        progress: bool = True,
    ) -> None:
        if agent not in AGENTS:
            raise ValueError(f"agent must be one of {sorted(AGENTS)}, got {agent!r}")
        if tasks < 0 or group_size < 1 or concurrency < 1 or max_tokens < 1:
            raise ValueError("need tasks >= 0, group_size >= 1, concurrency >= 1 and max_tokens >= 1")
        self.root = gateway_root(base_url)
        self.agent_name = agent
        self.agent = AGENTS[agent]
        self.tasks = generate_tasks(tasks, seed)
        self.group_size = group_size
        self.concurrency = concurrency
        self.model = model
        self.api_key = api_key
        self.seed = seed
        self.max_tokens = max_tokens
        self.retry = retry or RetryPolicy()
        self.request_timeout_s = request_timeout_s
        self.timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.console = console or Console(stderr=True)
        self.show_progress = progress
        self.stats = RunStats()

    def episodes(self) -> list[EpisodeResult]:
        """The run's episodes, group by group, each with its session id (`{run}-{task}-{sample}`)."""
        return [
            EpisodeResult(
                task=task,
                group_id=f"{self.run_id}-{task.id}",
                sample_index=i,
                session_id=f"{self.run_id}-{task.id}-{i}",
            )
            for task in self.tasks
            for i in range(self.group_size)
        ]

    async def run(self) -> RunSummary:
        """Run every episode, print the summary tables, return the summary."""
        summary = await self.run_quietly()
        print_summary(summary, self.console)
        return summary

    async def run_quietly(self) -> RunSummary:
        """Run every episode and return the summary without printing it (for callers with their own display)."""
        results = self.episodes()
        started = time.monotonic()
        headers = {"authorization": f"Bearer {self.api_key}"}
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        with self._progress() as progress:
            bar = progress.add_task(f"{self.agent_name} agent", total=len(results), reward="-", failed=0)
            async with (
                httpx.AsyncClient(base_url=self.root, headers=headers, timeout=self.timeout, limits=limits) as http,
                openai.AsyncOpenAI(
                    base_url=f"{self.root}/v1",
                    api_key=self.api_key,
                    max_retries=0,
                    timeout=self.request_timeout_s,
                ) as client,
            ):
                sessions = SessionsClient(http, policy=self.retry, on_retry=self._on_retry)
                jobs = iter(results)
                async with asyncio.TaskGroup() as group:
                    for _ in range(min(self.concurrency, len(results))):
                        group.create_task(self._worker(jobs, client, sessions, progress, bar))
        return RunSummary.of(results, throttled=self.stats.throttled, elapsed_s=time.monotonic() - started)

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.show_progress,
        )

    def _on_retry(self, status_code: int | None) -> None:
        if status_code is not None:
            self.stats.throttled += 1

    async def _worker(
        self,
        jobs: Iterator[EpisodeResult],
        client: openai.AsyncOpenAI,
        sessions: SessionsClient,
        progress: Progress,
        bar: TaskID,
    ) -> None:
        # One shared iterator: `next` never awaits, so no two workers take the same episode.
        for result in jobs:
            await self._episode(result, client, sessions)
            self.stats.done += 1
            reward = f"{self.stats.mean_reward:.3f}" if self.stats.done > self.stats.failed else "-"
            progress.update(bar, advance=1, reward=reward, failed=self.stats.failed)

    async def _episode(self, result: EpisodeResult, client: openai.AsyncOpenAI, sessions: SessionsClient) -> None:
        metadata = {
            "task_id": result.task.id,
            "group_id": result.group_id,
            "group_size": self.group_size,
            "sample_index": result.sample_index,
        }
        started = time.monotonic()
        try:
            await sessions.create(result.session_id, metadata)
            result.reward = await self.agent(
                client,
                result.task,
                model=self.model,
                session_id=result.session_id,
                max_tokens=self.max_tokens,
                seed=episode_seed(self.seed, result.task.id, result.sample_index),
                trace=result.trace,
            )
            await sessions.finish(result.session_id, result.reward)
            result.finished = True
            self.stats.reward_sum += result.reward
        except Exception as exc:  # one episode's failure must not end the run: it is recorded and reported
            result.error = f"{type(exc).__name__}: {exc}"
            self.stats.failed += 1
            logger.warning("session=%s task=%s episode failed: %s", result.session_id, result.task.id, result.error)
        finally:
            result.elapsed_s = time.monotonic() - started


async def run(
    base_url: str,
    *,
    agent: AgentName = "math",
    tasks: int = 8,
    group_size: int = 4,
    concurrency: int = 16,
    model: str = "tiny",
    api_key: str = "unused",
    seed: int = 0,
    console: Console | None = None,
    max_tokens: int = 256,
    retry: RetryPolicy | None = None,
    progress: bool = True,
) -> RunSummary:
    """Run `tasks × group_size` episodes of `agent` against the gateway at `base_url`; see `Runner`."""
    runner = Runner(
        base_url,
        agent=agent,
        tasks=tasks,
        group_size=group_size,
        concurrency=concurrency,
        model=model,
        api_key=api_key,
        seed=seed,
        max_tokens=max_tokens,
        retry=retry,
        console=console,
        progress=progress,
    )
    return await runner.run()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rollout_agents.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway (with or without /v1)")
    parser.add_argument("--agent", choices=get_args(AgentName), default="math")
    parser.add_argument("--tasks", type=int, default=8, help="number of tasks (GRPO groups)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per task")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight at most")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--seed", type=int, default=0, help="task generation and per-sample sampling seeds")
    parser.add_argument("--max-tokens", type=int, default=256, help="per chat turn")
    parser.add_argument("--max-retry-wait", type=float, default=10.0, help="cap on one Retry-After wait, seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: exit status 0 when every episode finished, 1 otherwise."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary = asyncio.run(
        run(
            args.base_url,
            agent=args.agent,
            tasks=args.tasks,
            group_size=args.group_size,
            concurrency=args.concurrency,
            model=args.model,
            api_key=args.api_key,
            seed=args.seed,
            max_tokens=args.max_tokens,
            retry=RetryPolicy(max_wait_s=args.max_retry_wait),
            console=Console(),
            progress=not args.no_progress,
        )
    )
    return 0 if summary.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
