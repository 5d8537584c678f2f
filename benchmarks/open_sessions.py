"""Memory per open session: a gateway's RSS with many multi-turn chat sessions left open, idle between turns.

One run: two simulator replicas (child processes, vLLM dialect, 2 ms a decode step) and one `rollout-gateway serve`
process; a warm-up of `--concurrency` sessions of `--turns` turns, finished (the allocator, the tokenizer and the
pools reach their working size); then `--sessions` chat sessions of `--turns` turns each (a 64-word first message,
32 words a turn after the reply, 16-32-token replies), `--concurrency` at a time, left open. Reported: the gateway's
RSS (VmRSS) at start, after the warm-up and once the sessions are idle, and the growth per 1,000 open sessions (what
the process keeps for them: `SessionManager`'s cache, docs/scaling.md). Every turn must answer 200 (exit status 1
else).

    python -m benchmarks.open_sessions                          # 10,000 sessions of 2 turns
    python -m benchmarks.open_sessions --sessions 5000 --turns 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    loopback_client,
    machine_line,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)
from benchmarks.compare import GATEWAY_SETTINGS, REPLICA_ARGS
from benchmarks.session_memory import rss_mib

WORDS = "the of and to in is was for on that with as by at from it an be this which or are".split()
PER_CLIENT = 8  # connections per client: one shared pool does O(connections) work per request (`agent_clients`)


@dataclass(frozen=True)
class Options:
    sessions: int
    turns: int
    concurrency: int
    timeout_s: float


async def chat_session(client: httpx.AsyncClient, url: str, session: str, turns: int, rng: random.Random) -> str:
    """The session's turns, one after another; "" when all answered 200, else the first failure."""
    conversation = [{"role": "user", "content": f"{session} " + " ".join(rng.choice(WORDS) for _ in range(64))}]
    for _ in range(turns):
        body = {"model": "tiny", "messages": conversation, "max_tokens": rng.randint(16, 32), "temperature": 0}
        reply = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session})
        if reply.status_code != 200:
            return f"{session}: HTTP {reply.status_code}: {reply.text[:200]}"
        conversation.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
        conversation.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(32))})
    return ""


async def sessions_at_once(
    clients: Sequence[httpx.AsyncClient], url: str, names: Sequence[str], options: Options, finish: bool
) -> list[str]:
    """Every session of `names`, `options.concurrency` at a time; the failures."""
    gate, failures = asyncio.Semaphore(options.concurrency), []

    async def one(number: int, session: str) -> None:
        async with gate:
            client = clients[number % len(clients)]
            failure = await chat_session(client, url, session, options.turns, random.Random(number))
            if not failure and finish:
                done = await client.post(f"{url}/v1/sessions/{session}/finish", json={"reward": 1.0})
                failure = "" if done.status_code == 200 else f"{session}: finish answered {done.status_code}"
            if failure:
                failures.append(failure)

    async with asyncio.TaskGroup() as group:
        for number, session in enumerate(names):
            group.create_task(one(number, session))
    return failures


async def main_async(options: Options, console: Console) -> bool:
    args = [*REPLICA_ARGS[:2], "--token-delay", "0.002", *REPLICA_ARGS[4:]]
    with sim_replicas([args, args]) as sims:
        entries = [sim_replica_entry(sim.url, "vllm") for sim in sims]
        with GatewayProcess(entries, GATEWAY_SETTINGS) as gateway:
            assert gateway.pid is not None
            async with contextlib.AsyncExitStack() as stack:
                count = max(1, options.concurrency // PER_CLIENT)
                clients = [
                    await stack.enter_async_context(loopback_client(PER_CLIENT, options.timeout_s))
                    for _ in range(count)
                ]
                start = rss_mib(gateway.pid)
                warm = [f"warm-{number}" for number in range(options.concurrency)]
                failures = await sessions_at_once(clients, gateway.url, warm, options, finish=True)
                warmed = rss_mib(gateway.pid)
                began = time.perf_counter()
                names = [f"open-{number}" for number in range(options.sessions)]
                failures += await sessions_at_once(clients, gateway.url, names, options, finish=False)
                wall_s = time.perf_counter() - began
                idle = rss_mib(gateway.pid)
    console.print(machine_line())
    console.print(
        f"{options.sessions:,} open sessions of {options.turns} chat turns ({options.concurrency} at a time, "
        f"{options.sessions * options.turns / wall_s:,.0f} turns/s): gateway RSS {start:,.0f} MiB at start, "
        f"{warmed:,.0f} after the warm-up, {idle:,.0f} with the sessions open; "
        f"[bold]{(idle - warmed) / options.sessions * 1000:,.1f} MiB per 1,000 open sessions[/bold]; "
        f"{len(failures)} failures"
    )
    for failure in failures[:5]:
        console.print(f"  {failure}")
    return not failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000, help="sessions left open (10,000)")
    parser.add_argument("--turns", type=int, default=2, help="chat turns per session (2)")
    parser.add_argument("--concurrency", type=int, default=400, help="sessions under way at once (400)")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of the run, s")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.sessions, args.turns, args.concurrency) < 1:
        raise SystemExit("--sessions, --turns and --concurrency must be ≥ 1")
    options = Options(args.sessions, args.turns, args.concurrency, args.timeout)
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
