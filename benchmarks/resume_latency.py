"""Resume latency: N in-flight streaming `/generate` requests across one weight update (pause mode `abort`).

What runs where (the machine this was written on has 2 cores, so the choice matters):

* R simulator replicas (vLLM dialect by default) as child processes (`SimProcess`), with a per-token delay so
  every request is mid-generation when the update fires;
* the gateway as a child process (`rollout-gateway serve --config <tmp yaml>`, its embedded Redis): re-issuing
  N continuations is CPU work on the gateway's event loop, and it must not share a loop or a GIL with the
  N-stream load generator, or the figure would be the client's own scheduling lag;
* the load generator in this process: one single-connection `httpx.AsyncClient` per stream, as independent
  agents have (one pool shared by 1,000 streams would time httpcore's pool bookkeeping: see
  `_harness.agent_clients`). The admin call has its own client, so it never waits for a pooled connection.

The per-token delay defaults to 0.2 s: 1,000 streams then ask for 5,000 tokens/s, which the replicas, the
gateway and the load generator can relay on 2 cores. Much shorter delays make this a throughput test instead:
the gateway admits the streams more slowly than they finish, and requests end before the update. Use a
shorter delay on a bigger machine. `--max-tokens` defaults to a budget that outlasts that ramp (`tokens_for`).

Each N gets a fresh stack, so every run starts at weight version 0 and publishes version 1. The N streams ask
for `--max-tokens` tokens each (`ignore_eos`); once every one has streamed `--warm-tokens` tokens, the trainer's
call `POST /admin/weights {version: 1, path, mode: abort}` is sent. The gateway answers it after the replicas paused
(aborting every request), loaded the weights, reported the new version and resumed. For each request, the first
token sampled by version 1 is found from the per-token `versions` of its final event, and

    resume latency = arrival of that token - return of the admin call

(can be slightly negative: the gateway releases waiting requests just before it writes the admin response).
"gap" is what the agent sees: the arrival of that token minus the arrival of the request's last version-0 token.

Dispatch, the gateway's own share, is measured twice (no per-token work for either):

* by the gateway, `rollout_gateway_resume_dispatch_seconds` from its `/metrics`: per continuation, the release
  of the requests held by the update to the continuation being sent (the HTTP client's write included). Percentiles
  are interpolated within the histogram's buckets (as Prometheus' `histogram_quantile`); the share of
  continuations dispatched within 100 ms is exact (a bucket bound);
* by the replicas, `/sim/prompt_log`: per continuation, its arrival at the simulator (before admission) minus
  the return of the admin call, the origin of the first-token figures; transport and the replica's HTTP
  parsing included. Clocks agree: every process reads the same CLOCK_MONOTONIC.

Checks, counted as failures (must be 0): HTTP 200 and no error event; `finish_reason == "length"` with exactly
`--max-tokens` tokens; versions non-decreasing from 0 to 1 (both present: the request spanned the update);
`num_resumes >= 1`; and, unless `--no-verify-tokens`, every token equals the simulator's offline reference for
the weights that sampled it (nothing lost or duplicated across the resume).

    python -m benchmarks.resume_latency               # 100 and 1,000 in flight
    python -m benchmarks.resume_latency --quick       # 100 and 300 in flight (well under a minute)
    python -m benchmarks.resume_latency --requests 10 100 1000 --replicas 4 --dialect mixed
    python -m benchmarks.resume_latency --requests 1000 --prompt-tokens 2048   # RL-sized prompts: each
                                                      # continuation carries its prompt again
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from benchmarks._harness import (
    ADMIN_HEADERS,
    BenchmarkError,
    GatewayProcess,
    Percentiles,
    agent_clients,
    json_post,
    loopback_client,
    machine_line,
    ms,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
    sse_events,
)

NEW_VERSION = 1
CHECKPOINT = "bench-ckpt-1"  # the simulator's weights identity after the update
WEIGHTS = {0: ("init", "default"), NEW_VERSION: (CHECKPOINT, str(NEW_VERSION))}
RAMP_S_PER_REQUEST = 0.05
UPDATE_MARGIN_S = 3.0
SIM_CONTEXT = 4096  # the simulator's context (its `--max-model-len` default), prompt included
PROMPT_HEAD = 5  # `prompt_of`'s distinct head; `--prompt-tokens` pads after it
DISPATCH_METRIC = "rollout_gateway_resume_dispatch_seconds"
DISPATCH_BUDGET_S = 0.1


@dataclass(frozen=True)
class Options:
    requests: tuple[int, ...]
    replicas: int
    dialect: str
    token_delay_s: float
    max_tokens: int | None  # None: long enough to outlast the ramp (`tokens_for`)
    warm_tokens: int
    verify_tokens: bool
    timeout_s: float
    prompt_tokens: int = PROMPT_HEAD

    def tokens_for(self, requests: int) -> int:
        """Tokens per request: the earliest request must still be generating when the last one has streamed its
        warm tokens (the ramp) and the update is done. The ramp is bounded by how fast the gateway admits new
        streams while it relays the earlier ones' tokens: 15-46 s for 1,000 streams at 0.2 s per token on the
        2-core machine this was tuned on, hence RAMP_S_PER_REQUEST per stream plus UPDATE_MARGIN_S, in steps."""
        if self.max_tokens is not None:
            return self.max_tokens
        seconds = RAMP_S_PER_REQUEST * requests + UPDATE_MARGIN_S
        return min(self.max_tokens_cap, self.warm_tokens + math.ceil(seconds / self.token_delay_s))

    @property
    def max_tokens_cap(self) -> int:
        """What the simulator's context leaves after the prompt (a little spare)."""
        return SIM_CONTEXT - self.prompt_tokens - 96


