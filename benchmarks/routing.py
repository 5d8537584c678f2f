"""This gateway's routing policies side by side with the Rust routers' on simulated replicas of limited capacity
(issue 51 §3): an agentic workload and a GRPO one, at moderate and high load, in one run, ABBA.

    python -m benchmarks.routing                           # 4 replicas, both workloads, moderate and high, 2 rounds
    python -m benchmarks.routing --loads low               # the low-load check: no policy of ours worse than sticky
    python -m benchmarks.routing --replicas 8 --targets rg-sticky rg-cache_aware sglang-cache_aware --json out.json
    python -m benchmarks.routing --routing load_bound=4 --targets rg-sticky rg-cache_aware   # another setting of ours

What runs where (2 cores): `--replicas` simulator replicas (vLLM dialect) in one process (`benchmarks.sim_fleet`)
and the load generator (`benchmarks.loadgen`, a process a run) on core 0; every target on core 1, all started once
and up for the whole run: this gateway once per policy (`rollout-gateway serve`, `routing.policy: <policy>`, its
embedded Redis; `rg-<policy>` rows: sticky, cache_aware, sticky_least_loaded, least_loaded, round_robin; GRPO groups
`together`, the default), sglang-router 0.3.2 (`cache_aware`; `manual`, its sticky policy in place of a
`consistent_hash` this version lacks: a new `X-SMG-Routing-Key` goes to a random worker, then stays there;
`round_robin`) and vllm-router 0.1.17 (`consistent_hash`, `sticky_least_loaded`, keyed on `X-Session-ID`), each with
its defaults; a router whose package is not installed is left out with a note.

The replicas' capacity is small, so that placement matters (`Capacity`): 8 requests decoded a step, 768 KV blocks
of 16 tokens (prefix cache included: a full cache evicts, a full batch preempts), a decode step of 4 ms + 0.1 ms a
running request (decode is bound by memory: a batch of 8 steps 1.2× slower than a request alone), 20 µs a prefilled
(uncached) prompt token, which stalls the batch (2,800 tokens: 14 steps). Workloads:

* `agentic`: agents, each one session after another of 10-30 turns (a random length); every session opens with the
  run's one system prompt (650 words, about 2,000 tokens) and its first message; each turn's prompt is the
  conversation so far (replies included) and 16 more words, 16-48 tokens a reply, whole; 0.1-0.5 s of tool call
  between turns. An agent joins its first session at a random turn (the earlier turns already in the prompt), so a
  short run sees the contexts of a steady state. Load: agents a replica (`AGENTS`); bounded in time (`--duration`);
* `grpo`: bursts of groups, one every `--burst-interval` s, open loop: a group is 8 requests with one prompt of
  900 words (about 2,800 tokens, its own per group), 64-192 tokens each, all sent at the burst. This gateway is
  told the group by the path (`/sessions/grp-<group>-<i>of8/v1/completions`: 8 member sessions of one group); the
  routers see no groups, so every member carries the group id as its session key (`X-Session-ID`,
  `X-SMG-Routing-Key`): the same information, and the mapping that lets a hashing router keep a group together,
  as a router's user would do. Load: groups a replica a burst (`GROUPS`).

Each run: a load-generator process started (no warm-up: loopback connections open in microseconds), the replicas'
prefix caches emptied (vLLM's `POST /reset_prefix_cache`), the engines' counters and the target's CPU read, the
timed part, read again. Every prompt names the run, so no run finds another's blocks; one seed a round draws the
words, lengths and waits, so the targets of a round get the same load.

Figures per (workload, load, target), over the rounds: prefix-cache hit rate (the engines' own
`vllm:prefix_cache_hits` ÷ `vllm:prefix_cache_queries`, prompt tokens), turn latency p50/p99 (send → whole answer),
group completion p50/p90 (the burst → the group's last answer), replica imbalance (the busiest replica's finished
requests ÷ the mean, `vllm:request_success`: 1.00 is even), preemptions (`vllm:num_preemptions`), tokens/s (answer
tokens ÷ the run's wall time), the target's CPU per turn (user + system time of all its threads, and of its
children: the gateway's Redis). `(×n.nn)`: the figure ÷ `rg-sticky`'s. Every answer is checked (status, token
count); a failed one is an error, shown, and makes the exit status 1.

After the tables, the issue's targets for the best gateway policy, said and never asserted: prefix hit rate at least
the best router's, group completion p50 at most 0.8× the best router's, and (at the lowest load measured) no policy
of ours worse than bounded-load HRW (`rg-sticky`): hit rate within 1 point, turn and group p50 within 1.05×.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import yaml
from rich.console import Console

from backends.launcher import pin_process
from benchmarks._harness import (
    BenchmarkError,
    GatewayProcess,
    cpu_seconds,
    machine_line,
    print_table,
    run_benchmark,
    sim_replica_entry,
)
from benchmarks.compare import (
    GATEWAY_SETTINGS,
    RouterProcess,
    RunResult,
    Target,
    cpu_split,
    loadgen_process,
    router_command,
)
from benchmarks.sim_fleet import SimFleet
from benchmarks.update_engine import metric_sums
from gateway.config import DEFAULT_TOKENIZER

OURS = ("rg-sticky", "rg-cache_aware", "rg-sticky_least_loaded", "rg-least_loaded", "rg-round_robin")
ROUTERS = (
    "sglang-cache_aware",
    "sglang-manual",
    "sglang-round_robin",
    "vllm-consistent_hash",
    "vllm-sticky_least_loaded",
)
WORKLOADS = ("agentic", "grpo")
LOADS = ("low", "moderate", "high")
AGENTS = {"low": 1, "moderate": 4, "high": 10}
"""Agentic load: agents a replica (each in a turn or a tool call at any time). At `high`, the replicas' KV no longer
holds every conversation (about 80 blocks of its own each, beside the system prompt's 125)."""
GROUPS = {"low": 0.25, "moderate": 0.75, "high": 1.5}
"""GRPO load: groups a replica a burst (at least one a burst). A group's members hold about 5 of a replica's 8 batch
slots for a second: `high` offers about 90 % of the batch slots, in bursts."""
BASELINE = "rg-sticky"
METRICS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "finished": "vllm:request_success_total",
    "preemptions": "vllm:num_preemptions_total",
}


