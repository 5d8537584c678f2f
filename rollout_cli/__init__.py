"""The `rollout-gateway` command: serve, sim, engine, demo, trajectories."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from gateway.errors import ConfigError

if TYPE_CHECKING:
    from backends.launcher import EngineLaunch

T = TypeVar("T")

app = typer.Typer(
    name="rollout-gateway",
    help="An asyncio gateway between RL agents and vLLM/SGLang replicas.",
    no_args_is_help=True,
    add_completion=False,
)


def _configure_logging(level: str) -> None:
    """Plain-text logs with the structured fields (session_id, replica, version) appended as key=value."""
    from gateway.metrics import ContextFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ContextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


@app.command()
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML configuration (see config.yaml).")] = Path(
        "config.yaml"
    ),
    host: Annotated[str | None, typer.Option(help="Override server.host.")] = None,
    port: Annotated[int | None, typer.Option(help="Override server.port.")] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
    workers: Annotated[
        int,
        typer.Option(
            min=1, help="Gateway processes sharing the port and Redis (one per core; docs/architecture.md §13)."
        ),
    ] = 1,
) -> None:
    """Run the gateway from a configuration file until SIGINT/SIGTERM (graceful shutdown)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.config import load_config, without_credentials
    from gateway.server import uvicorn_config
    from gateway.workers import listening_socket

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
    embedded = not settings.redis.url

    def print_redis(url: str) -> None:
        # Printed, not logged: a trainer needs this URL whatever the log level (the embedded one is new each run,
        # and so is its password, which it carries: the trainer cannot connect without it). A configured URL's
        # credentials are the operator's, who has them: never printed.
        where = " (embedded redis-server; it stops with the gateway)" if embedded else ""
        typer.echo(f"rollout-gateway: Redis at {url if embedded else without_credentials(url)}{where}", err=True)

    if workers > 1:
        from gateway.workers import serve_workers

        raise typer.Exit(serve_workers(settings, workers, log_level, on_redis=print_redis))
    uv = uvicorn_config(
        create_app(settings, server_process=True, on_started=lambda services: print_redis(services.redis_url)),
        settings,
        log_level=log_level,
        in_process=False,
    )
    # The port is bound before the application starts: a taken port fails at once, before Redis and the engines are
    # reached, and the embedded redis-server (which looks for a free port of its own) cannot be given it meanwhile.
    try:
        sock = listening_socket(settings.server.host, settings.server.port)
    except OSError as exc:
        typer.echo(f"rollout-gateway: cannot listen on {settings.server.host}:{settings.server.port}: {exc}", err=True)
        raise typer.Exit(1) from exc
    uvicorn.Server(uv).run(sockets=[sock])


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def sim(ctx: typer.Context) -> None:
    """Run one simulated engine replica (vLLM or SGLang protocol). `rollout-gateway sim --help` lists flags."""
    from backends.sim.cli import main

    raise typer.Exit(main(ctx.args))


_WEIGHTS = ("checkpoint", "transfer", "lora")


