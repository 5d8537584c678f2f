"""How far the engine's log-probabilities are from the trainer's, per engine and checkpoint dtype.

The gateway records, for every sampled token, the log-probability the engine gave it; an asynchronous trainer
compares it with its own (the PPO ratio, the importance weight of `trainers.grpo`). Under the same weights the two
differ only by numerics (kernels, dtype); under the previous version they differ by one training step, which is
what the off-policy correction corrects. For each engine and dtype this starts the engine on the tiny dense model
(`backends.launcher`), samples answers through the gateway (`POST /generate`, temperature 1), and reports
|engine − trainer| on the sampled tokens:

- same version: the trainer (float32 master weights, `trainers.grpo.Learner`) on the weights the engine serves,
  before and after the engine loaded a checkpoint the trainer wrote;
- previous version: the answers sampled before that checkpoint, scored by the trainer after its step.

    python -m benchmarks.mismatch [--engines vllm sglang] [--dtypes float32 bfloat16] [--prompts 16] [--samples 8]

Needs the engines `scripts/engines/setup.sh` prepares and the `trainer` extra. Prints a table; figures in
docs/benchmarks/mismatch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from backends.errors import EngineLaunchError, EngineNotInstalled
from backends.launcher import EngineLaunch, default_python, free_port, start_engine
from gateway.config import ReplicaConfig, Settings
from gateway.server import serve_gateway
from gateway.trainer import Batch
from gateway.trajectory import Sample, SessionMeta, Trajectory
from trainers.grpo import GRPOConfig, Learner
from trainers.task import DigitsTask

REPO = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "mismatch-admin-token"


@dataclass(frozen=True)
class Answer:
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass(frozen=True)
class Gaps:
    """|engine - trainer| log-probability over sampled tokens."""

    tokens: int
    mean: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Gaps:
        if values.size == 0:
            return cls(0, float("nan"), float("nan"), float("nan"))
        return cls(int(values.size), float(values.mean()), float(np.quantile(values, 0.99)), float(values.max()))


@dataclass(frozen=True)
class Row:
    engine: str
    dtype: str
    same: Gaps
    previous: Gaps


async def sample(http: httpx.AsyncClient, prompts: Sequence[list[int]], samples: int, max_tokens: int) -> list[Answer]:
    """`samples` answers to each prompt through the gateway's `/generate`, with their engine logprobs."""

    async def one(prompt: list[int], seed: int) -> Answer:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True},
        }
        answer = (await http.post("/generate", json=body)).raise_for_status().json()
        return Answer(prompt, answer["output_ids"], answer["logprobs"], answer["versions"])

    jobs = [one(p, i * samples + k) for i, p in enumerate(prompts) for k in range(samples)]
    return list(await asyncio.gather(*jobs))


def gaps(learner: Learner, answers: Sequence[Answer]) -> np.ndarray:
    """|engine logprob - learner logprob| of every sampled token of `answers`, under the learner's weights."""
    found = []
    with torch.no_grad():
        for a in answers:
            ids = torch.tensor([a.prompt + a.output])
            mine = learner.token_logprobs(ids, torch.ones_like(ids))[0, len(a.prompt) - 1 :]
            found.append(np.abs(mine.numpy() - np.array(a.logprobs, np.float32)))
    return np.concatenate(found) if found else np.zeros(0, np.float32)