@dataclass(frozen=True)
class Capacity:
    """Each simulator replica's capacity and speed (`rollout-gateway sim` options)."""

    max_num_seqs: int = 8
    num_gpu_blocks: int = 768
    block_size: int = 16
    token_delay_s: float = 0.004
    per_seq_delay_s: float = 0.0001
    prefill_delay_s: float = 0.00002
    max_model_len: int = 8192

    def sim_args(self) -> list[str]:
        return [
            "--dialect", "vllm", "--tokenizer", str(DEFAULT_TOKENIZER), "--eos-prob", "0",
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
            "--num-gpu-blocks", str(self.num_gpu_blocks), "--block-size", str(self.block_size),
            "--token-delay", str(self.token_delay_s), "--per-seq-delay", str(self.per_seq_delay_s),
            "--prefill-delay", str(self.prefill_delay_s), "--log-level", "warning",
        ]  # fmt: skip


@dataclass(frozen=True)
class Options:
    replicas: int = 4
    workloads: tuple[str, ...] = WORKLOADS
    loads: tuple[str, ...] = ("moderate", "high")
    targets: tuple[str, ...] = (*OURS, *ROUTERS)
    rounds: int = 2
    duration_s: float = 5.0  # agentic: no new turn after this long
    bursts: int = 4  # grpo: bursts a run
    burst_interval_s: float = 1.0
    system_words: int = 650
    group_words: int = 900
    timeout_s: float = 60.0  # bound of one run
    pin: bool = True
    capacity: Capacity = field(default_factory=Capacity)
    json_path: Path | None = None
    scale: float = 1.0  # agents and groups × this (at least one)
    routing: tuple[tuple[str, Any], ...] = ()  # more `routing:` settings of every gateway target (`--routing`)

    def agents(self, load: str) -> int:
        return max(1, round(AGENTS[load] * self.replicas * self.scale))

    def groups(self, load: str) -> int:
        return max(1, round(GROUPS[load] * self.replicas * self.scale))


