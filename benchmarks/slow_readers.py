"""Clients that never read their streams: the gateway's memory with and without a process-wide budget, side by side.

A streamed answer queues for its client what the client's socket does not take. One such client is bounded by
`server.stream_buffer_bytes` (16 MiB); all of a process's streams together by `server.stream_buffer_budget_bytes`
(256 MiB by default): past it, the streams holding the most are cut (their turns kept as cancelled) and the heap
their bytes held is handed back to the system. Reported (issue 52 §2): 30 never-read streams of 4,000 tokens with
20 top logprobs took a gateway's RSS from 432 to 895 MiB, and it kept 732 MiB once they closed.

One run: one simulator replica (a child process), then for each budget in turn a fresh gateway process: its RSS at
rest, then `--streams` chat turns (`--tokens` tokens, `top_logprobs` 20, `ignore_eos`), each on a socket with a
2 KiB receive buffer that is never read, sent at once; the RSS sampled every 0.2 s until what the streams queue stops
changing (their generations ended or were cut); then the sockets closed and, 3 s later, the RSS again. That round
runs `--rounds` times in the same process: memory a round keeps and the next reuses is the allocators' (Python's
arenas and the C heap keep what they once held), memory that grows with every round is a leak.

Reported per budget: the gateway's RSS growth at its peak and after the clients left, after the first round and after
the last (over its RSS at rest), the most
bytes its streams held queued (`rollout_gateway_stream_queued_bytes`, scraped with each sample), and the streams cut
by cause. Checks (must hold): every stream is answered 200; once the clients left nothing stays queued; with a
budget, the queued bytes never pass it by more than one stream's bound.

    python -m benchmarks.slow_readers
    python -m benchmarks.slow_readers --budgets-mib 0 256 64 --streams 30 --tokens 4000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    machine_line,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)
from benchmarks.fleet import rss_mib

OFF = 1 << 40  # a budget no run reaches: each stream bounded by `server.stream_buffer_bytes` alone
CONTEXT = 16_384


@dataclass(frozen=True)
class Options:
    budgets_mib: tuple[int, ...]
    streams: int
    tokens: int
    token_delay_s: float
    timeout_s: float
    rounds: int


@dataclass
class Side:
    """What one budget measured."""

    budget_mib: int
    rss_rest_mib: float = math.nan
    rss_peak_mib: float = 0.0
    rss_after_mib: list[float] = field(default_factory=list)  # after each round's clients left
    queued_peak: float = 0.0
    queued_after: float = math.nan
    cuts: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "off (per stream only)" if self.budget_mib == 0 else f"{self.budget_mib:,} MiB"


async def queued_and_cuts(client: httpx.AsyncClient, url: str) -> tuple[float, dict[str, float]]:
    """The gateway's queued stream bytes and its slow clients cut, by cause, from its metrics."""
    text = (await client.get(f"{url}/metrics")).text
    queued, cuts = 0.0, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rollout_gateway_stream_queued_bytes":
                queued = sample.value
            elif sample.name == "rollout_gateway_slow_clients_cut_total":
                cuts[sample.labels.get("cause", "")] = sample.value
    return queued, cuts


async def never_read(url: httpx.URL, index: int, tokens: int) -> socket.socket:
    """A streamed chat turn sent on a socket with a 2 KiB receive buffer, which nobody reads."""
    body = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"tell me a long story, number {index}"}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc.decode()}\r\ncontent-type: application/json\r\n"
        f"x-session-id: unread-{index}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (url.host, url.port))
    await loop.sock_sendall(sock, head + body)
    return sock


async def run_side(sim_url: str, options: Options, side: Side) -> None:
    budget = OFF if side.budget_mib == 0 else side.budget_mib << 20
    settings = {
        "server": {"stream_buffer_budget_bytes": budget},
        "model": {"max_model_len": CONTEXT},
        "generation": {"stream_pacing_s": 0},
    }
    with GatewayProcess([sim_replica_entry(sim_url, "vllm")], settings) as gateway:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.sleep(1.0)  # the process settles after its start (imports, the first probes)
            side.rss_rest_mib = rss_mib(gateway.pid)
            for _ in range(options.rounds):
                await run_round(client, gateway.url, gateway.pid, options, side)
    if side.queued_after:
        side.failures.append(f"{side.queued_after:,.0f} bytes stayed queued after the clients left")
    if side.budget_mib and side.queued_peak > budget + (16 << 20):
        side.failures.append(f"{side.queued_peak / 2**20:,.0f} MiB queued, past the budget and one stream's bound")


