"""Two checkouts of the gateway side by side on the same replicas: the CPU a change saves, on a noisy machine.

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.ab /tmp/before .                          # /generate, short requests at c=64
    python -m benchmarks.ab /tmp/before . --api completions --workload rl --rounds 6
    python -m benchmarks.ab /tmp/before . --api completions --one-turn      # no session: one-turn sessions
    python -m benchmarks.ab . . --set-b RG_GENERATION__STREAM_PACING_S=0.4 --workload rl   # one tree, two settings
    python -m benchmarks.ab /tmp/before . --dialect sglang --workload rl   # SGLang replicas (cumulative events)
    python -m benchmarks.ab /tmp/before . --together --rounds 8    # both loaded at once: the steadiest ratio
    python -m benchmarks.ab /tmp/before . --together --prompt-words 1000   # ~3,100-token prompts

Each checkout runs as its own `rollout-gateway serve` (the package imported from that checkout through
`PYTHONPATH`), pinned to the same core, over the same two simulator replicas; the load generator drives them in
turns, ABBA (A B, B A, A B, ...), so that drift in the machine's speed falls on both alike. Reported: each run's
CPU per request (or per token for streamed workloads) from its CPU clock, the median of each side and their ratio. On
a shared machine one run moves by more than most changes save; a ratio of medians over 4-6 rounds moves far less.
`--together` loads both in the same moments instead (each its own load generators, both on the proxy's core), so
that a slower or faster spell of the machine, which moves single runs by far more than most changes save, falls on
both within each round; the column "paired" reads the median of the rounds' own ratios. `--set-b NAME=VALUE` sets an
environment variable for the second gateway only (a `RG_*` setting: one checkout against itself with another
configuration); `--layout` places the processes as `benchmarks.compare` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    machine_line,
    pin_process,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)
from benchmarks.compare import (
    GATEWAY_SETTINGS,
    REPLICA_ARGS,
    Bench,
    LayoutName,
    Target,
    Workload,
    add_layout_arguments,
    place_processes,
    workloads,
)
from benchmarks.scaling import APIS


@dataclass(frozen=True)
class Options:
    checkouts: tuple[Path, Path]
    api: str
    workload: Workload
    rounds: int
    timeout_s: float
    env_b: tuple[tuple[str, str], ...] = ()  # environment of the second gateway only
    layout: LayoutName = "shared"
    loadgens: int = 2
    cpus: tuple[int, ...] = ()
    dialect: str = "vllm"  # of the simulator replicas (sglang: cumulative stream events, as SGLang's default)
    together: bool = False  # each round runs both checkouts at the same time instead of one after the other


@dataclass
class Side:
    checkout: Path
    env: tuple[tuple[str, str], ...] = ()
    units: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def name(self) -> str:
        """The checkout, and the settings that set this side apart."""
        return " ".join([str(self.checkout), *(f"{name}={value}" for name, value in self.env)])


@contextlib.contextmanager
def environment(checkout: Path, extra: Sequence[tuple[str, str]] = ()) -> Iterator[None]:
    """`PYTHONPATH` = `checkout`, and the `extra` variables, while a gateway process starts (it inherits them)."""
    names = ["PYTHONPATH", *(name for name, _ in extra)]
    before = {name: os.environ.get(name) for name in names}
    os.environ.update({"PYTHONPATH": str(checkout), **dict(extra)})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def measure(options: Options, console: Console) -> list[Side]:
    chosen = options.workload
    where = place_processes(options.layout, options.loadgens, True, options.cpus)
    sides = [Side(options.checkouts[0]), Side(options.checkouts[1], options.env_b)]
    replica_args = replica_arguments(options.dialect)
    with sim_replicas([replica_args, replica_args]) as replicas, contextlib.ExitStack() as stack:
        for replica, cpus in zip(replicas, where.replicas, strict=True):
            if replica.pid is not None:
                pin_process(replica.pid, cpus)
        entries = [sim_replica_entry(replica.url, options.dialect) for replica in replicas]
        targets = []
        for side in sides:
            with environment(side.checkout, side.env):
                gateway = stack.enter_context(GatewayProcess(entries, GATEWAY_SETTINGS, cpus=where.proxy))
            targets.append(Target(APIS[options.api], gateway.url, gateway.pid))
        bench = Bench(replicas, options.timeout_s, where.loadgens)
        try:
            await bench.replica_post("/sim/speed", {"token_delay": chosen.token_delay_s})
            for round_number in range(options.rounds):
                order = list(zip(sides, targets, strict=True))
                if round_number % 2:
                    order.reverse()
                if options.together:  # both under load at once: what slows the machine slows both alike
                    runs = await asyncio.gather(*(bench.run(target, chosen) for _, target in order))
                else:
                    runs = [await bench.run(target, chosen) for _, target in order]
                for (side, _), run in zip(order, runs, strict=True):
                    side.errors += run.errors
                    count = run.tokens if chosen.stream else run.ok
                    if count:
                        side.units.append(run.cpu_proxy_s / count * (1e6 if chosen.stream else 1e3))
                    console.print(f"  round {round_number + 1}  {side.name}  {run.ok:,} ok  {run.errors} errors")
        finally:
            await bench.http.aclose()
    return sides


def replica_arguments(dialect: str) -> tuple[str, ...]:
    """`REPLICA_ARGS` with the simulator's protocol set to `dialect`."""
    args = list(REPLICA_ARGS)
    args[args.index("--dialect") + 1] = dialect
    return tuple(args)