def is_ours(target: str) -> bool:
    return target.startswith("rg-")


def spec(options: Options, workload: str, load: str, target: Target, tag: int, seed: int) -> dict[str, Any]:
    """The load generator's spec of one run of (workload, load) against `target`: `tag` names the run's sessions,
    groups and system prompt (no run finds another's blocks); `seed` draws its words, lengths and waits (one seed a
    round: every target of a round gets the same agents, the same turn counts and the same groups)."""
    common = {"api": "completions", "urls": [target.url], "tag": tag, "seed": seed, "timeout_s": options.timeout_s}
    common |= {"stream": False, "warmup": 0}  # every run opens its connections as it goes
    if workload == "agentic":
        return common | {
            "sessions": options.agents(load),
            "turns": 0,
            "requests": 10**9,
            "duration_s": options.duration_s,
            "min_tokens": 16,
            "max_tokens": 48,
            "grow": True,
            "echo": True,
            "prompt_words": 32,
            "append_words": 16,
            "system_words": options.system_words,
            "episode_turns": 10,
            "episode_turns_max": 30,
            "aged": True,
            "think_s": [0.1, 0.5],
            "start_spread_s": 0.5,
        }
    return common | {
        "sessions": options.groups(load),  # groups a burst
        "turns": 1,
        "requests": 0,
        "min_tokens": 64,
        "max_tokens": 192,
        "prompt_words": options.group_words,
        "group_size": 8,
        "bursts": options.bursts,
        "burst_interval_s": options.burst_interval_s,
        "group_route": "path" if is_ours(target.name) else "key",
    }


@dataclass
class Run(RunResult):
    """One run (or the sum of a cell's runs): the load generator's result, the target's CPU and the engines'
    counters over the timed part (`per_replica`: finished requests)."""

    preemptions: int = 0


class Fleet:
    """The replicas and what the benchmark reads of them (vLLM's routes: `/metrics`, `/reset_prefix_cache`; the
    CPU of their processes)."""

    def __init__(self, urls: list[str], pids: list[int]) -> None:
        self.urls = urls
        self.pids = pids
        self.http = httpx.AsyncClient(timeout=10.0)

    async def flush(self) -> None:
        """Empty every replica's prefix cache (refused while a request holds blocks: retried for a while)."""
        for url in self.urls:
            deadline = time.monotonic() + 10.0
            while not (await self.http.post(f"{url}/reset_prefix_cache")).json().get("success"):
                if time.monotonic() > deadline:
                    raise BenchmarkError(f"{url} refused to reset its prefix cache for 10 s")
                await asyncio.sleep(0.05)

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) or 0.0 for pid in self.pids)

    async def describe(self) -> str:
        """Each replica's batch, queue and KV now (the simulator's `/sim/state`): what a cut-off run left behind."""
        states = []
        for index, url in enumerate(self.urls):
            state = (await self.http.get(f"{url}/sim/state")).json()
            kv = max((rank["kv_usage"] for rank in state["ranks"]), default=0.0)
            states.append(f"replica {index}: {state['running']} running, {state['waiting']} waiting, KV {kv:.0%}")
        return "; ".join(states)

    async def counters(self) -> list[dict[str, float]]:
        out = []
        for url in self.urls:
            answer = await self.http.get(f"{url}/metrics")
            answer.raise_for_status()
            sums = metric_sums(answer.text, tuple(METRICS.values()))
            out.append({name: sums[metric] for name, metric in METRICS.items()})
        return out


