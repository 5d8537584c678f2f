"""The simulator's raw speed: how many tokens and requests per second one replica serves with no token delay.

Later benchmarks put the gateway (and the Rust routers) in front of simulator replicas; this one checks that the
simulator itself is not the bottleneck. One replica per dialect runs in a child process (`SimProcess`, token delay
0); the load generator runs in this process (httpx.AsyncClient on loopback). Every row runs `repeats` rounds of
`concurrency` simultaneous requests of `tokens` greedy tokens each (`ignore_eos`, so every request produces exactly
that many, which is checked), after one untimed warm-up round that also opens the connections.

Columns: aggregate output tokens/s and requests/s over the timed rounds, request latency p50/p99, time to first
token (streaming only), and the CPU used by the replica and by this process per wall second (100% = one core). The
replica serves on one event loop, so near 100% it is the limit; this process near 100% means the load generator is,
and then "tok/sim-cpu-s" (tokens per second of replica CPU) estimates what one replica could do with a faster client.

`--client httpx2` drives the same load with pydantic's httpx fork (same API; installed with huggingface_hub), whose
connection pool does not rescan every connection on each request start and end the way httpcore 1.0.x does: at high
concurrency that bookkeeping, not the replica, bounds an httpx load generator.

    python -m benchmarks.sim_speed                # c=1 (256 tokens) and c=256 (128 tokens), both dialects
    python -m benchmarks.sim_speed --quick        # a few seconds
    python -m benchmarks.sim_speed --concurrency 1,16,64 --dialects vllm --modes stream --json out.json
    python -m benchmarks.sim_speed --client httpx2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import orjson
from rich.console import Console
from rich.table import Table

from backends.sim.server import SimProcess
from benchmarks._harness import cpu_seconds

# httpx.AsyncClient or httpx2.AsyncClient: the same API, chosen at run time with --client.
Client = Any
Dialect = Literal["vllm", "sglang"]
Mode = Literal["stream", "non-stream"]


@dataclass(frozen=True, slots=True)
class Scenario:
    dialect: Dialect
    mode: Mode
    concurrency: int
    tokens: int
    repeats: int


@dataclass(slots=True)
class Sample:
    latency_s: float
    ttft_s: float | None
    tokens: int


@dataclass(slots=True)
class Result:
    scenario: Scenario
    rounds: int = 0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    def rate(self, amount: float) -> float:
        return amount / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict[str, Any]:
        latencies = sorted(s.latency_s for s in self.samples)
        ttfts = sorted(s.ttft_s for s in self.samples if s.ttft_s is not None)
        measurable = self.wall_s >= 0.5
        return {
            **asdict(self.scenario),
            "rounds": self.rounds,
            "requests": self.requests,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.rate(self.tokens),
            "requests_per_s": self.rate(self.requests),
            "latency_p50_ms": 1000 * percentile(latencies, 0.50),
            "latency_p99_ms": 1000 * percentile(latencies, 0.99),
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.50) if ttfts else None,
            # Over a shorter row (or one read in /proc's 10 ms ticks) the percentages would be noise.
            "server_cpu_pct": 100 * self.rate(self.server_cpu_s) if measurable else None,
            "client_cpu_pct": 100 * self.rate(self.client_cpu_s) if measurable else None,
            "tokens_per_sim_cpu_s": self.tokens / self.server_cpu_s if measurable and self.server_cpu_s else None,
        }


def percentile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class ProtocolMismatch(RuntimeError):
    """A replica answered something other than the exact token count asked for: the numbers would be wrong."""


# -- one request per dialect and mode ---------------------------------------------------------------------------


def request_for(dialect: Dialect, prompt: list[int], tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
    if dialect == "vllm":
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        return "/v1/completions", body
    sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return "/generate", {"input_ids": prompt, "sampling_params": sampling, "stream": stream}


def count_tokens(dialect: Dialect, body: dict[str, Any]) -> int:
    """Output tokens in a response or one stream event (SGLang's stream events are cumulative, vLLM's deltas)."""
    if dialect == "vllm":
        return len(body["choices"][0]["token_ids"] or ())
    return len(body["output_ids"])


async def one_request(
    client: Client, url: str, dialect: Dialect, prompt: list[int], tokens: int, stream: bool
) -> Sample:
    path, body = request_for(dialect, prompt, tokens, stream)
    started = time.perf_counter()
    if not stream:
        response = await client.post(f"{url}{path}", json=body)
        if response.status_code != 200:
            raise ProtocolMismatch(f"{dialect} answered {response.status_code}: {response.text[:200]}")
        got = count_tokens(dialect, orjson.loads(response.content))
        return check(Sample(time.perf_counter() - started, None, got), tokens)
    got = 0
    ttft: float | None = None
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        if response.status_code != 200:
            raise ProtocolMismatch(f"{dialect} answered {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n = count_tokens(dialect, orjson.loads(line[6:]))
            if n and ttft is None:
                ttft = time.perf_counter() - started
            got = n if dialect == "sglang" else got + n
    return check(Sample(time.perf_counter() - started, ttft, got), tokens)


def check(sample: Sample, expected: int) -> Sample:
    if sample.tokens != expected:
        raise ProtocolMismatch(f"expected {expected} tokens, got {sample.tokens}")
    return sample


# -- rounds -----------------------------------------------------------------------------------------------------


async def run_round(client: Client, url: str, scenario: Scenario, tokens: int, offset: int) -> list[Sample]:
    stream = scenario.mode == "stream"
    async with asyncio.TaskGroup() as group:
        tasks = [
            # Distinct prompts: no two requests share a prefix-cache entry, every one decodes from scratch.
            group.create_task(one_request(client, url, scenario.dialect, prompt_for(offset + i), tokens, stream))
            for i in range(scenario.concurrency)
        ]
    return [task.result() for task in tasks]


def prompt_for(i: int) -> list[int]:
    return [7 + (i * 7919 + j * 104729) % 2000 for j in range(8)]


async def run_scenario(client: Client, url: str, server: int, scenario: Scenario, deadline: float) -> Result:
    """One scenario's rounds against the replica whose pid is `server`, with its CPU and this process's."""
    me = os.getpid()
    await run_round(client, url, scenario, min(scenario.tokens, 8), offset=10**6)  # warm-up; opens connections
    result = Result(scenario)
    server_cpu, client_cpu = cpu_seconds(server) or 0.0, cpu_seconds(me) or 0.0
    started = time.perf_counter()
    for round_index in range(scenario.repeats):
        if round_index and time.monotonic() > deadline:
            break  # bounded time: finish the row with the rounds done so far
        offset = round_index * scenario.concurrency
        result.samples.extend(await run_round(client, url, scenario, scenario.tokens, offset))
        result.rounds += 1
    result.wall_s = time.perf_counter() - started
    result.server_cpu_s = (cpu_seconds(server) or 0.0) - server_cpu
    result.client_cpu_s = (cpu_seconds(me) or 0.0) - client_cpu
    return result


# -- driver -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    dialects: list[Dialect]
    modes: list[Mode]
    concurrency: list[int]
    tokens: int
    tokens_concurrent: int
    repeats: int
    repeats_concurrent: int
    time_limit_s: float
    client: str

    def scenarios(self, dialect: Dialect) -> list[Scenario]:
        return [
            Scenario(
                dialect,
                mode,
                c,
                self.tokens if c == 1 else self.tokens_concurrent,
                self.repeats if c == 1 else self.repeats_concurrent,
            )
            for mode in self.modes
            for c in self.concurrency
        ]


async def bench_replica(
    dialect: Dialect, url: str, pid: int, plan: Plan, on_result: Callable[[Result], None]
) -> list[Result]:
    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"the load generator runs on loopback only, not {url}")
    most = max(plan.concurrency)
    http = importlib.import_module(plan.client)
    limits = http.Limits(max_connections=most, max_keepalive_connections=most)
    timeout = http.Timeout(connect=10.0, read=60.0, write=10.0, pool=60.0)
    results = []
    async with http.AsyncClient(limits=limits, timeout=timeout) as client:
        for scenario in plan.scenarios(dialect):
            result = await run_scenario(client, url, pid, scenario, time.monotonic() + plan.time_limit_s)
            on_result(result)
            results.append(result)
    return results


def table(results: Sequence[Result], client: str) -> Table:
    out = Table(title=f"simulator raw speed (one replica, token delay 0, loopback, {client} load generator)")
    for name in ("dialect", "mode", "conc", "tok/req", "reqs", "tok/s", "req/s", "p50 ms", "p99 ms", "ttft p50 ms"):
        out.add_column(name, justify="left" if name in ("dialect", "mode") else "right")
    out.add_column("sim cpu", justify="right")
    out.add_column("client cpu", justify="right")
    out.add_column("tok/sim-cpu-s", justify="right")
    for result in results:
        s = result.summary()
        ttft = "-" if s["ttft_p50_ms"] is None else f"{s['ttft_p50_ms']:.1f}"
        out.add_row(
            s["dialect"],
            s["mode"],
            str(s["concurrency"]),
            str(s["tokens"] // max(1, s["requests"])),
            str(s["requests"]),
            f"{s['tokens_per_s']:,.0f}",
            f"{s['requests_per_s']:,.1f}",
            f"{s['latency_p50_ms']:.1f}",
            f"{s['latency_p99_ms']:.1f}",
            ttft,
            "-" if s["server_cpu_pct"] is None else f"{s['server_cpu_pct']:.0f}%",
            "-" if s["client_cpu_pct"] is None else f"{s['client_cpu_pct']:.0f}%",
            "-" if s["tokens_per_sim_cpu_s"] is None else f"{s['tokens_per_sim_cpu_s']:,.0f}",
        )
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[Plan, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_speed", description=__doc__.splitlines()[0])
    p.add_argument("--dialects", default="vllm,sglang", help="comma-separated: vllm,sglang")
    p.add_argument("--modes", default="stream,non-stream", help="comma-separated: stream,non-stream")
    p.add_argument("--concurrency", default="1,256", help="comma-separated concurrency levels")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request at concurrency 1")
    p.add_argument("--tokens-concurrent", type=int, default=128, help="output tokens per request above 1")
    p.add_argument("--repeats", type=int, default=64, help="rounds at concurrency 1 (sequential requests)")
    p.add_argument("--repeats-concurrent", type=int, default=3, help="rounds above concurrency 1")
    p.add_argument("--time-limit", type=float, default=60.0, help="no new round after this many seconds per row")
    p.add_argument("--quick", action="store_true", help="concurrency 1,32; 64 tokens; 2 rounds (a few seconds)")
    p.add_argument("--client", choices=("httpx", "httpx2"), default="httpx", help="load generator's HTTP client")
    p.add_argument("--json", dest="json_path", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.tokens, args.tokens_concurrent = "1,32", 64, 64
        args.repeats, args.repeats_concurrent, args.time_limit = 2, 2, 10.0
    dialects = [d.strip() for d in args.dialects.split(",") if d.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [d for d in dialects if d not in ("vllm", "sglang")] + [m for m in modes if m not in ("stream", "non-stream")]
    if bad:
        p.error(f"unknown dialect or mode: {', '.join(bad)}")
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency must be integers, got {args.concurrency!r}")
    if not concurrency or min(concurrency) < 1 or min(args.tokens, args.tokens_concurrent, args.repeats) < 1:
        p.error("concurrency, tokens and repeats must be at least 1")
    plan = Plan(
        dialects=dialects,
        modes=modes,
        concurrency=concurrency,
        tokens=args.tokens,
        tokens_concurrent=args.tokens_concurrent,
        repeats=args.repeats,
        repeats_concurrent=max(1, args.repeats_concurrent),
        time_limit_s=args.time_limit,
        client=args.client,
    )
    return plan, args


def main(argv: Sequence[str] | None = None) -> int:
    plan, args = parse_args(argv)
    console = Console(stderr=True)
    results: list[Result] = []
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.run
    for dialect in plan.dialects:
        longest = max(plan.tokens, plan.tokens_concurrent) + 64
        # Token delay 0 (the CLI default): the replica runs as fast as it can. SimProcess stops it on exit.
        with SimProcess(["--dialect", dialect, "--max-model-len", str(longest)]) as sim:
            if sim.pid is None:
                raise RuntimeError("the simulator process did not start")

            def progress(result: Result) -> None:
                s = result.summary()
                console.log(
                    f"{s['dialect']} {s['mode']} c={s['concurrency']}: {s['tokens_per_s']:,.0f} tok/s, "
                    f"{s['requests_per_s']:,.1f} req/s"
                )

            results += runner(bench_replica(dialect, sim.url, sim.pid, plan, progress))
    # Wide enough for every column when the output is a file or a pipe (rich falls back to 80 columns there).
    Console(width=None if sys.stdout.isatty() else 180).print(table(results, plan.client))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([r.summary() for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
