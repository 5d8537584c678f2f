"""Two checkouts of the gateway side by side on the same replicas: the CPU a change saves, on a noisy machine.

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.ab /tmp/before .                          # /generate, short requests at c=64
    python -m benchmarks.ab /tmp/before . --api completions --workload rl --rounds 6
    python -m benchmarks.ab /tmp/before . --api completions --one-turn      # no session: one-turn sessions

Each checkout runs as its own `rollout-gateway serve` (the package imported from that checkout through
`PYTHONPATH`), pinned to the same core, over the same two simulator replicas; the load generator drives them in
turns, ABBA (A B, B A, A B, ...), so that drift in the machine's speed falls on both alike. Reported: each run's
CPU per request (or per token for streamed workloads) from /proc, the median of each side and their ratio. On
this kind of shared 2-core machine one run moves by ±10 %, a ratio of medians over 4-6 rounds by a few percent.
"""

from __future__ import annotations

import argparse
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
from benchmarks.compare import GATEWAY_SETTINGS, REPLICA_ARGS, Bench, Target, Workload, cpu_split, workloads
from benchmarks.scaling import APIS


@dataclass(frozen=True)
class Options:
    checkouts: tuple[Path, Path]
    api: str
    workload: Workload
    rounds: int
    timeout_s: float


@dataclass
class Side:
    checkout: Path
    units: list[float] = field(default_factory=list)
    errors: int = 0


@contextlib.contextmanager
def python_path(checkout: Path) -> Iterator[None]:
    """`PYTHONPATH` = `checkout` while a gateway process starts (it inherits the environment)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(checkout)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


async def measure(options: Options, console: Console) -> list[Side]:
    chosen = options.workload
    replica_cpus, proxy_cpus = cpu_split(True)
    sides = [Side(checkout) for checkout in options.checkouts]
    with sim_replicas([REPLICA_ARGS, REPLICA_ARGS]) as replicas, contextlib.ExitStack() as stack:
        for replica in replicas:
            if replica.pid is not None:
                pin_process(replica.pid, replica_cpus)
        entries = [sim_replica_entry(replica.url, "vllm") for replica in replicas]
        targets = []
        for side in sides:
            with python_path(side.checkout):
                gateway = stack.enter_context(GatewayProcess(entries, GATEWAY_SETTINGS, cpus=proxy_cpus))
            targets.append(Target(APIS[options.api], gateway.url, gateway.pid))
        bench = Bench(replicas, replica_cpus, options.timeout_s)
        try:
            await bench.replica_post("/sim/speed", {"token_delay": chosen.token_delay_s})
            for round_number in range(options.rounds):
                order = list(zip(sides, targets, strict=True))
                for side, target in order if round_number % 2 == 0 else order[::-1]:
                    run = await bench.run(target, chosen)
                    side.errors += run.errors
                    count = run.tokens if chosen.stream else run.ok
                    if count:
                        side.units.append(run.cpu_proxy_s / count * (1e6 if chosen.stream else 1e3))
                    console.print(f"  round {round_number + 1}  {side.checkout}  {run.ok:,} ok  {run.errors} errors")
        finally:
            await bench.http.aclose()
    return sides


def report(console: Console, options: Options, sides: list[Side]) -> None:
    unit = "CPU µs/token" if options.workload.stream else "CPU ms/request"
    medians = [statistics.median(side.units) if side.units else float("nan") for side in sides]
    rows = [
        [str(side.checkout), " ".join(f"{u:.3f}" for u in side.units), f"{median:.3f}", f"{median / medians[0]:.3f}"]
        for side, median in zip(sides, medians, strict=True)
    ]
    console.print(f"\n{machine_line()}")
    print_table(
        console,
        f"{options.api}, {options.workload.name}: {unit}, each run and the median",
        ["checkout", "runs", "median", "÷ first"],
        rows,
        "CPU = the gateway process's utime+stime (/proc) during each timed run, per request or per streamed token.",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.splitlines()[0])
    p.add_argument("checkouts", nargs=2, type=Path, help="two source trees of this project (before, after)")
    p.add_argument("--api", choices=sorted(APIS), default="generate")
    p.add_argument("--workload", default="short-c64", help="a workload of benchmarks.compare (short-c64)")
    p.add_argument("--rounds", type=int, default=4, help="runs per checkout, alternating (4)")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of each load-generator run, s")
    p.add_argument(
        "--one-turn", action="store_true", help="requests name no session: each is a one-turn session of its own"
    )
    return p


async def main_async(options: Options, console: Console) -> bool:
    sides = await measure(options, console)
    report(console, options, sides)
    return all(side.errors == 0 for side in sides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    by_name = {w.name: w for w in workloads(False, None, None, 0.03)}
    if args.workload not in by_name:
        raise SystemExit(f"unknown workload {args.workload!r}; choose from {sorted(by_name)}")
    checkouts = tuple(path.resolve() for path in args.checkouts)
    for checkout in checkouts:
        if not (checkout / "gateway" / "app.py").exists():
            raise SystemExit(f"{checkout} is not a checkout of this project (no gateway/app.py)")
    workload = by_name[args.workload]
    if args.one_turn:
        workload = dataclasses.replace(workload, name=f"{workload.name}, one-turn", one_turn=True)
    options = Options((checkouts[0], checkouts[1]), args.api, workload, max(1, args.rounds), args.timeout)
    return run_benchmark(main_async, options, options.timeout_s * 2 * options.rounds)


if __name__ == "__main__":
    sys.exit(main())