async def run_once(fleet: Fleet, target: Target, run_spec: dict[str, Any], loadgen_cpus: set[int] | None) -> Run:
    """One timed run of the load generator against `target` (see the module's docstring for its steps)."""
    timeout = run_spec["timeout_s"] + 30
    async with loadgen_process(loadgen_cpus) as process:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(orjson.dumps(run_spec) + b"\n")
        await process.stdin.drain()
        warm = orjson.loads(await asyncio.wait_for(process.stdout.readline(), timeout))
        await fleet.flush()
        before, cpu0, sims0 = await fleet.counters(), target.cpu(), fleet.cpu()
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        line = await asyncio.wait_for(process.stdout.readline(), timeout)
        cpu1, sims1, after = target.cpu(), fleet.cpu(), await fleet.counters()
        await asyncio.wait_for(process.wait(), 30)
    if not line:
        raise BenchmarkError(f"the load generator against {target.name} stopped without a result")
    answer = orjson.loads(line)
    run = Run(**{k: v for k, v in answer.items() if k in Run.__dataclass_fields__})
    if warm.get("errors"):
        run.errors += warm["errors"]
        run.error_samples = (["warm-up: " + m for m in warm["error_samples"]] + run.error_samples)[:5]
    run.cpu_proxy_s, run.cpu_children_s = cpu1["proxy"] - cpu0["proxy"], cpu1["children"] - cpu0["children"]
    run.cpu_replicas_s = sims1 - sims0
    delta = [{k: a[k] - b[k] for k in METRICS} for a, b in zip(after, before, strict=True)]
    run.cache_queries = int(sum(d["queries"] for d in delta))
    run.cache_hits = int(sum(d["hits"] for d in delta))
    run.per_replica = [int(d["finished"]) for d in delta]
    run.preemptions = int(sum(d["preemptions"] for d in delta))
    return run


@contextlib.contextmanager
def targets_up(
    options: Options, urls: list[str], cpus: set[int] | None, console: Console
) -> Iterator[dict[str, tuple[Target, GatewayProcess | RouterProcess]]]:
    """Start every requested target in front of `urls`, pinned to `cpus`, all at once (a gateway takes seconds to
    import); a router not installed is left out with a note. Yields each target and its process (for its log); all
    stopped on exit."""
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rg-routing-")))
        processes: dict[str, GatewayProcess | RouterProcess] = {}
        for name in options.targets:
            if is_ours(name):
                settings = {
                    **GATEWAY_SETTINGS,
                    "routing": {**dict(options.routing), "policy": name.removeprefix("rg-")},
                    "model": {"max_model_len": options.capacity.max_model_len},
                }
                entries = [sim_replica_entry(url, "vllm") for url in urls]
                processes[name] = GatewayProcess(entries, settings, cpus=cpus)
            elif (command := router_command(name)) is not None:
                processes[name] = RouterProcess(name, [*command, "--worker-urls", *urls], cpus)
            else:
                console.print(f"[yellow]{name} left out: its package is not installed (pip install -e '.[bench]')[/]")
        for process in processes.values():
            stack.callback(process.stop)

        def start(process: GatewayProcess | RouterProcess) -> None:
            if isinstance(process, GatewayProcess):
                process.start()
            else:
                process.start(log_dir)

        with ThreadPoolExecutor(max_workers=max(1, len(processes))) as pool:
            for future in [pool.submit(start, process) for process in processes.values()]:
                future.result()  # the first failure raises, once every start has ended (all stopped on exit)
        yield {name: (Target(name, process.url, process.pid), process) for name, process in processes.items()}


Results = dict[tuple[str, str], dict[str, Run]]


