"""Gateway overhead: the same requests sent straight to a simulator replica and through the gateway, side by side.

What runs where (the machine this was written on has 2 cores, so the choice matters):

* one simulator replica (vLLM dialect, no token delay, so the engine is as fast as it gets and the gateway's
  share is as visible as it gets) in a child process (`SimProcess`);
* the gateway in a child process (`rollout-gateway serve --config <tmp yaml>`, embedded Redis), with that one
  replica: its CPU is read from /proc per run, and it never shares an event loop or a GIL with the load
  generator;
* the load generator in this process: `concurrency` simulated agents, each with its own single-connection
  `httpx.AsyncClient` (one pool shared by 256 agents would time httpcore's pool bookkeeping instead; see
  `_harness.agent_clients`), sending requests back to back. The direct path and the gateway path have
  their own agents.

Workloads, each at every `--concurrency` (default 1 and 256), greedy with `ignore_eos` so every request yields
exactly its token budget (checked; a request that does not is an error):

* short: `--short-tokens` (8) tokens, non-streaming. Direct: `POST /v1/completions` with token ids; gateway:
  `POST /generate`.
* stream: `--stream-tokens` (256) tokens, streaming (SSE) on both paths.

The direct request asks the replica for exactly what the gateway asks it for (token ids, logprobs, weight
versions), so both paths make the engine do the same work. Each (workload, concurrency) pair warms both paths
up (opening every connection), then runs `--rounds` timed rounds per path in ABBA order (direct, gateway,
gateway, direct, ...), each with 1/rounds of the requests, so drift in the machine's speed falls on both.

Reported per path: requests/s, tokens/s, request latency p50/p99 (send → last byte), time to first token
(streams), CPU of each process per wall second; then per pair: added latency (gateway − direct, of the p50s and
of the p99s), the gateway/direct throughput ratio, and the gateway's CPU per request and per 1,000 tokens.

    python -m benchmarks.gateway_overhead             # about a minute
    python -m benchmarks.gateway_overhead --quick     # a quarter of the requests: well under a minute
    python -m benchmarks.gateway_overhead --concurrency 1 16 256 --scale 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson
from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    Percentiles,
    agent_clients,
    cpu_seconds,
    json_post,
    machine_line,
    ms,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
    sse_events,
)

PathName = Literal["direct", "gateway"]
PATHS: tuple[PathName, PathName] = ("direct", "gateway")
MODEL = "tiny"  # the simulator's default served model name, and the gateway's default model.name


@dataclass(frozen=True)
class Workload:
    name: str
    stream: bool
    max_tokens: int
    min_requests: int  # per run at concurrency 1
    per_agent: int  # requests per agent at higher concurrency

    def requests(self, concurrency: int, scale: float) -> int:
        return max(2, math.ceil(max(self.min_requests, self.per_agent * concurrency) * scale))


@dataclass(frozen=True)
class Options:
    concurrency: tuple[int, ...]
    workloads: tuple[Workload, ...]
    scale: float
    rounds: int
    timeout_s: float


@dataclass
class Sample:
    latency_s: float
    ttft_s: float | None
    tokens: int


@dataclass
class PathRun:
    """Everything measured on one path for one (workload, concurrency) pair, summed over its rounds."""

    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: {"client": 0.0, "sim": 0.0, "gateway": 0.0})

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)


@dataclass
class PairResult:
    workload: Workload
    concurrency: int
    runs: dict[PathName, PathRun]


# -- one request on each path -----------------------------------------------------------------------------------


def prompt_of(index: int) -> list[int]:
    return [10 + index % 50, 20 + index % 7, 30 + index % 997, 40, 50 + index % 13, 60, 70, 80]


def direct_body(index: int, workload: Workload) -> dict[str, Any]:
    """What the gateway's vLLM backend sends upstream for the same request (backends/vllm.py)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt_of(index),
        "max_tokens": workload.max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop_token_ids": [],
        "ignore_eos": True,
        "min_tokens": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "request_id": f"direct-{index}",
    }
    if workload.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def direct_request(client: httpx.AsyncClient, url: str, index: int, agent: int, workload: Workload) -> Sample:
    request = json_post(client, f"{url}/v1/completions", direct_body(index, workload))
    started = time.perf_counter()
    if not workload.stream:
        response = await client.send(request)
        response.raise_for_status()
        choice = orjson.loads(response.content)["choices"][0]
        tokens = len(choice["token_ids"]) if choice["finish_reason"] == "length" else -1
        return Sample(time.perf_counter() - started, None, tokens)
    tokens, first, finish = 0, None, None
    response = await client.send(request, stream=True)
    try:
        response.raise_for_status()
        async for now, event in sse_events(response):
            for choice in event["choices"]:
                if choice["token_ids"]:
                    first = first or now
                    tokens += len(choice["token_ids"])
                finish = choice["finish_reason"] or finish
    finally:
        await response.aclose()
    ended = time.perf_counter()
    return Sample(ended - started, None if first is None else first - started, tokens if finish == "length" else -1)