async def run_round(client: httpx.AsyncClient, gateway_url: str, pid: int | None, options: Options, side: Side) -> None:
    """One round: the streams sent at once and never read until what they queue stops changing, then closed."""
    url = httpx.URL(gateway_url)
    sockets = [await never_read(url, index, options.tokens) for index in range(options.streams)]
    try:
        steady, last = 0, -1.0
        while steady < 10:  # 2 s without a change in what the streams queue
            await asyncio.sleep(0.2)
            queued, side.cuts = await queued_and_cuts(client, gateway_url)
            side.rss_peak_mib = max(side.rss_peak_mib, rss_mib(pid))
            side.queued_peak = max(side.queued_peak, queued)
            steady = steady + 1 if queued == last else 0
            last = queued
        head = sockets[0].recv(256, socket.MSG_PEEK)
        if not head.startswith(b"HTTP/1.1 200"):
            side.failures.append(f"a stream was answered {head[:40]!r}")
    finally:
        for sock in sockets:
            sock.close()
    await asyncio.sleep(3.0)
    side.queued_after, side.cuts = await queued_and_cuts(client, gateway_url)
    side.rss_after_mib.append(rss_mib(pid))


def report(console: Console, options: Options, sides: Sequence[Side]) -> None:
    rows = [
        [
            side.label,
            f"{side.rss_rest_mib:,.0f}",
            f"+{side.rss_peak_mib - side.rss_rest_mib:,.0f}",
            f"+{side.rss_after_mib[0] - side.rss_rest_mib:,.0f}",
            f"+{side.rss_after_mib[-1] - side.rss_rest_mib:,.0f}",
            f"{side.queued_peak / 2**20:,.0f}",
            ", ".join(f"{cause} {count:g}" for cause, count in sorted(side.cuts.items()) if count) or "none",
            str(len(side.failures)),
        ]
        for side in sides
    ]
    title = (
        f"{options.streams} streamed chat turns never read ({options.tokens:,} tokens, 20 top logprobs each, "
        f"{options.token_delay_s * 1000:g} ms a token); {machine_line()}"
    )
    columns = [
        "stream budget",
        "RSS at rest, MiB",
        "peak",
        "after they left",
        f"after round {options.rounds}",
        "queued at most, MiB",
        "cut",
        "failures",
    ]
    note = (
        "RSS: the gateway process's VmRSS, growth over its RSS at rest: at its peak (sampled every 0.2 s while the "
        "streams queued), 3 s after the first round's clients closed their sockets, and after the last round's (the "
        "same streams again in the same process: memory the first round kept and the next reused is no leak). "
        "queued: rollout_gateway_stream_queued_bytes. cut: rollout_gateway_slow_clients_cut_total by cause "
        "(`budget`: the process-wide budget; `buffer`: one stream's server.stream_buffer_bytes)."
    )
    print_table(console, title, columns, rows, note)
    for side in sides:
        for failure in side.failures:
            console.print(f"[red]{side.label}: {failure}[/]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_readers",
        description="Never-read streams: the gateway's RSS with and without the process-wide stream budget.",
    )
    p.add_argument(
        "--budgets-mib", type=int, nargs="+", default=[0, 256, 64], help="stream budgets, MiB (0: off) (0 256 64)"
    )
    p.add_argument("--streams", type=int, default=30, help="never-read streams (30)")
    p.add_argument("--tokens", type=int, default=4000, help="tokens a stream (4,000)")
    p.add_argument("--token-delay", type=float, default=0.0005, help="simulated seconds per token (0.0005)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of streams per gateway process (3)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole run, s (600)")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if min(args.budgets_mib) < 0 or min(args.streams, args.tokens, args.rounds) < 1 or args.token_delay <= 0:
        raise SystemExit("--budgets-mib must be >= 0; --streams, --tokens and --rounds >= 1; --token-delay > 0")
    if args.tokens >= CONTEXT - 64:
        raise SystemExit(f"--tokens must be below {CONTEXT - 64:,} (the context)")
    return Options(tuple(args.budgets_mib), args.streams, args.tokens, args.token_delay, args.timeout, args.rounds)


async def main_async(options: Options, console: Console) -> bool:
    sides = [Side(budget) for budget in options.budgets_mib]
    sim_args = ["--dialect", "vllm", "--token-delay", str(options.token_delay_s), "--max-model-len", str(CONTEXT)]
    async with asyncio.timeout(options.timeout_s):
        with sim_replicas([sim_args]) as [sim]:
            for side in sides:
                await run_side(sim.url, options, side)
                console.print(
                    f"  {side.label}: RSS {side.rss_rest_mib:,.0f} → {side.rss_peak_mib:,.0f} → "
                    f"{' → '.join(f'{rss:,.0f}' for rss in side.rss_after_mib)} MiB, cut {side.cuts}"
                )
    report(console, options, sides)
    return not any(side.failures for side in sides)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