def _engine_demo(
    engine: str, steps: int, model: str, target_reward: float, mode: str, max_staleness: int, weights: str
) -> int:
    """`demo --engine vllm|sglang`; the exit status (2: it could not start)."""
    import uvloop

    if engine not in ("vllm", "sglang") or mode not in ("abort", "keep", "wait") or weights not in _WEIGHTS:
        typer.echo(
            "rollout-gateway demo: --engine sim|vllm|sglang, --mode abort|keep|wait, "
            "--weights checkpoint|transfer|lora",
            err=True,
        )
        return 2
    try:
        from trainers.demo import EngineDemoOptions, run_engine_demo
    except ImportError as exc:
        typer.echo(f"rollout-gateway demo --engine: {exc}; install the `trainer` extra (torch)", err=True)
        return 2
    from backends.errors import EngineLaunchError, EngineNotInstalled

    _configure_logging("warning")
    options = EngineDemoOptions(
        engine=engine,  # type: ignore[arg-type]
        model=model,
        steps=steps,
        target_reward=target_reward,
        mode=mode,  # type: ignore[arg-type]
        max_staleness=None if max_staleness < 0 else max_staleness,
        weights=weights,  # type: ignore[arg-type]
    )
    try:
        return 0 if uvloop.run(run_engine_demo(options)) else 1
    except (EngineNotInstalled, EngineLaunchError, FileNotFoundError) as exc:
        typer.echo(f"rollout-gateway demo --engine {engine}: {exc}", err=True)
        return 2


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
    engine: Annotated[
        str,
        typer.Option(
            help="sim: simulator replicas and tool agents (the default). vllm | sglang: the reference GRPO trainer "
            "learns on that real engine (prepared by scripts/engines/setup.sh; needs the `trainer` extra)."
        ),
    ] = "sim",
    steps: Annotated[int, typer.Option(min=1, max=10000, help="--engine: most training steps.")] = 60,
    model: Annotated[str, typer.Option(help="--engine: a tiny model's name (dense) or a checkpoint folder.")] = "dense",
    target_reward: Annotated[float, typer.Option(min=0, max=1, help="--engine: stop once a step reaches it.")] = 0.95,
    max_staleness: Annotated[
        int, typer.Option(min=-1, help="--engine: the gateway's staleness budget, in versions (-1: no budget).")
    ] = 4,
    weights: Annotated[
        str,
        typer.Option(
            help="--engine: how each version reaches the engine: checkpoint (loaded from disk) | transfer (pushed "
            "in memory: gloo on vLLM, inline tensors on SGLang) | lora (a rank-8 adapter is trained, each version "
            "loaded beside the one in flight; vLLM)."
        ),
    ] = "checkpoint",
) -> None:
    """Everything in one process: embedded Redis, simulator replicas, the gateway, GRPO agents, a trainer
    that consumes trajectories and publishes weight updates mid-generation. With --engine vllm|sglang: a real
    engine, and a trainer whose checkpoints the engine loads while it learns."""
    import uvloop

    if engine != "sim":
        raise typer.Exit(_engine_demo(engine, steps, model, target_reward, mode, max_staleness, weights))
    from rollout_cli.demo import DemoOptions, run_demo

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


