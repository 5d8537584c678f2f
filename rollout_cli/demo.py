"""`rollout-gateway demo`: the whole loop on one machine, in one process.

Embedded Redis, simulator replicas (vLLM and SGLang protocols), the gateway, a GRPO agent runner (the official
`openai` client, sessions, rewards) and a trainer loop (`TrajectoryConsumer`) that consumes complete groups,
turns them into tensors and publishes a new weight version through the admin API every few seconds — while
the agents are mid-generation. The summary shows that trajectories spanned weight updates and nothing was
lost or delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from backends.sim.common import SimServerSettings
from backends.sim.engine import EngineSettings
from backends.sim.server import SimReplica, serve_in_process
from gateway.config import ReplicaConfig, Settings
from gateway.server import RunningGateway, serve_gateway
from gateway.trainer import Batch, TrajectoryConsumer
from rollout_agents.runner import Runner
from rollout_agents.session_client import RetryPolicy

ADMIN_TOKEN = "demo-admin-token"
Dialect = Literal["vllm", "sglang", "mixed"]


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float = 20.0
    replicas: int = 2
    dialect: Dialect = "mixed"
    concurrency: int = 32
    group_size: int = 4
    tasks_per_round: int = 16
    update_every_s: float = 3.0
    token_delay_s: float = 0.003
    mode: Literal["abort", "keep", "wait"] = "abort"
    agent: Literal["math", "tool"] = "tool"


@dataclass
class TrainerStats:
    """What the trainer loop saw."""

    trajectories: int = 0
    samples: int = 0
    spanning: int = 0
    tokens: int = 0
    max_staleness: int = 0
    duplicates: int = 0
    updates: int = 0
    version: int = 0
    batches: int = 0
    tensor_rows: int = 0
    queue_depth: int = 0
    update_ms: list[float] = field(default_factory=list)

    def absorb(self, batch: Batch) -> None:
        self.batches += 1
        self.duplicates += batch.dropped_duplicate
        for trajectory in batch.trajectories:
            self.trajectories += 1
            for sample in trajectory.samples:
                self.samples += 1
                self.tokens += len(sample.prompt_ids) + len(sample.response_ids)
                versions = set(sample.model_versions.tolist())
                self.spanning += len(versions) > 1
                if sample.min_version is not None:
                    self.max_staleness = max(self.max_staleness, batch.current_version - sample.min_version)


def _dialects(options: DemoOptions) -> list[Literal["vllm", "sglang"]]:
    if options.dialect == "mixed":
        return ["vllm" if i % 2 == 0 else "sglang" for i in range(options.replicas)]
    return [options.dialect] * options.replicas


async def _start(options: DemoOptions, stack: contextlib.AsyncExitStack) -> RunningGateway:
    sims: list[SimReplica] = []
    for dialect in _dialects(options):
        engine = EngineSettings(token_delay_s=options.token_delay_s, block_size=16 if dialect == "vllm" else 1)
        sims.append(await stack.enter_async_context(serve_in_process(SimServerSettings(dialect, engine))))
    replicas = [
        ReplicaConfig(url=s.url, backend="sim", dialect=d) for s, d in zip(sims, _dialects(options), strict=True)
    ]
    # No staleness budget: this trainer publishes a version on a clock (every `update_every_s`), not one per batch
    # as the budget assumes, so it would hold the agents at each update, and no rollout would span one.
    settings = Settings(
        server={"port": 0, "admin_token": ADMIN_TOKEN}, replicas=replicas, weights={"max_staleness": None}
    )
    return await stack.enter_async_context(serve_gateway(settings))


async def _trainer(
    gateway: RunningGateway, options: DemoOptions, stats: TrainerStats, agents_done: asyncio.Event
) -> None:
    """Consume complete groups, build tensors, publish a new version every `update_every_s` while agents run."""
    admin = httpx.AsyncClient(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
    next_update = time.monotonic() + options.update_every_s
    async with (
        admin,
        TrajectoryConsumer(gateway.services.redis_url, "demo-trainer", "trainer-0", group_by="group_id") as consumer,
    ):
        while True:
            batch = await consumer.next_batch(32, timeout=0.2)
            if batch.trajectories:
                stats.absorb(batch)
                stats.tensor_rows += _tensor_rows(batch)
                await consumer.ack(batch)
            if not agents_done.is_set() and time.monotonic() >= next_update:
                version = stats.version + 1
                body = {"version": version, "path": f"demo-ckpt-{version}", "mode": options.mode}
                response = await admin.post("/admin/weights", json=body)
                response.raise_for_status()  # a load that failed everywhere is a 502: the trainer stops on it
                report = response.json()
                stats.version, stats.updates = version, stats.updates + 1
                stats.update_ms.append(report.get("duration_s", 0.0) * 1000)
                next_update = time.monotonic() + options.update_every_s
            stats.queue_depth = await gateway.services.store.pending()
            if agents_done.is_set() and not batch.trajectories and stats.queue_depth == 0:
                return


def _tensor_rows(batch: Batch) -> int:
    """Rows of the padded training batch (0 when torch, the `trainer` extra, is not installed)."""
    try:
        return int(batch.to_tensors()["input_ids"].shape[0])
    except ImportError:
        return 0


def _live_table(gateway: RunningGateway, stats: TrainerStats, started: float, runner_stats: list[Any]) -> Table:
    services = gateway.services
    elapsed = max(1e-9, time.monotonic() - started)
    table = Table(title="rollout-gateway demo", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    episodes = sum(s.done for s in runner_stats)
    table.add_row("episodes done", f"{episodes}")
    table.add_row("trajectories consumed", f"{stats.trajectories} ({stats.trajectories / elapsed:.1f}/s)")
    table.add_row("weight version", f"v{services.weights.version} ({services.weights.state})")
    table.add_row(
        "preemptions / resumes", f"{services.generator.preemptions_total} / {services.generator.resumes_total}"
    )
    table.add_row("queue depth (unconsumed)", f"{stats.queue_depth}")
    table.add_row("samples spanning an update", f"{stats.spanning}")
    table.add_row("max staleness (versions)", f"{stats.max_staleness}")
    table.add_row("elapsed", f"{elapsed:.1f}s")
    return table


async def run_demo(options: DemoOptions, console: Console | None = None) -> bool:
    """Run the demo; True when every finished session reached the trainer exactly once and updates happened."""
    console = console or Console()
    stats = TrainerStats()
    runner_stats: list[Any] = []
    finished = failed = 0
    rewards: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        gateway = await _start(options, stack)
        console.print(
            f"[bold]rollout-gateway demo[/]: gateway {gateway.url}, redis {gateway.services.redis_url}, "
            f"{options.replicas} simulator replicas ({', '.join(_dialects(options))}), {options.agent} agents"
        )
        console.print(f"[bold]dashboard[/]: {gateway.url}/dashboard")
        agents_done = asyncio.Event()
        started = time.monotonic()
        trainer = asyncio.create_task(_trainer(gateway, options, stats, agents_done))
        with Live(_live_table(gateway, stats, started, runner_stats), console=console, refresh_per_second=4) as live:
            round_index = 0
            # Keep the agents busy until the duration has passed AND at least one update landed mid-traffic.
            while time.monotonic() - started < options.duration_s or stats.updates == 0:
                runner = Runner(
                    gateway.url,
                    agent=options.agent,
                    tasks=options.tasks_per_round,
                    group_size=options.group_size,
                    concurrency=options.concurrency,
                    seed=round_index,
                    max_tokens=96,
                    retry=RetryPolicy(max_wait_s=1.0),
                    console=console,
                    progress=False,
                )
                runner_stats.append(runner.stats)
                work = asyncio.create_task(runner.run_quietly())
                while not work.done():
                    live.update(_live_table(gateway, stats, started, runner_stats))
                    await asyncio.wait({work, trainer}, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                    if trainer.done():
                        trainer.result()  # the trainer died: raise its error
                summary = work.result()
                finished += summary.finished
                failed += summary.failed
                rewards += [r.reward for r in summary.results if r.reward is not None]
                round_index += 1
            agents_done.set()
            await asyncio.wait_for(trainer, timeout=60)
            live.update(_live_table(gateway, stats, started, runner_stats))
        elapsed = time.monotonic() - started
        pending = await gateway.services.store.pending()
    return _summary(console, options, stats, finished, failed, rewards, pending, elapsed)


def _summary(
    console: Console,
    options: DemoOptions,
    stats: TrainerStats,
    finished: int,
    failed: int,
    rewards: list[float],
    pending: int,
    elapsed: float,
) -> bool:
    lost = finished - stats.trajectories
    table = Table(title="demo summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    mean_update = sum(stats.update_ms) / len(stats.update_ms) if stats.update_ms else 0.0
    for name, value in (
        ("sessions finished by agents", f"{finished}"),
        ("trajectories consumed by the trainer", f"{stats.trajectories} ({stats.trajectories / elapsed:.1f}/s)"),
        ("lost", f"{lost}"),
        ("delivered twice", f"{stats.duplicates}"),
        ("failed episodes", f"{failed}"),
        ("weight updates", f"{stats.updates} (mode {options.mode}, mean {mean_update:.0f} ms)"),
        ("samples spanning an update", f"{stats.spanning} of {stats.samples}"),
        ("max staleness (versions)", f"{stats.max_staleness}"),
        ("tokens in trajectories", f"{stats.tokens}"),
        ("training rows built", f"{stats.tensor_rows}"),
        ("queue depth at the end", f"{pending}"),
        ("mean reward", f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"),
    ):
        table.add_row(name, value)
    console.print(table)
    ok = lost == 0 and stats.duplicates == 0 and failed == 0 and stats.updates > 0 and stats.spanning > 0
    console.print(
        "[bold green]OK[/]: every finished session reached the trainer exactly once, across weight updates"
        if ok
        else "[bold red]FAILED[/]: see the table"
    )
    return ok