@dataclass
class Stream:
    """One streaming request as the agent saw it."""

    index: int
    prompt: list[int]
    output_ids: list[int] = field(default_factory=list)
    # (tokens received once this event is counted, its arrival time), one entry per event with tokens.
    arrivals: list[tuple[int, float]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    finished_at: float | None = None
    error: str | None = None

    def arrival_of(self, token_index: int) -> float:
        """When the token at `token_index` arrived (NaN if it never did)."""
        return next((t for received, t in self.arrivals if received > token_index), math.nan)


class Readiness:
    """Sets `event` once every stream has streamed `warm_tokens` tokens or ended (so the update can fire)."""

    def __init__(self, total: int, warm_tokens: int) -> None:
        self.remaining = total
        self.warm_tokens = warm_tokens
        self.event = asyncio.Event()
        self._counted: set[int] = set()

    def progress(self, stream: Stream, ended: bool = False) -> None:
        if stream.index in self._counted or not (ended or len(stream.output_ids) >= self.warm_tokens):
            return
        self._counted.add(stream.index)
        self.remaining -= 1
        if self.remaining == 0:
            self.event.set()


@dataclass
class RunResult:
    requests: int
    max_tokens: int
    ramp_s: float = float("nan")
    admin_s: float = float("nan")
    reported_s: float = float("nan")
    ended_before_update: int = 0
    resumed: int = 0
    latencies: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # continuation at a replica - admin return
    dispatch: Histogram | None = None  # the gateway's own view: release of waiters → sent
    failures: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram as scraped: cumulative counts per upper bound."""

    buckets: list[tuple[float, float]]  # (le, cumulative count), ascending, +Inf last
    count: float

    @classmethod
    def scrape(cls, text: str, name: str) -> Histogram | None:
        for family in text_string_to_metric_families(text):
            if family.name == name:
                buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name == f"{name}_bucket")
                return cls(buckets, buckets[-1][1] if buckets else 0.0)
        return None

    def quantile(self, q: float) -> float:
        """Linear interpolation within the bucket holding rank q·count (Prometheus' `histogram_quantile`)."""
        if not self.count:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower  # beyond the last finite bound: that bound is all we know
                return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
            lower, below = le, cumulative
        return math.nan

    def share_within(self, bound: float) -> float:
        """Fraction of observations ≤ `bound` (exact when `bound` is a bucket bound)."""
        within = next((c for le, c in self.buckets if le == bound), math.nan)
        return within / self.count if self.count else math.nan


def prompt_of(index: int, length: int = PROMPT_HEAD) -> list[int]:
    """A prompt of `length` tokens (at least the head), distinct per index in its head: an RL prompt is usually
    hundreds to thousands of tokens, and every continuation carries it again."""
    head = [10 + index % 50, 20 + index % 7, 30 + index % 997, 40, 50 + index % 13]
    return head + [100 + (index + i) % 900 for i in range(length - len(head))]


async def log_arrivals(admin: httpx.AsyncClient, urls: Sequence[str]) -> None:
    """Make every replica log the arrival of each request (`/sim/prompt_log`)."""
    for url in urls:
        response = await admin.post(f"{url}/sim/prompt_log", json={"head": 1})
        response.raise_for_status()


async def continuation_arrivals(
    admin: httpx.AsyncClient, urls: Sequence[str], since: float, prompt_tokens: int
) -> list[float]:
    """Monotonic arrival times of the continuations (prompts longer than the agents' own) the replicas received
    after `since`."""
    found: list[float] = []
    for url in urls:
        response = await admin.get(f"{url}/sim/prompt_log")
        response.raise_for_status()
        found += [at for _head, length, at in response.json()["requests"] if length > prompt_tokens and at >= since]
    return found


async def run_stream(client: httpx.AsyncClient, url: str, stream: Stream, max_tokens: int, ready: Readiness) -> None:
    body = {
        "session_id": f"resume-{stream.index}",
        "input_ids": stream.prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    try:
        response = await client.send(json_post(client, f"{url}/generate", body), stream=True)
        try:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}"
                return
            async for now, event in sse_events(response):
                if "error" in event:
                    stream.error = f"error event: {event['error'].get('message')}"
                elif "finish_reason" in event:
                    stream.final, stream.finished_at = event, now
                else:
                    stream.output_ids.extend(event["output_ids"])
                    stream.arrivals.append((len(stream.output_ids), now))
                    ready.progress(stream)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:  # a broken stream is a failure to count, not a reason to stop the others
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        ready.progress(stream, ended=True)


async def publish(admin: httpx.AsyncClient, url: str) -> tuple[float, float, dict[str, Any]]:
    """(sent at, returned at, report) of the weight update."""
    body = {"version": NEW_VERSION, "path": CHECKPOINT, "mode": "abort"}
    sent = time.monotonic()  # the replicas' arrival logs read the same clock
    response = await admin.post(f"{url}/admin/weights", json=body, headers=ADMIN_HEADERS)
    returned = time.monotonic()
    if response.status_code != 200:
        raise BenchmarkError(f"weight update failed: HTTP {response.status_code} {response.text}")
    report: dict[str, Any] = response.json()
    if report["stale"] or len(report["updated"]) == 0:
        raise BenchmarkError(f"weight update left stale replicas: {report}")
    return sent, returned, report


def check(stream: Stream, max_tokens: int, verify_tokens: bool, shape: ModelShape) -> str | None:
    """Why this request failed the checks, or None."""
    final = stream.final
    if stream.error is not None:
        return stream.error
    if final is None:
        return "no final event"
    if final["finish_reason"] != "length" or len(stream.output_ids) != max_tokens:
        return f"finish_reason {final['finish_reason']} after {len(stream.output_ids)} tokens"
    versions: list[int] = final["versions"]
    if len(versions) != len(stream.output_ids) or versions != sorted(versions):
        return "versions missing or decreasing"
    if versions[0] != 0 or versions[-1] != NEW_VERSION:
        return f"versions span [{versions[0]}, {versions[-1]}], not [0, {NEW_VERSION}]"
    if final["num_resumes"] < 1:
        return "not resumed"
    if verify_tokens:
        expected = reference_tokens(shape, stream.prompt, [WEIGHTS[v] for v in versions], max_tokens, ignore_eos=True)
        if expected != stream.output_ids:
            return "tokens differ from the reference"
    return None


def measure(streams: Sequence[Stream], sent: float, returned: float, result: RunResult) -> None:
    for stream in streams:
        if stream.finished_at is not None and stream.finished_at < sent:
            result.ended_before_update += 1
        if stream.final is None:
            continue
        result.resumed += stream.final["num_resumes"] >= 1
        versions: list[int] = stream.final["versions"]
        if NEW_VERSION not in versions:
            continue
        first_new = versions.index(NEW_VERSION)
        arrived = stream.arrival_of(first_new)
        if math.isnan(arrived):
            continue  # fewer tokens than versions: `check` counts it as a failure
        result.latencies.append(arrived - returned)
        if first_new > 0:
            result.gaps.append(arrived - stream.arrival_of(first_new - 1))


async def run_once(requests: int, options: Options, console: Console) -> RunResult:
    result = RunResult(requests, options.tokens_for(requests))
    dialects = list(itertools.islice(itertools.cycle(["vllm", "sglang"]), options.replicas))
    if options.dialect != "mixed":
        dialects = [options.dialect] * options.replicas
    with sim_replicas([["--dialect", d, "--token-delay", str(options.token_delay_s)] for d in dialects]) as sims:
        entries = [sim_replica_entry(s.url, d) for s, d in zip(sims, dialects, strict=True)]
        with GatewayProcess(entries, {"generation": {"max_connections_per_replica": requests + 64}}) as gateway:
            console.print(f"  {requests} streams → gateway {gateway.url} → {options.replicas} replicas ({dialects})")
            streams = [Stream(i, prompt_of(i, options.prompt_tokens)) for i in range(requests)]
            ready = Readiness(requests, options.warm_tokens)
            started = time.monotonic()
            async with loopback_client(4, options.timeout_s) as admin:
                await log_arrivals(admin, [s.url for s in sims])
                async with agent_clients(requests, options.timeout_s) as clients, asyncio.TaskGroup() as group:
                    for stream, client in zip(streams, clients, strict=True):
                        group.create_task(run_stream(client, gateway.url, stream, result.max_tokens, ready))
                    await ready.event.wait()
                    result.ramp_s = time.monotonic() - started
                    sent, returned, report = await publish(admin, gateway.url)
                result.wall_s = time.monotonic() - started
                arrivals = await continuation_arrivals(admin, [s.url for s in sims], sent, options.prompt_tokens)
                result.arrivals = [at - returned for at in arrivals]
                metrics = await admin.get(f"{gateway.url}/metrics")
                result.dispatch = Histogram.scrape(metrics.text, DISPATCH_METRIC)
    result.admin_s = returned - sent
    result.reported_s = float(report["duration_s"])
    measure(streams, sent, returned, result)
    shape = ModelShape()
    for stream in streams:
        reason = check(stream, result.max_tokens, options.verify_tokens, shape)
        if reason is not None:
            result.failures[reason] += 1
    return result


def summary(result: RunResult, options: Options) -> dict[str, str]:
    """The table's column for one run: row label → cell."""
    lat = Percentiles.of(result.latencies)
    gap = Percentiles.of(result.gaps)
    arrival = Percentiles.of(result.arrivals)
    dispatch = result.dispatch
    dispatched = f"{dispatch.count:,.0f}" if dispatch is not None else "—"
    within = dispatch.share_within(DISPATCH_BUDGET_S) * 100 if dispatch is not None else math.nan
    return {
        "max_tokens per request": f"{result.max_tokens:,}",
        "ramp until all streamed warm tokens, s": f"{result.ramp_s:,.1f}",
        "requests in flight at the update": f"{result.requests - result.ended_before_update:,}",
        "requests resumed (num_resumes ≥ 1)": f"{result.resumed:,}",
        "update: admin call, ms (client)": ms(result.admin_s),
        "update: duration_s reported, ms": ms(result.reported_s),
        "dispatch (gateway: release → sent) count": dispatched,
        "dispatch (gateway) p50, ms": ms(dispatch.quantile(0.5) if dispatch else math.nan),
        "dispatch (gateway) p99, ms": ms(dispatch.quantile(0.99) if dispatch else math.nan),
        "dispatch (gateway) within 100 ms, %": "—" if math.isnan(within) else f"{within:,.1f}",
        "resume → continuation at replica p50, ms": ms(arrival.p50),
        "resume → continuation at replica p99, ms": ms(arrival.p99),
        "resume → continuation at replica max, ms": ms(arrival.max),
        "resume → first new token p50, ms": ms(lat.p50),
        "resume → first new token p99, ms": ms(lat.p99),
        "resume → first new token max, ms": ms(lat.max),
        "  p99 in decode steps (÷ token delay)": f"{lat.p99 / options.token_delay_s:,.1f}",
        "  max ÷ requests in flight, µs": f"{lat.max / result.requests * 1e6:,.1f}",
        "agent-visible gap p50, ms": ms(gap.p50),
        "agent-visible gap p99, ms": ms(gap.p99),
        "failures (must be 0)": f"{sum(result.failures.values())}",
        "wall time of the run, s": f"{result.wall_s:,.1f}",
    }


def report(console: Console, options: Options, results: Sequence[RunResult]) -> None:
    columns = [summary(r, options) for r in results]
    rows = [[label, *(column[label] for column in columns)] for label in columns[0]]
    title = (
        f"Resume latency across one weight update (abort): {options.replicas} sim replicas ({options.dialect}), "
        f"token delay {options.token_delay_s * 1000:g} ms, prompts of {options.prompt_tokens:,} tokens; "
        f"{machine_line()}"
    )
    note = (
        "'dispatch (gateway)' is the gateway's histogram: release of the held requests → continuation sent to "
        "the replica, the client's write included (p50/p99 interpolated within buckets; the share within 100 ms "
        "is exact). 'continuation at replica' is the simulator's arrival log (after its HTTP parsing) minus the "
        "return of the admin call. "
        "'resume → first new token' is, per request, the arrival of its first version-1 token minus the moment "
        "the admin call returned (every replica resumed); compare the columns to see how it grows with the "
        "number of requests the gateway re-issues at once. The decode-step row divides by the simulated token "
        "delay (one step is the least any engine needs); 'gap' is the stall an agent sees, the update included."
    )
    print_table(console, title, ["", *(f"{r.requests:,} in flight" for r in results)], rows, note)
    for result in results:
        if result.ended_before_update:
            console.print(
                f"[red]{result.requests} in flight: {result.ended_before_update} ended before the update "
                "(the ramp outlasted their generation: raise --max-tokens)[/]"
            )
        for reason, count in result.failures.most_common():
            console.print(f"[red]{result.requests} in flight: {count} × {reason}[/]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_latency",
        description="Latency to resume N in-flight streaming /generate requests after a weight update (abort).",
    )
    p.add_argument(
        "--requests", type=int, nargs="+", default=None, help="in-flight counts (default 100 1000; quick 100 300)"
    )
    p.add_argument("--replicas", type=int, default=2, help="simulator replicas (child processes)")
    p.add_argument("--dialect", choices=("vllm", "sglang", "mixed"), default="vllm")
    p.add_argument("--token-delay", type=float, default=0.2, help="simulated seconds per decode step (default 0.2)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (default: enough to outlast the ramp)"
    )
    p.add_argument("--warm-tokens", type=int, default=4, help="tokens every request streams before the update")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=PROMPT_HEAD,
        help=f"tokens per agent prompt (default {PROMPT_HEAD}; each continuation carries them again)",
    )
    p.add_argument("--no-verify-tokens", action="store_true", help="skip the check against the reference tokens")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole run, s (default 600; quick 120)")
    p.add_argument("--quick", action="store_true", help="100 and 300 in flight: well under a minute")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if args.replicas < 1 or args.warm_tokens < 1 or args.token_delay <= 0:
        raise SystemExit("--replicas and --warm-tokens must be ≥ 1 and --token-delay > 0")
    if args.max_tokens is not None and args.max_tokens <= args.warm_tokens:
        raise SystemExit("--max-tokens must exceed --warm-tokens, or requests end before the update")
    if args.requests is not None and min(args.requests) < 1:
        raise SystemExit("--requests must be ≥ 1")
    if not PROMPT_HEAD <= args.prompt_tokens <= SIM_CONTEXT // 2:
        raise SystemExit(f"--prompt-tokens must be between {PROMPT_HEAD} and {SIM_CONTEXT // 2}")
    return Options(
        requests=tuple(args.requests or ((100, 300) if args.quick else (100, 1000))),
        replicas=args.replicas,
        dialect=args.dialect,
        token_delay_s=args.token_delay,
        max_tokens=args.max_tokens,
        warm_tokens=args.warm_tokens,
        verify_tokens=not args.no_verify_tokens,
        timeout_s=args.timeout or (120.0 if args.quick else 600.0),
        prompt_tokens=args.prompt_tokens,
    )


async def main_async(options: Options, console: Console) -> bool:
    results = []
    async with asyncio.timeout(options.timeout_s):
        for requests in options.requests:
            results.append(await run_once(requests, options, console))
    report(console, options, results)
    return all(not r.failures and r.ended_before_update == 0 for r in results)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
