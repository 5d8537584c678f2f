"""The asynchronous GRPO loop: rollouts go on through the gateway while the learner trains on complete groups
and posts every new checkpoint as the next weight version.

One step: take `groups_per_step` complete groups from the trajectory stream (`TrajectoryConsumer`,
`group_by="group_id"`), make one optimiser step (in a worker thread, so rollouts keep flowing), acknowledge the
batch, and publish the weights as the next version (`trainers.publish`): a checkpoint and `POST /admin/weights
{version, path, mode}` (`weights="checkpoint"`), or an in-memory transfer pushed straight into the engines
(`weights="transfer"`). The gateway pauses the engines, updates them and resumes every interrupted request with
the tokens it had, so the next batch holds
samples whose tokens span two versions; their per-token versions drive the staleness mask and the off-policy
correction (`trainers.grpo`).

A verl-, slime- or TRL-style trainer uses the same pieces: a `TrajectoryConsumer` for its batches,
`Batch.to_tensors()` for the tensors, its own loss, and the admin call to publish its weights.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
from transformers import AutoTokenizer

from gateway.trainer import Batch, TrajectoryConsumer
from trainers.grpo import GRPOConfig, Learner, StepStats
from trainers.publish import CheckpointPublisher, Publisher, TransferBackend, TransferPublisher, WeightsMode
from trainers.rollouts import RolloutWorkers, SamplingConfig
from trainers.task import DigitsTask


@dataclass(frozen=True)
class LoopConfig:
    """The loop's knobs (the learner's are in `grpo`, the sampling's in `sampling`)."""

    steps: int = 60
    stop_at_reward: float | None = None  # end after the first step whose batch's mean reward reaches this
    groups_per_step: int = 8
    workers: int = 8  # groups generated concurrently
    max_ahead_steps: int = 2  # rollouts may run this many steps' groups ahead of the learner
    max_staleness: int = 2  # tokens sampled more versions ago than this are masked out of the loss
    mode: Literal["abort", "keep", "wait"] = "abort"
    weights: WeightsMode = "checkpoint"  # how each version reaches the engines: from disk, or pushed in memory
    transfer_backend: TransferBackend | None = None  # weights="transfer": gloo | tensor (None: what the engines take)
    keep_checkpoints: int = 3
    batch_timeout_s: float = 300.0
    seed: int = 0
    turns: int = 1  # answers per episode: more than one makes each episode a chat with tool results between
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass(frozen=True)
class StepReport:
    """One step: what it trained on, how long each phase took, and what the rollouts did so far."""

    step: int
    version: int  # the version posted after this step
    stats: StepStats
    generation_s: float  # waiting for the batch
    train_s: float
    update_s: float  # weights published and taken by the engines (checkpoint or transfer)
    groups: int
    resumed_samples: int  # so far, across the run
    resumes: int


@dataclass
class LoopResult:
    steps: list[StepReport] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [s.stats.reward_mean for s in self.steps]


