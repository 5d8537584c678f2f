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
    replicas: Annotated[int, typer.Option(min=1, max=16, help="Simulator replicas.")] = 2,
    dialect: Annotated[str, typer.Option(help="vllm | sglang | mixed")] = "mixed",
    requests: Annotated[int, typer.Option(min=1, max=4096, help="Concurrent generations.")] = 64,
    tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens per generation.")] = 200,
    updates: Annotated[int, typer.Option(min=0, max=100, help="Weight updates published mid-flight.")] = 3,
    token_delay: Annotated[float, typer.Option(help="Simulated seconds per decode step.")] = 0.005,
    mode: Annotated[str, typer.Option(help="Pause mode of the updates: abort | keep | wait")] = "abort",
) -> None:
    """Everything in one process: embedded Redis, simulator replicas, the gateway, weight updates mid-flight."""
    import uvloop

    from gateway.demo import DemoOptions, run_demo

    if dialect not in ("vllm", "sglang", "mixed") or mode not in ("abort", "keep", "wait"):
        typer.echo("rollout-gateway demo: --dialect is vllm|sglang|mixed and --mode abort|keep|wait", err=True)
        raise typer.Exit(2)
    _configure_logging("warning")
    options = DemoOptions(replicas, dialect, requests, tokens, updates, token_delay, mode)  # type: ignore[arg-type]
    ok = uvloop.run(run_demo(options))
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()