async def run_all(options: Options, console: Console) -> Results:
    shared, proxy = cpu_split(options.pin)
    results: Results = {}
    with SimFleet(1, options.replicas, options.capacity.sim_args()) as sims:
        for pid in sims.pids:
            if shared:
                pin_process(pid, shared)
        with targets_up(options, sims.urls, proxy, console) as up:
            targets = [target for target, _ in up.values()]
            names = ", ".join(t.name for t in targets)
            where = f" (CPUs {sorted(shared)}; targets on {sorted(proxy)})" if shared and proxy else ""
            console.print(f"{options.replicas} replicas up{where}, targets: {names}")
            fleet = Fleet(sims.urls, sims.pids)
            tags = itertools.count(2, 2)  # the load generator uses tag + 1 for its warm-up
            try:
                for cell, (workload, load) in enumerate(itertools.product(options.workloads, options.loads)):
                    runs = results.setdefault((workload, load), {t.name: Run() for t in targets})
                    for round_number in range(options.rounds):
                        order = targets if round_number % 2 == 0 else targets[::-1]  # ABBA
                        for target in order:
                            started = time.monotonic()
                            seed = 1 + cell * 1000 + round_number
                            run_spec = spec(options, workload, load, target, next(tags), seed)
                            run = await run_once(fleet, target, run_spec, shared)
                            if any(sample.startswith("deadline") for sample in run.error_samples):
                                console.print(f"[red]{target.name} cut off;[/] {await fleet.describe()}")
                                console.print(f"[red]{target.name}'s log:[/]\n{up[target.name][1].log_tail()}")
                            runs[target.name].add(run)
                            console.print(
                                f"  {workload:<8} {load:<9} round {round_number + 1}  {target.name:<25} "
                                f"{run.ok:>5,} ok {run.errors:>3} errors  {time.monotonic() - started:5.1f} s"
                            )
            finally:
                await fleet.http.aclose()
    return results


# -- report ------------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


def figures(run: Run) -> dict[str, float]:
    mean = sum(run.per_replica) / len(run.per_replica) if run.per_replica else 0.0
    return {
        "hit": run.cache_hits / run.cache_queries if run.cache_queries else math.nan,
        "p50": percentile(run.latencies, 50) * 1000,
        "p99": percentile(run.latencies, 99) * 1000,
        "g50": percentile(run.group_times, 50),
        "g90": percentile(run.group_times, 90),
        "imbalance": max(run.per_replica) / mean if mean else math.nan,
        "preempt": float(run.preemptions),
        "tok/s": run.tokens / run.wall_s if run.wall_s else math.nan,
        "cpu": (run.cpu_proxy_s + run.cpu_children_s) / run.ok * 1000 if run.ok else math.nan,
        "turns": float(run.ok),
        "errors": float(run.errors),
    }


# column -> (header, format, ratio to the baseline shown)
COLUMNS: dict[str, tuple[str, str, bool]] = {
    "hit": ("prefix hit", "{:.1%}", False),
    "p50": ("turn p50 ms", "{:,.0f}", True),
    "p99": ("turn p99 ms", "{:,.0f}", True),
    "g50": ("group p50 s", "{:.2f}", True),
    "g90": ("group p90 s", "{:.2f}", True),
    "imbalance": ("imbalance", "{:.2f}", False),
    "preempt": ("preemptions", "{:,.0f}", False),
    "tok/s": ("tokens/s", "{:,.0f}", True),
    "cpu": ("CPU ms/turn", "{:.2f}", True),
    "turns": ("turns", "{:,.0f}", False),
    "errors": ("errors", "{:,.0f}", False),
}
AGENTIC_COLUMNS = ("hit", "p50", "p99", "imbalance", "preempt", "tok/s", "cpu", "turns", "errors")
GRPO_COLUMNS = ("hit", "g50", "g90", "p50", "p99", "imbalance", "preempt", "tok/s", "cpu", "turns", "errors")


def cell_text(column: str, value: float, base: float | None) -> str:
    if value != value:
        return "—"
    text = COLUMNS[column][1].format(value)
    if COLUMNS[column][2] and base is not None and base == base and base > 0:
        text += f" (×{value / base:.2f})"
    return text