def gateway_body(index: int, agent: int, workload: Workload) -> dict[str, Any]:
    return {
        "session_id": f"agent-{agent}",  # an agent's requests are one session, as in an episode
        "input_ids": prompt_of(index),
        "sampling_params": {"max_tokens": workload.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": workload.stream,
    }


async def gateway_request(client: httpx.AsyncClient, url: str, index: int, agent: int, workload: Workload) -> Sample:
    request = json_post(client, f"{url}/generate", gateway_body(index, agent, workload))
    started = time.perf_counter()
    if not workload.stream:
        response = await client.send(request)
        response.raise_for_status()
        answer = orjson.loads(response.content)
        tokens = len(answer["output_ids"]) if answer["finish_reason"] == "length" else -1
        return Sample(time.perf_counter() - started, None, tokens)
    tokens, first, finish = 0, None, None
    response = await client.send(request, stream=True)
    try:
        response.raise_for_status()
        async for now, event in sse_events(response):
            if "error" in event:  # counted as an error by the caller (no finish)
                break
            if "finish_reason" in event:
                finish = event["finish_reason"]
            elif event["output_ids"]:
                first = first or now
                tokens += len(event["output_ids"])
    finally:
        await response.aclose()
    ended = time.perf_counter()
    return Sample(ended - started, None if first is None else first - started, tokens if finish == "length" else -1)


# -- load --------------------------------------------------------------------------------------------------------

Send = Callable[[httpx.AsyncClient, str, int, int, Workload], Awaitable[Sample]]
SENDERS: dict[PathName, Send] = {"direct": direct_request, "gateway": gateway_request}


class Stack:
    """The processes and agents of one benchmark run."""

    def __init__(self, sim_url: str, sim_pid: int | None, gateway: GatewayProcess) -> None:
        self.urls: dict[PathName, str] = {"direct": sim_url, "gateway": gateway.url}
        self.sim_pid = sim_pid
        self.gateway = gateway
        self.agents: dict[PathName, list[httpx.AsyncClient]] = {}
        self.ids = itertools.count()  # request ids unique over the whole run (the engine rejects duplicates)

    def cpu(self) -> dict[str, float]:
        return {
            "client": time.process_time(),
            "sim": cpu_seconds(self.sim_pid) or 0.0,
            "gateway": self.gateway.cpu_seconds() or 0.0,
        }


async def run_load(stack: Stack, path: PathName, workload: Workload, concurrency: int, count: int) -> PathRun:
    """`count` requests from `concurrency` agents, each sending its next request when the last one is done."""
    run = PathRun()
    send, url, agents = SENDERS[path], stack.urls[path], stack.agents[path]
    remaining = iter(range(count))

    async def agent(number: int) -> None:
        for _ in remaining:
            try:
                sample = await send(agents[number], url, next(stack.ids), number, workload)
            except httpx.HTTPError:  # counted, not raised: one failed request must not hide the others' numbers
                run.errors += 1
                continue
            if sample.tokens != workload.max_tokens:
                run.errors += 1
            else:
                run.samples.append(sample)

    cpu_before = stack.cpu()
    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for number in range(concurrency):
            group.create_task(agent(number))
    run.wall_s = time.perf_counter() - started
    cpu_after = stack.cpu()
    run.cpu_s = {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
    return run


def merge(total: PathRun, part: PathRun) -> None:
    total.samples += part.samples
    total.errors += part.errors
    total.wall_s += part.wall_s
    for name, seconds in part.cpu_s.items():
        total.cpu_s[name] += seconds


async def measure_pair(stack: Stack, workload: Workload, concurrency: int, options: Options) -> PairResult:
    for path in PATHS:  # warm-up: every agent's connection opened, every code path run once
        await run_load(stack, path, workload, concurrency, max(concurrency, 8))
    count = workload.requests(concurrency, options.scale)
    per_round = max(1, count // options.rounds)
    runs: dict[PathName, PathRun] = {path: PathRun() for path in PATHS}
    for round_number in range(options.rounds):
        order = PATHS if round_number % 2 == 0 else PATHS[::-1]  # ABBA: drift falls on both paths alike
        for path in order:
            merge(runs[path], await run_load(stack, path, workload, concurrency, per_round))
    return PairResult(workload, concurrency, runs)


async def run_all(options: Options, console: Console) -> list[PairResult]:
    top = max(options.concurrency)
    with sim_replicas([["--dialect", "vllm", "--token-delay", "0"]]) as (sim,):
        settings = {"generation": {"max_connections_per_replica": top + 64}}
        with GatewayProcess([sim_replica_entry(sim.url, "vllm")], settings) as gateway:
            console.print(f"direct → {sim.url}; gateway {gateway.url} → the same replica")
            stack = Stack(sim.url, sim.pid, gateway)
            async with agent_clients(top, 60.0) as direct, agent_clients(top, 60.0) as through:
                stack.agents = {"direct": direct, "gateway": through}
                results = []
                for workload in options.workloads:
                    for concurrency in options.concurrency:
                        console.print(f"  {workload.name} × concurrency {concurrency}")
                        results.append(await measure_pair(stack, workload, concurrency, options))
                return results


# -- report ------------------------------------------------------------------------------------------------------


def _cpu_share(run: PathRun, path: PathName) -> str:
    def pct(name: str) -> str:
        return f"{run.cpu_s[name] / run.wall_s * 100:.0f}" if run.wall_s else "—"

    return f"{pct('client')} / {pct('sim')} / {pct('gateway') if path == 'gateway' else '—'}"


def report(console: Console, results: Sequence[PairResult]) -> None:
    rows = []
    for result in results:
        for path in PATHS:
            run = result.runs[path]
            lat = Percentiles.of([s.latency_s for s in run.samples])
            ttft = Percentiles.of([s.ttft_s for s in run.samples if s.ttft_s is not None])
            rows.append(
                [
                    f"{result.workload.name} c={result.concurrency}",
                    path,
                    f"{len(run.samples):,}",
                    f"{len(run.samples) / run.wall_s:,.0f}",
                    f"{run.tokens / run.wall_s:,.0f}",
                    ms(lat.p50),
                    ms(lat.p99),
                    ms(ttft.p50) if result.workload.stream else "—",
                    _cpu_share(run, path),
                    f"{run.errors}",
                ]
            )
    columns = ["workload", "path", "requests", "req/s", "tokens/s", "p50 ms", "p99 ms", "TTFT p50 ms"]
    title = f"Direct to the replica vs through the gateway (1 sim replica, no token delay); {machine_line()}"
    print_table(console, title, [*columns, "CPU % load gen / sim / gw", "errors"], rows)
    print_table(
        console,
        "Gateway − direct",
        ["workload", "added p50 ms", "added p99 ms", "added TTFT p50 ms", "throughput gw/direct", "gw CPU ms/req"]
        + ["gw CPU ms/1k tok"],
        [comparison_row(result) for result in results],
        "each row of the second table compares the two rows of the first with the same workload and "
        "concurrency: added = gateway − direct (of the p50s, of the p99s), a throughput ratio below 1 is the "
        "share of the direct rate the gateway keeps. CPU % is per wall second (100 = one core): a process near "
        "100 is that row's bottleneck (a load generator near 100 on the direct row means the direct rate is "
        "the client's limit, so the ratio flatters the gateway). On a 2-core box the gateway takes its CPU "
        "from the replica and the load generator; 'gw CPU' columns are the cost that carries to any host.",
    )


def comparison_row(result: PairResult) -> list[str]:
    direct, gateway = result.runs["direct"], result.runs["gateway"]

    def pct(run: PathRun, ttft: bool = False) -> Percentiles:
        values = [s.ttft_s for s in run.samples if s.ttft_s is not None] if ttft else [s.latency_s for s in run.samples]
        return Percentiles.of(values)

    d, g = pct(direct), pct(gateway)
    added_ttft = pct(gateway, True).p50 - pct(direct, True).p50 if result.workload.stream else float("nan")
    ratio = (len(gateway.samples) / gateway.wall_s) / (len(direct.samples) / direct.wall_s)
    gw_cpu = gateway.cpu_s["gateway"]
    return [
        f"{result.workload.name} c={result.concurrency}",
        ms(g.p50 - d.p50),
        ms(g.p99 - d.p99),
        ms(added_ttft),
        f"{ratio:.2f}",
        f"{gw_cpu / max(1, len(gateway.samples)) * 1000:.2f}",
        f"{gw_cpu / max(1, gateway.tokens) * 1e6:.1f}",
    ]


# -- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_overhead",
        description="Latency and throughput the gateway adds over talking to the engine replica directly.",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 256], help="agents sending at once")
    p.add_argument("--short-tokens", type=int, default=8, help="tokens of the short, non-streaming requests")
    p.add_argument("--stream-tokens", type=int, default=256, help="tokens of the streaming requests")
    p.add_argument("--scale", type=float, default=None, help="multiplies every request count (default 1; quick 0.25)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per path, in ABBA order")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole run, s (default 600; quick 120)")
    p.add_argument("--quick", action="store_true", help="a quarter of the requests: well under a minute")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if min(args.concurrency) < 1 or args.rounds < 1 or args.short_tokens < 1 or args.stream_tokens < 1:
        raise SystemExit("--concurrency, --rounds and the token counts must be ≥ 1")
    scale = args.scale if args.scale is not None else (0.25 if args.quick else 1.0)
    if scale <= 0:
        raise SystemExit("--scale must be > 0")
    return Options(
        concurrency=tuple(args.concurrency),
        workloads=(
            Workload(f"short {args.short_tokens} tok", False, args.short_tokens, min_requests=400, per_agent=16),
            Workload(f"stream {args.stream_tokens} tok", True, args.stream_tokens, min_requests=40, per_agent=2),
        ),
        scale=scale,
        rounds=args.rounds,
        timeout_s=args.timeout or (120.0 if args.quick else 600.0),
    )


async def main_async(options: Options, console: Console) -> bool:
    async with asyncio.timeout(options.timeout_s):
        results = await run_all(options, console)
    report(console, results)
    return all(run.errors == 0 for result in results for run in result.runs.values())


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