def as_batch(answers: Sequence[Answer], samples: int) -> Batch:
    """The answers as GRPO groups (one per prompt), each rewarded by its mean engine log-probability.

    Any reward that differs within a group makes the step move the weights, and this one always does (sampled at
    temperature 1, no two answers are equally likely); the digits task's reward is flat (all 0.0) in most groups of
    the untrained model, and a batch of flat groups is a step that changes nothing."""
    trajectories = []
    for i, a in enumerate(answers):
        n = len(a.output)
        sample_ = Sample(
            prompt_ids=np.array(a.prompt, np.int32),
            response_ids=np.array(a.output, np.int32),
            loss_mask=np.ones(n, np.uint8),
            logprobs=np.array(a.logprobs, np.float32),
            versions=np.array(a.versions, np.int32),
        )
        meta = SessionMeta(id=f"m{i}", status="finished", reward=float(np.mean(a.logprobs)) if n else 0.0)
        trajectories.append(Trajectory(meta, [sample_]))
    return Batch(trajectories=trajectories, group_index=[i // samples for i in range(len(answers))])


async def measure_through(
    gateway_url: str,
    model: Path,
    dtype: str,
    checkpoints: Path,
    prompts: int,
    samples: int,
    max_tokens: int,
    token: str = ADMIN_TOKEN,
) -> tuple[Gaps, Gaps]:
    """Same-version and previous-version gaps through a gateway whose engine serves `model` at version 0."""
    from transformers import AutoTokenizer

    task = DigitsTask.for_tokenizer(AutoTokenizer.from_pretrained(model))
    asked = [task.prompts[i % len(task.prompts)] for i in range(prompts)]
    learner = Learner(model, GRPOConfig(dtype=dtype, threads=1))  # type: ignore[arg-type]
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=600) as http:
        before = await sample(http, [list(p) for p in asked], samples, max_tokens)
        same = [gaps(learner, before)]
        learner.step(as_batch(before, samples))
        path = learner.save(checkpoints, 1)
        (await http.post("/admin/weights", json={"version": 1, "path": str(path)})).raise_for_status()
        previous = gaps(learner, before)
        after = await sample(http, [list(p) for p in asked], samples, max_tokens)
        assert all(set(a.versions) == {1} for a in after), "the engine did not serve the new checkpoint"
        same.append(gaps(learner, after))
    return Gaps.of(np.concatenate(same)), Gaps.of(previous)


def build_model(out: Path, dtype: str) -> Path:
    spec = importlib.util.spec_from_file_location("build_tiny_models", REPO / "scripts" / "build_tiny_models.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    path: Path = builder.build("dense", out, dtype)
    return path


async def measure(engine: str, dtype: str, prompts: int, samples: int, max_tokens: int) -> Row:
    with tempfile.TemporaryDirectory(prefix="rg-mismatch-") as scratch:
        work = Path(scratch)
        model = build_model(work / "models", dtype)
        launch = EngineLaunch(
            kind=engine,  # type: ignore[arg-type]
            python=default_python(engine),  # type: ignore[arg-type]
            model=model,
            port=free_port(),
            dtype=dtype,
        )
        with start_engine(launch, work / "engine") as running:
            replica = ReplicaConfig(
                url=running.url, backend=engine, new_requests_while_paused="block", scale_out=engine == "vllm"
            )
            settings = Settings(
                server={"port": 0, "admin_token": ADMIN_TOKEN},
                replicas=[replica],
                model={"tokenizer": str(model), "max_model_len": launch.max_model_len},
            )
            async with serve_gateway(settings) as gateway:
                same, previous = await measure_through(
                    gateway.url, model, dtype, work / "checkpoints", prompts, samples, max_tokens
                )
    return Row(engine, dtype, same, previous)


def table(rows: Sequence[Row]) -> Table:
    out = Table(title="|engine - trainer| log-probability of sampled tokens")
    for name in ("engine", "dtype", "tokens", "same: mean", "p99", "max", "previous: mean", "p99", "max"):
        out.add_column(name, justify="left" if name in ("engine", "dtype") else "right")
    for r in rows:
        out.add_row(
            r.engine,
            r.dtype,
            f"{r.same.tokens}",
            *(f"{v:.2e}" for v in (r.same.mean, r.same.p99, r.same.max)),
            *(f"{v:.2e}" for v in (r.previous.mean, r.previous.p99, r.previous.max)),
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engines", nargs="+", choices=("vllm", "sglang"), default=["vllm", "sglang"])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="answers a prompt (one GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 132))  # the table's nine columns, unabridged
    rows = []
    for engine in args.engines:
        for dtype in args.dtypes:
            console.print(f"{engine} {dtype} ...")
            try:
                rows.append(asyncio.run(measure(engine, dtype, args.prompts, args.samples, args.max_tokens)))
            except (EngineNotInstalled, EngineLaunchError) as exc:
                console.print(f"[red]{engine} {dtype}: {exc}[/]")
    console.print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