def report(console: Console, options: Options, sides: list[Side]) -> None:
    unit = "CPU µs/token" if options.workload.stream else "CPU ms/request"
    medians = [statistics.median(side.units) if side.units else float("nan") for side in sides]
    paired = paired_ratio(sides[0].units, sides[1].units)
    rows = [
        [
            side.name,
            " ".join(f"{u:.3f}" for u in side.units),
            f"{median:.3f}",
            f"{median / medians[0]:.3f}" if medians[0] > 0 else "—",  # a first side that read no CPU at all
            "1.000" if index == 0 else f"{paired:.3f}",
        ]
        for index, (side, median) in enumerate(zip(sides, medians, strict=True))
    ]
    console.print(f"\n{machine_line()}")
    print_table(
        console,
        f"{options.api}, {options.workload.name}: {unit}, each run and the median",
        ["checkout", "runs", "median", "÷ first", "paired ÷ first"],
        rows,
        "CPU = the gateway process's user + system time (its CPU clock) during each timed run, per request or per "
        "streamed token. "
        "paired = the median of each round's ratio (its two runs were closest in time: with --together, at once).",
    )


def paired_ratio(first: Sequence[float], second: Sequence[float]) -> float:
    """The median of the per-round ratios second ÷ first (rounds where either side measured nothing are left out)."""
    ratios = [b / a for a, b in zip(first, second, strict=False) if a > 0 and b > 0]
    return statistics.median(ratios) if ratios else float("nan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.splitlines()[0])
    p.add_argument("checkouts", nargs=2, type=Path, help="two source trees of this project (before, after)")
    p.add_argument("--api", choices=sorted(APIS), default="generate")
    p.add_argument("--workload", default="short-c64", help="a workload of benchmarks.compare (short-c64)")
    p.add_argument("--rounds", type=int, default=4, help="runs per checkout, alternating (4)")
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm", help="the simulator replicas' protocol")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of each load-generator run, s")
    p.add_argument(
        "--together",
        action="store_true",
        help="load both gateways at once in each round (same core, same moment): a slower or faster spell of the "
        "machine then falls on both; the default runs them in turns",
    )
    p.add_argument(
        "--one-turn", action="store_true", help="requests name no session: each is a one-turn session of its own"
    )
    p.add_argument(
        "--prompt-words",
        type=int,
        default=None,
        help="words of each first-turn prompt instead of the workload's (about 3 tokens a word; the replicas take "
        "4,096 tokens at most)",
    )
    p.add_argument(
        "--set-b",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the second gateway only, e.g. RG_GENERATION__STREAM_PACING_S=0.4 (repeatable)",
    )
    add_layout_arguments(p)
    return p


async def main_async(options: Options, console: Console) -> bool:
    sides = await measure(options, console)
    report(console, options, sides)
    return all(side.errors == 0 for side in sides)


def chosen_workload(args: argparse.Namespace) -> Workload:
    """The workload `--workload` names, as `--one-turn` and `--prompt-words` change it."""
    by_name = {w.name: w for w in workloads(False, None, None, 0.03)}
    if args.workload not in by_name:
        raise SystemExit(f"unknown workload {args.workload!r}; choose from {sorted(by_name)}")
    workload = by_name[args.workload]
    if args.one_turn:
        workload = dataclasses.replace(workload, name=f"{workload.name}, one-turn", one_turn=True)
    if args.prompt_words is not None:
        words = max(1, args.prompt_words)
        workload = dataclasses.replace(workload, name=f"{workload.name}, {words}-word prompts", prompt_words=words)
    return workload


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = chosen_workload(args)
    checkouts = tuple(path.resolve() for path in args.checkouts)
    for checkout in checkouts:
        if not (checkout / "gateway" / "app.py").exists():
            raise SystemExit(f"{checkout} is not a checkout of this project (no gateway/app.py)")
    env_b = []
    for setting in args.set_b:
        name, equals, value = setting.partition("=")
        if not equals or not name:
            raise SystemExit(f"--set-b takes NAME=VALUE, not {setting!r}")
        env_b.append((name, value))
    options = Options(
        (checkouts[0], checkouts[1]),
        args.api,
        workload,
        max(1, args.rounds),
        args.timeout,
        env_b=tuple(env_b),
        layout=args.layout,
        loadgens=args.loadgens,
        cpus=tuple(args.cpus or ()),
        dialect=args.dialect,
        together=args.together,
    )
    return run_benchmark(main_async, options, options.timeout_s * 2 * options.rounds)


if __name__ == "__main__":
    sys.exit(main())