def report(console: Console, options: Options, results: Results) -> None:
    console.print(f"\n[bold]routing: this gateway's policies vs the Rust routers[/] — {machine_line()}")
    for (workload, load), runs in results.items():
        table = {name: figures(run) for name, run in runs.items()}
        base = table.get(BASELINE)
        columns = AGENTIC_COLUMNS if workload == "agentic" else GRPO_COLUMNS
        rows = []
        for name, values in table.items():
            ratio_base = {c: base[c] for c in columns} if base is not None and name != BASELINE else {}
            rows.append([name, *(cell_text(c, values[c], ratio_base.get(c)) for c in columns)])
        size = f"{options.agents(load)} agents" if workload == "agentic" else f"{options.groups(load)} groups a burst"
        title = f"{workload}, {load} load ({size}, {options.replicas} replicas, {options.rounds} rounds)"
        print_table(console, title, ["target", *(COLUMNS[c][0] for c in columns)], rows)
        busy = max((r.cpu_replicas_s + r.cpu_loadgen_s) / r.wall_s for r in runs.values() if r.wall_s) if runs else 0
        console.print(f"[dim]the replicas' core (replicas and load generator): at most {busy:.0%} busy in a run[/]")
        for name, run in runs.items():
            for sample in run.error_samples:
                console.print(f"  [red]{name} error:[/] {sample}")
    console.print(
        "[dim]How to read this:[/] prefix hit = the engines' cached ÷ queried prompt tokens; turn p50/p99 = one "
        "request, send → whole answer; group p50/p90 = a GRPO burst → its group's last answer; imbalance = the "
        "busiest replica's finished requests ÷ the mean (1.00 even); CPU = the target's (and its Redis's) per turn; "
        f"(×n.nn) = ÷ {BASELINE}'s. Ratios within one run compare; absolute figures move with the host."
    )
    for line in verdicts(options, results):
        console.print(line)


def verdicts(options: Options, results: Results) -> list[str]:
    """The issue's three targets, per cell, as sentences."""
    lines = []
    for (workload, load), runs in results.items():
        table = {name: figures(run) for name, run in runs.items()}
        ours = {n: f for n, f in table.items() if is_ours(n)}
        routers = {n: f for n, f in table.items() if not is_ours(n)}
        cell = f"{workload}/{load}"
        if not ours or not routers:
            lines.append(f"{cell}: no comparison (ours: {len(ours)}, routers: {len(routers)} measured)")
            continue
        router, best = max(routers.items(), key=lambda item: nan_low(item[1]["hit"]))
        mine, top = max(ours.items(), key=lambda item: nan_low(item[1]["hit"]))
        met = [n for n, f in ours.items() if f["hit"] >= best["hit"]]
        verdict = "met" if met else "NOT met"
        lines.append(
            f"{cell}: prefix hit ≥ best router's ({router} {best['hit']:.1%})? {verdict}: best of ours {mine} "
            f"{top['hit']:.1%}; at or above: {', '.join(met) or 'none'}"
        )
        if workload == "grpo":
            router, best = min(routers.items(), key=lambda item: nan_high(item[1]["g50"]))
            mine, top = min(ours.items(), key=lambda item: nan_high(item[1]["g50"]))
            bound = 0.8 * best["g50"]
            verdict = "met" if top["g50"] <= bound else "NOT met"
            lines.append(
                f"{cell}: group p50 ≤ 0.8× best router's ({router} {best['g50']:.2f} s → {bound:.2f} s)? {verdict}: "
                f"best of ours {mine} {top['g50']:.2f} s ({top['g50'] / best['g50']:.2f}×)"
            )
    lowest = next((load for load in LOADS if load in options.loads), None)
    for workload in options.workloads:
        runs = results.get((workload, lowest or ""), {})
        if BASELINE not in runs:
            continue
        base = figures(runs[BASELINE])
        worse = []
        for name, run in runs.items():
            if is_ours(name) and name != BASELINE:
                f = figures(run)
                why = [
                    what
                    for what, bad in (
                        (f"hit {f['hit']:.1%} < {base['hit']:.1%}", f["hit"] < base["hit"] - 0.01),
                        (f"turn p50 {f['p50'] / base['p50']:.2f}×", f["p50"] > 1.05 * base["p50"]),
                        (f"group p50 {f['g50'] / base['g50']:.2f}×", f["g50"] > 1.05 * base["g50"]),
                    )
                    if bad
                ]
                if why:
                    worse.append(f"{name} ({', '.join(why)})")
        lines.append(
            f"{workload}/{lowest}: no policy of ours worse than {BASELINE} at the lowest load measured? "
            f"{'NOT met: ' + '; '.join(worse) if worse else 'met'}"
        )
    return lines


