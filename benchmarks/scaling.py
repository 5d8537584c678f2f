"""How `rollout-gateway serve --workers N` scales (docs/architecture.md §13): projected on a small machine, measured
on a large one.

    python -m benchmarks.scaling                          # workers 1 2 4; /generate and /v1/completions
    python -m benchmarks.scaling --workers 1 2 --agents 64 --apis generate
    python -m benchmarks.scaling --layout dedicated --workers 1 2 4 --json scaling.json   # a 16-core machine

Two layouts (`--layout`; `auto`, the default, picks `dedicated` where the CPUs this process may use hold it):

* **shared** (small machines): N worker processes on whatever cores there are, beside two simulator replicas and
  one load generator, nothing pinned. The throughput of the run says little; what near-linear scaling needs is
  measured instead (below), and from it the throughput N dedicated cores would give is projected.
* **dedicated**: worker i of every gateway pinned to a CPU of its own (on distinct physical cores; their SMT
  siblings are kept idle unless `--use-siblings`), each gateway's supervisor and embedded redis-server on one more
  CPU (so Redis never takes a worker's core), and the remaining CPUs split between `--replicas` simulator replicas
  and `--loadgens` load-generator processes, one CPU each (by default a quarter of them load generators). The agents
  are split between the load generators, which all warm up, then get `go` at once; **measured req/s** = their ok
  requests summed ÷ the longest one's timed wall time, and **measured efficiency** = req/s(N) ÷ (N × req/s(first N)
  ÷ first N). Each round also runs the same load generators straight at the replicas (`/v1/completions`): that
  req/s is the ceiling the replicas and load generators set. The busiest worker's, the busiest replica's and the
  load generators' CPU use of their cores are shown; where the busiest worker used less than 85 % of its core a
  warning says so: the gateway was then not the bottleneck, and the measured req/s is not its capacity.
  `--cpus` names the CPUs to lay out (default: this process's affinity); `--no-pin` computes the layout but pins
  nothing (a smoke test on a small machine; its numbers mean nothing).

What near-linear scaling needs, measured in both layouts:

* **no work added per request by running N processes**: CPU per request, summed over the workers (user +
  system time from each one's CPU clock, around the timed part only), compared with one process;
* **an even spread**: on Linux each worker listens on a socket of its own on the one port (SO_REUSEPORT) and the
  kernel hashes new connections over them; a client keeps its connection (keep-alive), so the spread of
  `--agents` connections decides each worker's share of the run. The busiest worker's share of the CPU is shown:
  on N dedicated cores that worker saturates first;
* **no shared bottleneck**: the only shared component is Redis (every recorded turn writes its sample there,
  `/generate`'s with a session included), one single-threaded process: its CPU per request bounds the whole
  gateway at 1 / that.

From those: **balance** = 1 / (N × busiest share), **projected req/s on N dedicated cores** = 1 / (busiest share ×
CPU per request), capped by the Redis bound, and **scaling efficiency** = that ÷ (N × one process's 1 / CPU per
request). Where the workers outnumber the free cores, CPU per request grows with N for reasons that dedicated
cores would not have (time slicing; less work per event-loop pass), so the efficiency is then a lower bound.
Runs alternate the worker counts (forward, then backward) so that drift in the machine's speed falls on all of
them alike. Every run is bounded in requests and in time (`--duration`, `--timeout`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
from rich.console import Console

from benchmarks._harness import (
    BenchmarkError,
    GatewayProcess,
    Percentiles,
    child_pids,
    cpu_seconds,
    is_redis,
    machine_line,
    ms,
    pin_process,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)
from benchmarks.compare import GATEWAY_SETTINGS, REPLICA_ARGS, Bench, RunResult, Target, Workload

APIS = {"generate": "gateway-generate", "completions": "gateway"}  # compare.py's target names pick the route
BUSY = 0.85  # below this share of its core, the busiest worker was not what limited the run
# Of the CPUs left for replicas and load generators, the load generators' share: per request a replica spends several
# times a load generator's CPU (more on /v1/completions than on /generate, where the load generator tokenizes).
LOADGEN_SHARE = 1 / 4


@dataclass(frozen=True)
class Layout:
    """Which CPU each process runs on (None: not pinned). Dedicated: worker i of every gateway on `workers[i]`, the
    supervisors and Redis on `redis`; shared: `workers` empty. `idle` CPUs are left unused (SMT siblings of the
    workers' CPUs). `pin` False: the layout is computed but nothing is pinned."""

    replicas: tuple[int | None, ...]
    loadgens: tuple[int | None, ...]
    workers: tuple[int, ...] = ()
    redis: int | None = None
    idle: tuple[int, ...] = ()
    pin: bool = False

    @property
    def dedicated(self) -> bool:
        return bool(self.workers)

    def cpus(self, cpu: int | None) -> set[int] | None:
        return {cpu} if self.pin and cpu is not None else None


SHARED = Layout(replicas=(None, None), loadgens=(None,))


def thread_siblings(cpu: int) -> set[int]:
    """The CPUs sharing `cpu`'s physical core (SMT threads), from sysfs; just `cpu` where that is unknown."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    found = {cpu}
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def plan(
    cpus: Sequence[int],
    workers: int,
    replicas: int | None = None,
    loadgens: int | None = None,
    pin: bool = True,
    use_siblings: bool = False,
) -> Layout:
    """The dedicated layout of `workers` worker CPUs, Redis and the replicas and load generators on `cpus`.

    The workers take the first thread of distinct physical cores (where `pin`, from the topology), and the other
    threads of those cores stay idle unless `use_siblings`: a worker sharing its core with a busy replica would do
    less work, more so as N grows and the replicas get busier. Raises ValueError when the CPUs are too few."""
    groups: dict[frozenset[int], list[int]] = {}
    for cpu in dict.fromkeys(cpus):
        siblings = thread_siblings(cpu) & set(cpus) if pin else {cpu}
        groups.setdefault(frozenset(siblings), []).append(cpu)
    order = [group[0] for group in groups.values()] + [cpu for group in groups.values() for cpu in group[1:]]
    worker_cpus = order[:workers]
    idle = set() if use_siblings else {s for group in groups for s in group if set(worker_cpus) & group}
    idle -= set(worker_cpus)
    rest = [cpu for cpu in order[workers:] if cpu not in idle]
    if len(worker_cpus) < workers or len(rest) < 3:
        raise ValueError(
            f"{len(order)} CPUs hold no dedicated layout for {workers} workers (idle siblings {sorted(idle)})"
        )
    redis, rest = rest[0], rest[1:]
    if loadgens is None:
        loadgens = len(rest) - replicas if replicas is not None else max(1, round(len(rest) * LOADGEN_SHARE))
    replicas = len(rest) - loadgens if replicas is None else replicas
    if replicas < 1 or loadgens < 1 or replicas + loadgens > len(rest):
        raise ValueError(f"{len(rest)} CPUs left for {replicas} replicas and {loadgens} load generators")
    return Layout(
        replicas=tuple(rest[:replicas]),
        loadgens=tuple(rest[replicas : replicas + loadgens]),
        workers=tuple(worker_cpus),
        redis=redis,
        idle=tuple(sorted(idle)),
        pin=pin,
    )


@dataclass
class WorkerTarget(Target):
    """A `serve --workers N` gateway (or, without one, the replicas directly) as a compare.py target: `cpu()` sums
    the workers, Redis counts apart, and every reading (workers, Redis, each replica) is kept for shares and use."""

    gateway: GatewayProcess | None = None
    replica_pids: list[int] = field(default_factory=list)
    readings: list[tuple[list[float], float, list[float]]] = field(default_factory=list)

    def cpu(self) -> dict[str, float]:
        pids = self.gateway.worker_pids() if self.gateway is not None else []
        workers = [cpu_seconds(pid) or 0.0 for pid in pids]
        redis = sum(cpu_seconds(pid) or 0.0 for pid in child_pids(self.pid) if is_redis(pid)) if self.pid else 0.0
        self.readings.append((workers, redis, [cpu_seconds(pid) or 0.0 for pid in self.replica_pids]))
        return {"proxy": sum(workers), "children": redis}

    def spent(self) -> tuple[list[float], float, list[float]]:
        """CPU seconds of each worker, of Redis and of each replica between the last two readings."""
        (workers0, redis0, replicas0), (workers1, redis1, replicas1) = self.readings[-2:]
        return (
            [b - a for a, b in zip(workers0, workers1, strict=True)],
            redis1 - redis0,
            [b - a for a, b in zip(replicas0, replicas1, strict=True)],
        )


@dataclass
class Row:
    api: str
    workers: int
    req_s: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    redis_ms: list[float] = field(default_factory=list)
    busiest: list[float] = field(default_factory=list)
    worker_use: list[float] = field(default_factory=list)  # the busiest worker's CPU ÷ wall time
    replica_use: list[float] = field(default_factory=list)  # the busiest replica's
    loadgen_use: list[float] = field(default_factory=list)  # the load generators' mean
    replica_ms: list[float] = field(default_factory=list)  # all replicas' CPU per request
    loadgen_ms: list[float] = field(default_factory=list)  # all load generators' CPU per request
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def add(self, run: RunResult, target: WorkerTarget, loadgens: int) -> str:
        """Record one run; returns its progress line."""
        workers, redis, replicas = target.spent()
        self.errors += run.errors
        self.error_samples = (self.error_samples + run.error_samples)[:5]
        if run.ok and run.wall_s > 0:
            self.req_s.append(run.ok / run.wall_s)
            self.replica_use.append(max(replicas, default=0.0) / run.wall_s)
            self.loadgen_use.append(run.cpu_loadgen_s / loadgens / run.wall_s)
            self.replica_ms.append(sum(replicas) / run.ok * 1e3)
            self.loadgen_ms.append(run.cpu_loadgen_s / run.ok * 1e3)
            if sum(workers) > 0:
                self.cpu_ms.append(sum(workers) / run.ok * 1e3)
                self.redis_ms.append(redis / run.ok * 1e3)
                self.busiest.append(max(workers) / sum(workers))
                self.worker_use.append(max(workers) / run.wall_s)
        shares = " ".join(f"{s / max(sum(workers), 1e-9):.2f}" for s in workers)
        use = f"  busiest worker {max(workers) / run.wall_s:.0%} of a core" if workers and run.wall_s > 0 else ""
        latency = Percentiles.of(run.latencies)
        return (
            f"{run.ok:>7,} ok {run.errors:>3} errors  {run.ok / max(run.wall_s, 1e-9):>8,.0f} req/s  p99 "
            f"{ms(latency.p99)} max {ms(latency.max)} ms{use}  {shares}"
        )


@dataclass(frozen=True)
class Options:
    workers: tuple[int, ...]
    apis: tuple[str, ...]
    agents: int
    rounds: int
    duration_s: float
    timeout_s: float
    layout: Layout = SHARED
    json_path: Path | None = None


def workload(options: Options) -> Workload:
    # The count bound must not end a run before its duration: on dedicated cores it allows 50,000 requests a second
    # per worker CPU, far more than one gateway process serves.
    requests = options.agents * 40
    if options.layout.dedicated:
        requests = max(requests, int(options.duration_s * 50_000 * len(options.layout.workers)))
    return Workload(
        "short",
        sessions=options.agents,
        turns=0,
        requests=requests,
        min_tokens=1,
        max_tokens=8,
        stream=False,
        duration_s=options.duration_s,
    )


async def measure(options: Options, console: Console) -> dict[tuple[str, int], Row]:
    """Every (api, worker count) row, and in the dedicated layout ("direct", 0): the replicas straight."""
    layout = options.layout
    rows = {(api, n): Row(api, n) for api in options.apis for n in options.workers}
    replica_cpus = [layout.cpus(cpu) for cpu in layout.replicas]
    with (
        sim_replicas([REPLICA_ARGS] * len(layout.replicas), replica_cpus) as replicas,
        contextlib.ExitStack() as stack,
    ):
        entries = [sim_replica_entry(replica.url, "vllm") for replica in replicas]
        gateways = {}
        for n in options.workers:
            # Started on its own CPUs and the workers' (N workers importing at once on one CPU outlast the start-up
            # bound on a cold machine), then each process is moved to its place.
            start_cpus = {layout.redis, *layout.workers[:n]} if layout.pin and layout.redis is not None else None
            gateway = GatewayProcess(entries, GATEWAY_SETTINGS, 180.0, start_cpus, workers=n)
            gateways[n] = stack.enter_context(gateway)
            pin_workers(gateway, layout)
        replica_pids = [replica.pid for replica in replicas if replica.pid is not None]
        console.print(
            f"{len(replicas)} replicas up, {len(layout.loadgens)} load generator(s); gateways with "
            f"{', '.join(map(str, options.workers))} worker processes; {describe(layout)}"
        )
        bench = Bench(replicas, options.timeout_s, [layout.cpus(cpu) for cpu in layout.loadgens], affinity=False)
        try:
            for round_number in range(options.rounds):
                if layout.dedicated:
                    target = WorkerTarget("direct", "", None, replica_pids=replica_pids)
                    line = rows.setdefault(("direct", 0), Row("direct", 0)).add(
                        await bench.run(target, workload(options)), target, len(layout.loadgens)
                    )
                    console.print(f"  round {round_number + 1}  direct to the replicas   {line}")
                order = options.workers if round_number % 2 == 0 else options.workers[::-1]
                for api in options.apis:
                    for n in order:
                        gateway = gateways[n]
                        target = WorkerTarget(APIS[api], gateway.url, gateway.pid, gateway, replica_pids)
                        run = await bench.run(target, workload(options))
                        line = rows[(api, n)].add(run, target, len(layout.loadgens))
                        console.print(f"  round {round_number + 1}  {api:<11} workers {n}  {line}")
        finally:
            await bench.http.aclose()
    return rows


def pin_workers(gateway: GatewayProcess, layout: Layout) -> None:
    """Worker i of a started gateway onto `layout.workers[i]`, the supervisor and its Redis onto `layout.redis`."""
    if not layout.pin or not layout.workers or gateway.pid is None:
        return
    pin_process(gateway.pid, layout.cpus(layout.redis))
    for pid in child_pids(gateway.pid):
        if is_redis(pid):
            pin_process(pid, layout.cpus(layout.redis))
    pids = gateway.worker_pids()
    if len(pids) != gateway.workers:
        raise BenchmarkError(f"expected {gateway.workers} worker processes, found {len(pids)}: {pids}")
    for pid, cpu in zip(pids, layout.workers, strict=False):
        pin_process(pid, {cpu})


def describe(layout: Layout) -> str:
    if not layout.dedicated:
        return "shared layout: nothing pinned"
    pinned = "pinned" if layout.pin else "NOT pinned (--no-pin: the numbers mean nothing)"
    return (
        f"dedicated layout, {pinned}: workers on CPUs {list(layout.workers)}, supervisors + Redis on {layout.redis}, "
        f"replicas on {list(layout.replicas)}, load generators on {list(layout.loadgens)}, idle {list(layout.idle)}"
    )


def figures(options: Options, rows: dict[tuple[str, int], Row], api: str, n: int) -> dict[str, float]:
    """The medians over the rounds of one row, and what follows from them (NaN where nothing was measured)."""
    row, base = rows[(api, n)], rows[(api, options.workers[0])]
    nan = math.nan

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else nan

    cpu, redis, busiest, req_s = median(row.cpu_ms), median(row.redis_ms), median(row.busiest), median(row.req_s)
    base_capacity = 1e3 / median(base.cpu_ms) if base.cpu_ms else nan
    projected = 1e3 / (busiest * cpu)
    redis_bound = 1e3 / redis if redis > 0 else math.inf
    capped = min(projected, redis_bound)
    first = options.workers[0]
    return {
        "req_s": req_s,
        "cpu_ms": cpu,
        "cpu_ratio": cpu / median(base.cpu_ms) if base.cpu_ms else nan,
        "busiest_share": busiest,
        "balance": 1 / (n * busiest),
        "redis_ms": redis,
        "redis_bound": redis_bound,
        "projected_req_s": capped,
        "efficiency": capped / (n * base_capacity / first),
        "measured_efficiency": req_s / (n * median(base.req_s) / first) if base.req_s else nan,
        "worker_use": median(row.worker_use),
        "replica_use": median(row.replica_use),
        "loadgen_use": median(row.loadgen_use),
        "errors": row.errors,
    }


def show(value: float, spec: str) -> str:
    return "—" if value != value else format(value, spec)  # NaN: nothing measured


def report(console: Console, options: Options, rows: dict[tuple[str, int], Row]) -> None:
    layout = options.layout
    console.print(f"\nrollout-gateway serve --workers N — {machine_line()}; {options.agents} keep-alive agents")
    console.print(describe(layout))
    direct = rows.get(("direct", 0))
    for api in options.apis:
        table, warnings = [], []
        for n in options.workers:
            f = figures(options, rows, api, n)
            cells = [
                show(f["req_s"], ",.0f"),
                show(f["cpu_ms"], ".3f"),
                show(f["cpu_ratio"], ".2f"),
                show(f["busiest_share"], ".0%"),
                show(f["balance"], ".2f"),
                show(f["redis_ms"], ".3f"),
                "—" if f["redis_bound"] == math.inf else show(f["redis_bound"], ",.0f"),
                show(f["projected_req_s"], ",.0f"),
                show(f["efficiency"], ".2f"),
            ]
            if layout.dedicated:
                cells.insert(1, show(f["measured_efficiency"], ".2f"))
                cells += [show(f[k], ".0%") for k in ("worker_use", "replica_use", "loadgen_use")]
                if not f["worker_use"] >= BUSY:  # NaN too: nothing measured
                    warnings.append(
                        f"warning: {api}, {n} workers: the busiest worker used {show(f['worker_use'], '.0%')} of its "
                        f"core (replicas' busiest {show(f['replica_use'], '.0%')}, load generators "
                        f"{show(f['loadgen_use'], '.0%')}): the gateway was not the bottleneck, so the measured req/s "
                        "is not its capacity"
                    )
            table.append([str(n), *cells, str(rows[(api, n)].errors)])
        columns = ["workers", "req/s here", "CPU ms/req", "÷ first", "busiest worker", "balance", "Redis ms/req"]
        columns += ["Redis bound req/s", "projected req/s", "efficiency"]
        if layout.dedicated:
            columns[1:2] = ["measured req/s", "measured efficiency"]
            columns += ["busiest worker's core", "busiest replica's core", "load gens' cores"]
        print_table(console, f"{api}: 1-8 tokens, not streamed", [*columns, "errors"], table)
        for warning in warnings:
            console.print(f"[yellow]{warning}[/]")
        for n in options.workers:
            for sample in rows[(api, n)].error_samples:
                console.print(f"  [red]{api}, {n} workers, error:[/] {sample}")
    if direct is not None and direct.req_s:
        console.print(
            f"direct to the {len(layout.replicas)} replicas (/v1/completions, the same load generators): "
            f"{statistics.median(direct.req_s):,.0f} req/s ({direct.errors} errors), the ceiling the replicas and load "
            f"generators set; busiest replica at {statistics.median(direct.replica_use):.0%} of its core, load "
            f"generators at {statistics.median(direct.loadgen_use):.0%}; CPU per request: replicas "
            f"{statistics.median(direct.replica_ms):.3f} ms, load generators "
            f"{statistics.median(direct.loadgen_ms):.3f} ms"
        )
    console.print(
        "[dim]How to read this:[/] medians over the rounds. CPU = all workers' utime+stime per request; ÷ first = "
        "against the first worker count: where N workers, the replicas and the load generator share fewer cores, "
        "it grows with N (time slicing, and less work per event-loop pass), so efficiency is a lower bound there. "
        "busiest worker = its share of that CPU (1/N is even); balance = 1 / (N × that share), the efficiency on "
        "dedicated cores if CPU per request stayed that of one process. projected req/s = 1 / (busiest share × CPU "
        "per request), capped by the Redis bound (1 / Redis CPU per request: one single-threaded Redis for all "
        "workers). efficiency = projected ÷ (N × one process's 1 / CPU per request). "
        + (
            "measured req/s = ok requests of all load generators ÷ the timed wall time, on dedicated cores; measured "
            "efficiency = that ÷ (N × the first worker count's per worker). …'s core = CPU time ÷ wall time of the "
            "busiest worker, the busiest replica, and the load generators' mean."
            if layout.dedicated
            else "req/s here = this machine."
        )
    )


def write_json(path: Path, options: Options, rows: dict[tuple[str, int], Row]) -> None:
    out = {
        "machine": machine_line(),
        "options": {k: v for k, v in asdict(options).items() if k not in ("layout", "json_path")},
        "layout": asdict(options.layout),
        "rows": [
            {
                **asdict(row),
                "figures": figures(options, rows, row.api, row.workers) if row.api != "direct" else {},
            }
            for row in rows.values()
        ],
    }
    # Infinity and NaN are not JSON: null instead.
    path.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts to compare (1 2 4)")
    p.add_argument("--apis", nargs="+", choices=sorted(APIS), default=["generate", "completions"])
    p.add_argument("--agents", type=int, default=256, help="concurrent keep-alive agents (256)")
    p.add_argument("--rounds", type=int, default=2, help="runs per worker count, alternating order (2)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of each timed run (6)")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of each load-generator run, s")
    p.add_argument("--layout", choices=["auto", "shared", "dedicated"], default="auto", help="see above (auto)")
    p.add_argument(
        "--replicas", type=int, default=None, help="dedicated: simulator replicas (default: 3/4 of the rest)"
    )
    p.add_argument("--loadgens", type=int, default=None, help="load-generator processes (dedicated default: 1/4)")
    p.add_argument("--cpus", type=int, nargs="+", default=None, help="dedicated: the CPUs to lay out (affinity)")
    p.add_argument("--no-pin", action="store_true", help="dedicated: compute the layout, pin nothing (smoke tests)")
    p.add_argument("--use-siblings", action="store_true", help="dedicated: use the workers' SMT siblings too")
    p.add_argument("--json", type=Path, default=None, help="also write every figure (and raw readings) here")
    return p


def layout_from(args: argparse.Namespace, max_workers: int) -> Layout:
    cpus = args.cpus or sorted(
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    if args.layout != "shared":
        try:
            return plan(cpus, max_workers, args.replicas, args.loadgens, not args.no_pin, args.use_siblings)
        except ValueError as exc:
            if args.layout == "dedicated":
                raise SystemExit(f"--layout dedicated: {exc}") from exc
    return Layout(replicas=(None,) * (args.replicas or 2), loadgens=(None,) * (args.loadgens or 1))


async def main_async(options: Options, console: Console) -> bool:
    rows = await measure(options, console)
    report(console, options, rows)
    if options.json_path is not None:
        write_json(options.json_path, options, rows)
    return all(row.errors == 0 for row in rows.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workers = tuple(dict.fromkeys(args.workers))
    if min(workers) < 1 or args.rounds < 1 or args.agents < 1:
        raise SystemExit("--workers, --rounds and --agents must be ≥ 1")
    layout = layout_from(args, max(workers))
    if args.agents < len(layout.loadgens):
        raise SystemExit("--agents must be at least the number of load generators")
    apis = tuple(dict.fromkeys(args.apis))
    options = Options(workers, apis, args.agents, args.rounds, args.duration, args.timeout, layout, args.json)
    total = options.timeout_s * (len(workers) * len(options.apis) + layout.dedicated) * options.rounds
    return run_benchmark(main_async, options, total)


if __name__ == "__main__":
    sys.exit(main())