@app.command()
def engine(
    kind: Annotated[str, typer.Argument(help="vllm | sglang", show_default=False)],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="A model folder, or the name of one under RG_ENGINE_MODELS (the tiny models: dense, dense_v2, "
            "moe, moe_v2).",
            show_default=False,
        ),
    ],
    extra: Annotated[
        list[str] | None,
        typer.Argument(help="Engine arguments, after `--`; they come last, so they override the defaults."),
    ] = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = 8001,
    host: Annotated[str, typer.Option(help="Where the engine listens.")] = "127.0.0.1",
    python: Annotated[
        Path | None,
        typer.Option(help="The engine venv's python (default: RG_<KIND>_PYTHON, else .engines/<kind>-venv)."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Weights and activations (float32 keeps greedy runs exact).")] = "float32",
    served_name: Annotated[str, typer.Option(help="The model name the engine answers to.")] = "tiny",
    max_model_len: Annotated[int, typer.Option(min=16, help="Context length.")] = 4096,
    routed_experts: Annotated[
        bool, typer.Option(help="Capture routed experts (the CPU builds cannot; docs/engines.md).")
    ] = False,
    lora: Annotated[
        int, typer.Option(min=0, help="LoRA adapters loaded at run time at most (0: none; SGLang: GPU only).")
    ] = 0,
    startup_timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for /health.")] = 240.0,
    log: Annotated[
        Path | None,
        typer.Option(help="The engine's output (default: $RG_ENGINE_CACHE/logs/<kind>-<port>.log)."),
    ] = None,
) -> None:
    """Run a real vLLM or SGLang server (the CPU recipe of docs/engines.md) in the foreground: print its URL once
    /health answers, stop its whole process group on Ctrl-C or SIGTERM."""
    from backends.launcher import ENGINE_KINDS, EngineLaunch, default_python, engine_cache, free_port, resolve_model
    from gateway.errors import EngineLaunchError, EngineNotInstalled

    if kind not in ENGINE_KINDS:
        typer.echo("rollout-gateway engine: KIND is vllm or sglang", err=True)
        raise typer.Exit(2)
    _configure_logging("info")
    try:
        launch = EngineLaunch(
            kind,
            python or default_python(kind),
            resolve_model(model),
            port or free_port(host),
            host=host,
            served_name=served_name,
            dtype=dtype,
            max_model_len=max_model_len,
            routed_experts=routed_experts,
            max_loras=lora,
            extra_args=tuple(extra or ()),
        )
        code = _run_engine(launch, log or engine_cache() / "logs" / f"{kind}-{launch.port}.log", startup_timeout)
    except EngineNotInstalled as exc:
        typer.echo(f"rollout-gateway engine: {exc}", err=True)
        raise typer.Exit(2) from exc
    except EngineLaunchError as exc:
        typer.echo(f"rollout-gateway engine: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


def _run_engine(launch: EngineLaunch, log: Path, startup_timeout_s: float) -> int:
    """Start the engine, wait for it, stop it: 0 when stopped by a signal, else the engine's own exit status."""
    import tempfile

    from backends.launcher import start_engine

    typer.echo(f"starting {launch.kind} on {launch.model} (log {log})", err=True)
    try:
        with (
            _signals_interrupt(),
            tempfile.TemporaryDirectory(prefix=f"rollout-gateway-{launch.kind}-") as scratch,
            start_engine(launch, Path(scratch), log=log, startup_timeout_s=startup_timeout_s) as running,
        ):
            typer.echo(f"{launch.kind} serving {launch.model} as {launch.served_name!r} at {running.url}")
            code = running.process.wait()
    except KeyboardInterrupt:
        typer.echo(f"{launch.kind} stopped", err=True)
        return 0
    typer.echo(f"{launch.kind} exited by itself with {code} (log {log})", err=True)
    if code < 0:
        return 128 - code  # killed by signal N: 128 + N, as a shell reports it
    return code or 1  # a server that ends by itself has failed, whatever its status says


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt once, so the engine's process group is stopped on the way out;
    a second one while it stops is only reported (the stop is bounded: SIGKILL after 30 s)."""
    import signal

    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt
        typer.echo("stopping the engine already", err=True)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


trajectories = typer.Typer(help="Inspect the trajectory store in Redis.", no_args_is_help=True)
app.add_typer(trajectories, name="trajectories")

RedisUrl = Annotated[str, typer.Option("--redis-url", envvar="RG_REDIS__URL", help="The gateway's Redis.")]
Prefix = Annotated[str, typer.Option(help="Key prefix (store.prefix).")]


@trajectories.command("stats")
def trajectories_stats(redis_url: RedisUrl = "redis://127.0.0.1:6379/0", prefix: Prefix = "rg:") -> None:
    """Stream length, unconsumed trajectories, active/abandoned sessions, weight version, consumer groups."""
    import uvloop
    from rich.console import Console
    from rich.table import Table

    from gateway.store import Keys, connect, inspect_store

    async def read() -> dict[str, Any]:
        client = connect(redis_url)
        try:
            return await inspect_store(client, Keys(prefix))
        finally:
            await client.aclose()

    stats = _or_exit(lambda: uvloop.run(read()))
    table = Table(title=f"trajectory store at {redis_url}", show_header=False)
    for key, value in stats.items():
        if key != "consumer_groups":
            table.add_row(key.replace("_", " "), str(value))
    for group in stats["consumer_groups"]:
        table.add_row(
            f"group {group.get('name')}", f"consumers {group.get('consumers')}, pending {group.get('pending')}"
        )
    Console().print(table)


@trajectories.command("tail")
def trajectories_tail(
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0",
    prefix: Prefix = "rg:",
    count: Annotated[int, typer.Option("-n", "--count", min=1, max=10_000)] = 10,
) -> None:
    """The newest finished trajectories: session, group, reward, samples, and whether the entry is the real one."""
    import uvloop
    from rich.console import Console
    from rich.table import Table

    from gateway.store import Keys, connect, tail_trajectories

    async def read() -> list[dict[str, Any]]:
        client = connect(redis_url)
        try:
            return await tail_trajectories(client, Keys(prefix), count)
        finally:
            await client.aclose()

    rows = _or_exit(lambda: uvloop.run(read()))
    table = Table(title=f"newest {len(rows)} trajectories")
    for column in ("entry_id", "session_id", "group_id", "reward", "samples", "status", "real"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            *(
                str(row.get(c, ""))
                for c in ("entry_id", "session_id", "group_id", "reward", "samples", "status", "real")
            )
        )
    Console().print(table)


def _or_exit(call: Callable[[], T]) -> T:
    from gateway.errors import StoreError

    try:
        return call()
    except StoreError as exc:
        typer.echo(f"rollout-gateway: {exc}", err=True)
        raise typer.Exit(1) from exc


def main() -> None:
    app()
