"""The `rollout-gateway` command: serve, sim, demo."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gateway.errors import ConfigError

app = typer.Typer(
    name="rollout-gateway",
    help="An asyncio gateway between RL agents and vLLM/SGLang replicas.",
    no_args_is_help=True,
    add_completion=False,
)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML configuration (see config.yaml).")] = Path(
        "config.yaml"
    ),
    host: Annotated[str | None, typer.Option(help="Override server.host.")] = None,
    port: Annotated[int | None, typer.Option(help="Override server.port.")] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
) -> None:
    """Run the gateway from a configuration file until SIGINT/SIGTERM (graceful shutdown)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.config import load_config
    from gateway.server import uvicorn_config

    _configure_logging(log_level)
    overrides: dict[str, Any] = {}
    if host is not None or port is not None:
        overrides["server"] = {"host": host, "port": port}
    try:
        settings = load_config(config)
        if overrides:
            server = settings.server.model_dump()
            server.update({k: v for k, v in overrides["server"].items() if v is not None})
            settings = load_config(config, server=server)
    except ConfigError as exc:
        typer.echo(f"rollout-gateway: invalid configuration:\n{exc}", err=True)
        raise typer.Exit(2) from exc
    uv = uvicorn_config(create_app(settings), log_level=log_level, in_process=False)
    uv.host, uv.port = settings.server.host, settings.server.port
    uvicorn.Server(uv).run()


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def sim(ctx: typer.Context) -> None:
    """Run one simulated engine replica (vLLM or SGLang protocol). `rollout-gateway sim --help` lists flags."""
    from backends.sim.cli import main

    raise typer.Exit(main(ctx.args))


@app.command()
def demo(
    duration: Annotated[float, typer.Option(min=1, max=3600, help="Seconds of agent traffic (rounds of tasks).")] = 20,
    replicas: Annotated[int, typer.Option(min=1, max=16, help="Simulator replicas.")] = 2,
    dialect: Annotated[str, typer.Option(help="vllm | sglang | mixed")] = "mixed",
    concurrency: Annotated[int, typer.Option(min=1, max=4096, help="Agent episodes in flight.")] = 32,
    group_size: Annotated[int, typer.Option(min=1, max=64, help="Samples per task (GRPO group).")] = 4,
    update_every: Annotated[float, typer.Option(min=0.2, help="Seconds between weight updates.")] = 3.0,
    token_delay: Annotated[float, typer.Option(min=0, help="Simulated seconds per decode step.")] = 0.003,
    mode: Annotated[str, typer.Option(help="Pause mode of the updates: abort | keep | wait")] = "abort",
    agent: Annotated[str, typer.Option(help="math | tool")] = "tool",
) -> None:
    """Everything in one process: embedded Redis, simulator replicas, the gateway, GRPO agents, a trainer
    that consumes trajectories and publishes weight updates mid-generation."""
    import uvloop

    from gateway.demo import DemoOptions, run_demo

    if (
        dialect not in ("vllm", "sglang", "mixed")
        or mode not in ("abort", "keep", "wait")
        or agent not in ("math", "tool")
    ):
        typer.echo(
            "rollout-gateway demo: --dialect vllm|sglang|mixed, --mode abort|keep|wait, --agent math|tool", err=True
        )
        raise typer.Exit(2)
    _configure_logging("warning")
    options = DemoOptions(
        duration_s=duration,
        replicas=replicas,
        dialect=dialect,  # type: ignore[arg-type]
        concurrency=concurrency,
        group_size=group_size,
        update_every_s=update_every,
        token_delay_s=token_delay,
        mode=mode,  # type: ignore[arg-type]
        agent=agent,  # type: ignore[arg-type]
    )
    ok = uvloop.run(run_demo(options))
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()
