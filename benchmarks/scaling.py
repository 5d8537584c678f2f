"""How `rollout-gateway serve --workers N` scales (DESIGN §13), measured where N cores cannot be had.

    python -m benchmarks.scaling                          # workers 1 2 4; /generate and /v1/completions
    python -m benchmarks.scaling --workers 1 2 --agents 64 --apis generate

Near-linear scaling on N cores needs three things, and each is measured here with N worker processes on
whatever cores the machine has (on a 2-core machine the replicas and the load generator share them, so the
throughput of the run itself says little):

* **no work added per request by running N processes**: CPU per request, summed over the workers (utime +
  stime from /proc, around the timed part only), compared with one process;
* **an even spread**: on Linux each worker listens on a socket of its own on the one port (SO_REUSEPORT) and the
  kernel hashes new connections over them; a client keeps its connection (keep-alive), so the spread of
  `--agents` connections decides each worker's share of the run. The busiest worker's share of the CPU is shown:
  on N dedicated cores that worker saturates first;
* **no shared bottleneck**: the only shared component is Redis (sessions, trajectories; `/generate` does not
  use it), one single-threaded process: its CPU per request bounds the whole gateway at 1 / that.

From those: **balance** = 1 / (N × busiest share), **projected req/s on N dedicated cores** = 1 / (busiest share ×
CPU per request), capped by the Redis bound, and **scaling efficiency** = that ÷ (N × one process's 1 / CPU per
request). Where the workers outnumber the free cores, CPU per request grows with N for reasons that dedicated
cores would not have (time slicing; less work per event-loop pass), so the efficiency is then a lower bound.
Runs alternate the worker counts (forward, then backward) so that drift in the machine's speed falls on all of
them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    child_pids,
    cpu_seconds,
    is_redis,
    machine_line,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)
from benchmarks.compare import GATEWAY_SETTINGS, REPLICA_ARGS, Bench, Target, Workload

APIS = {"generate": "gateway-generate", "completions": "gateway"}  # compare.py's target names pick the route


@dataclass
class WorkerTarget(Target):
    """A `serve --workers N` gateway as a compare.py target: `cpu()` sums the workers, Redis counts apart, and
    every reading is kept (`readings`) for the per-worker shares."""

    gateway: GatewayProcess | None = None
    readings: list[tuple[list[float], float]] = field(default_factory=list)

    def cpu(self) -> dict[str, float]:
        assert self.gateway is not None and self.gateway.pid is not None
        workers = [cpu_seconds(pid) or 0.0 for pid in self.gateway.worker_pids()]
        redis = sum(cpu_seconds(pid) or 0.0 for pid in child_pids(self.gateway.pid) if is_redis(pid))
        self.readings.append((workers, redis))
        return {"proxy": sum(workers), "children": redis}


@dataclass
class Row:
    api: str
    workers: int
    req_s: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    redis_ms: list[float] = field(default_factory=list)
    busiest: list[float] = field(default_factory=list)
    errors: int = 0


@dataclass(frozen=True)
class Options:
    workers: tuple[int, ...]
    apis: tuple[str, ...]
    agents: int
    rounds: int
    duration_s: float
    timeout_s: float


def workload(options: Options) -> Workload:
    return Workload(
        "short",
        sessions=options.agents,
        turns=0,
        requests=options.agents * 40,
        min_tokens=1,
        max_tokens=8,
        stream=False,
        duration_s=options.duration_s,
    )


async def measure(options: Options, console: Console) -> dict[tuple[str, int], Row]:
    rows = {(api, n): Row(api, n) for api in options.apis for n in options.workers}
    with sim_replicas([REPLICA_ARGS, REPLICA_ARGS]) as replicas, contextlib.ExitStack() as stack:
        entries = [sim_replica_entry(replica.url, "vllm") for replica in replicas]
        gateways = {
            n: stack.enter_context(GatewayProcess(entries, GATEWAY_SETTINGS, workers=n)) for n in options.workers
        }
        console.print(f"2 replicas up; gateways with {', '.join(map(str, options.workers))} worker processes")
        bench = Bench(replicas, None, options.timeout_s)
        try:
            for round_number in range(options.rounds):
                order = options.workers if round_number % 2 == 0 else options.workers[::-1]
                for api in options.apis:
                    for n in order:
                        gateway = gateways[n]
                        target = WorkerTarget(APIS[api], gateway.url, gateway.pid, gateway)
                        run = await bench.run(target, workload(options))
                        (workers0, redis0), (workers1, redis1) = target.readings[-2:]
                        spent = [after - before for before, after in zip(workers0, workers1, strict=True)]
                        row = rows[(api, n)]
                        row.errors += run.errors
                        if run.ok and sum(spent) > 0:
                            row.req_s.append(run.ok / run.wall_s)
                            row.cpu_ms.append(sum(spent) / run.ok * 1e3)
                            row.redis_ms.append((redis1 - redis0) / run.ok * 1e3)
                            row.busiest.append(max(spent) / sum(spent))
                        shares = " ".join(f"{s / max(sum(spent), 1e-9):.2f}" for s in spent)
                        console.print(
                            f"  round {round_number + 1}  {api:<11} workers {n}  {run.ok:>6,} ok "
                            f"{run.errors:>3} errors  shares {shares}"
                        )
        finally:
            await bench.http.aclose()
    return rows


def report(console: Console, options: Options, rows: dict[tuple[str, int], Row]) -> None:
    console.print(f"\nrollout-gateway serve --workers N — {machine_line()}; {options.agents} keep-alive agents")
    for api in options.apis:
        base = rows[(api, options.workers[0])]
        base_capacity = 1e3 / statistics.median(base.cpu_ms) if base.cpu_ms else float("nan")
        table = []
        for n in options.workers:
            row = rows[(api, n)]
            if not row.cpu_ms:
                table.append([str(n), *["—"] * 9, str(row.errors)])
                continue
            cpu, redis, busiest = (statistics.median(v) for v in (row.cpu_ms, row.redis_ms, row.busiest))
            projected = 1e3 / (busiest * cpu)
            redis_bound = 1e3 / redis if redis > 0 else float("inf")
            capped = min(projected, redis_bound)
            efficiency = capped / (n * base_capacity / options.workers[0])
            table.append(
                [
                    str(n),
                    f"{statistics.median(row.req_s):,.0f}",
                    f"{cpu:.3f}",
                    f"{cpu / statistics.median(base.cpu_ms):.2f}",
                    f"{busiest:.0%}",
                    f"{1 / (n * busiest):.2f}",
                    f"{redis:.3f}",
                    "—" if redis_bound == float("inf") else f"{redis_bound:,.0f}",
                    f"{capped:,.0f}",
                    f"{efficiency:.2f}",
                    str(row.errors),
                ]
            )
        print_table(
            console,
            f"{api}: 1-8 tokens, not streamed",
            [
                "workers",
                "req/s here",
                "CPU ms/req",
                "÷ first",
                "busiest worker",
                "balance",
                "Redis ms/req",
                "Redis bound req/s",
                "projected req/s",
                "efficiency",
                "errors",
            ],
            table,
        )
    console.print(
        "[dim]How to read this:[/] medians over the rounds. CPU = all workers' utime+stime per request; ÷ first = "
        "against the first worker count: where N workers, the replicas and the load generator share fewer cores, "
        "it grows with N (time slicing, and less work per event-loop pass), so efficiency is a lower bound there. "
        "busiest worker = its share of that CPU (1/N is even); balance = 1 / (N × that share), the efficiency on "
        "dedicated cores if CPU per request stayed that of one process. projected req/s = 1 / (busiest share × CPU "
        "per request), capped by the Redis bound (1 / Redis CPU per request: one single-threaded Redis for all "
        "workers). efficiency = projected ÷ (N × one process's 1 / CPU per request). req/s here = this machine."
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts to compare (1 2 4)")
    p.add_argument("--apis", nargs="+", choices=sorted(APIS), default=["generate", "completions"])
    p.add_argument("--agents", type=int, default=256, help="concurrent keep-alive agents (256)")
    p.add_argument("--rounds", type=int, default=2, help="runs per worker count, alternating order (2)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of each timed run (6)")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of each load-generator run, s")
    return p


async def main_async(options: Options, console: Console) -> bool:
    rows = await measure(options, console)
    report(console, options, rows)
    return all(row.errors == 0 for row in rows.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workers = tuple(dict.fromkeys(args.workers))
    if min(workers) < 1 or args.rounds < 1 or args.agents < 1:
        raise SystemExit("--workers, --rounds and --agents must be ≥ 1")
    options = Options(workers, tuple(dict.fromkeys(args.apis)), args.agents, args.rounds, args.duration, args.timeout)
    total = options.timeout_s * len(workers) * len(options.apis) * options.rounds
    return run_benchmark(main_async, options, total)


if __name__ == "__main__":
    sys.exit(main())