async def train(
    gateway_url: str,
    redis_url: str,
    model_path: str | Path,
    checkpoints: str | Path,
    config: LoopConfig | None = None,
    *,
    admin_token: str | None = None,
    model_name: str | None = None,
    on_step: Callable[[StepReport], None] | None = None,
) -> LoopResult:
    """Train the model at `model_path` (the weights the gateway's engines serve at its current version) through the
    gateway; step `k` publishes version current + k, from `checkpoints/v{version}` (the newest `keep_checkpoints`
    are kept) or by an in-memory transfer (`config.weights`)."""
    config = config or LoopConfig()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    task = DigitsTask.for_tokenizer(tokenizer)
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    result = LoopResult()
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=httpx.Timeout(600.0)) as http:
        name = model_name or (await http.get("/v1/models")).json()["data"][0]["id"]
        status = await http.get("/admin/status", params={"model": name})
        if not status.is_success:
            raise RuntimeError(f"GET /admin/status: {status.status_code} {status.text} (is the admin token right?)")
        learner = await asyncio.to_thread(Learner, model_path, config.grpo, status.json()["version"])
        workers = RolloutWorkers(
            http,
            task,
            name,
            config.sampling,
            workers=config.workers,
            max_ahead=config.groups_per_step * config.max_ahead_steps,
            seed=config.seed,
            run_id=f"grpo-{int(time.time() * 1000):x}",
            turns=config.turns,
        )
        consumer = TrajectoryConsumer(
            redis_url,
            prefix=status.json()["store_prefix"],  # its pool's keys (`pools:`)
            group="grpo-learner",
            consumer="learner-0",
            group_by="group_id",
            max_staleness=config.max_staleness,
            stale_policy="mask",
        )
        publisher: Publisher
        # A LoRA policy's version loads beside the one in flight (`backends.lora`): keep, there is nothing to pause.
        mode = "keep" if config.grpo.lora_rank is not None else config.mode
        if config.weights == "transfer":
            publisher = TransferPublisher(http, mode, config.transfer_backend, model=name)
        else:
            publisher = CheckpointPublisher(http, checkpoints, mode, keep=config.keep_checkpoints, model=name)
        rollouts = asyncio.create_task(workers.run())
        try:
            async with consumer:
                for step in range(1, config.steps + 1):
                    report = await _step(step, consumer, learner, workers, rollouts, publisher, config)
                    result.steps.append(report)
                    if on_step is not None:
                        on_step(report)
                    if config.stop_at_reward is not None and report.stats.reward_mean >= config.stop_at_reward:
                        break
        finally:
            await workers.stop()
            await asyncio.gather(rollouts, return_exceptions=True)
            await publisher.aclose()
    return result


async def _step(
    step: int,
    consumer: TrajectoryConsumer,
    learner: Learner,
    workers: RolloutWorkers,
    rollouts: asyncio.Task[None],
    publisher: Publisher,
    config: LoopConfig,
) -> StepReport:
    started = time.monotonic()
    batch = await _complete_groups(consumer, workers, rollouts, config)
    trained = time.monotonic()
    stats = await asyncio.to_thread(learner.step, batch)
    await consumer.ack(batch)
    updated = time.monotonic()
    version = learner.version + 1
    await publisher.publish(learner, version)
    done = time.monotonic()
    return StepReport(
        step=step,
        version=version,
        stats=stats,
        generation_s=trained - started,
        train_s=updated - trained,
        update_s=done - updated,
        groups=batch.num_groups,
        resumed_samples=workers.stats.resumed_samples,
        resumes=workers.stats.resumes,
    )


async def _complete_groups(
    consumer: TrajectoryConsumer, workers: RolloutWorkers, rollouts: asyncio.Task[None], config: LoopConfig
) -> Batch:
    """`groups_per_step` complete groups in one batch (several reads when they arrive a few at a time)."""
    want = config.groups_per_step * config.sampling.group_size
    deadline = time.monotonic() + config.batch_timeout_s
    merged = Batch()
    while merged.num_groups < config.groups_per_step:
        if rollouts.done():
            rollouts.result()  # a rollout worker failed: raise its error here
            raise RuntimeError("the rollout workers stopped")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {config.groups_per_step} complete groups within {config.batch_timeout_s} s")
        batch = await consumer.next_batch(want - len(merged), timeout=min(left, 1.0))
        await workers.taken(batch.num_groups + math.ceil(batch.dropped_incomplete / config.sampling.group_size))
        merged = _merge(merged, batch)
    return merged


def _merge(into: Batch, more: Batch) -> Batch:
    if not into.trajectories:
        return more
    offset = into.num_groups
    return Batch(
        trajectories=into.trajectories + more.trajectories,
        off_policy_mask=into.off_policy_mask + more.off_policy_mask,
        group_index=into.group_index + [g + offset for g in more.group_index],
        current_version=more.current_version,
        stale_before=more.stale_before,
    )