def nan_low(value: float) -> float:
    return value if value == value else -math.inf


def nan_high(value: float) -> float:
    return value if value == value else math.inf


def write_json(path: Path, options: Options, results: Results) -> None:
    out: dict[str, Any] = {
        "machine": machine_line(),
        "options": {k: v for k, v in asdict(options).items() if k != "json_path"},
        "cells": {
            f"{workload}/{load}": {
                name: {"figures": figures(run), **{k: v for k, v in asdict(run).items() if k != "latencies"}}
                for name, run in runs.items()
            }
            for (workload, load), runs in results.items()
        },
        "verdicts": verdicts(options, results),
    }
    path.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


# -- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=d.replicas, help=f"simulator replicas ({d.replicas})")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(d.workloads))
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(d.loads), help="default: moderate high")
    p.add_argument("--targets", nargs="+", choices=(*OURS, *ROUTERS), default=list(d.targets), help="default: all")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"runs per target and cell, ABBA ({d.rounds})")
    p.add_argument("--duration", type=float, default=d.duration_s, help=f"agentic run, s ({d.duration_s:g})")
    p.add_argument("--bursts", type=int, default=d.bursts, help=f"GRPO bursts a run ({d.bursts})")
    p.add_argument("--burst-interval", type=float, default=d.burst_interval_s, help="between bursts, s (1)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help=f"bound of one run, s ({d.timeout_s:g})")
    p.add_argument(
        "--routing",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="`routing:` settings of every gateway target besides its policy (load_bound=8, group_placement=hash)",
    )
    p.add_argument("--scale", type=float, default=d.scale, help="agents and groups × this (1)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the targets and the rest to separate cores")
    p.add_argument("--json", type=Path, default=None, help="also write every figure (and raw counts) here")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if args.replicas < 2 or args.rounds < 1 or args.bursts < 1 or args.duration <= 0 or args.scale <= 0:
        raise SystemExit("--replicas ≥ 2, --rounds ≥ 1, --bursts ≥ 1, --duration > 0 and --scale > 0")
    routing = []
    for item in args.routing:
        key, equals, value = item.partition("=")
        if not equals or not key or key == "policy":
            raise SystemExit(f"--routing takes KEY=VALUE (not policy: the rows are the policies), not {item!r}")
        routing.append((key, yaml.safe_load(value)))
    return Options(
        replicas=args.replicas,
        workloads=tuple(dict.fromkeys(args.workloads)),
        loads=tuple(load for load in LOADS if load in args.loads),
        targets=tuple(dict.fromkeys(args.targets)),
        rounds=args.rounds,
        duration_s=args.duration,
        bursts=args.bursts,
        burst_interval_s=args.burst_interval,
        timeout_s=args.timeout,
        pin=not args.no_pin,
        json_path=args.json,
        scale=args.scale,
        routing=tuple(routing),
    )


async def main_async(options: Options, console: Console) -> bool:
    results = await run_all(options, console)
    report(console, options, results)
    if options.json_path is not None:
        write_json(options.json_path, options, results)
    return all(run.errors == 0 for runs in results.values() for run in runs.values())


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    cells = len(options.workloads) * len(options.loads) * len(options.targets) * options.rounds
    return run_benchmark(main_async, options, options.timeout_s * cells)


if __name__ == "__main__":
    sys.exit(main())
