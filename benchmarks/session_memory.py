"""Memory per session: the gateway's resident memory over rounds of many sessions, with and without its byte bound.

Each gateway process keeps the samples of the sessions it served in a cache (`SessionManager`), bounded by count
(`store.session_cache_size`) and by estimated bytes (`store.session_cache_bytes`); a finished session leaves it at
once. Before the byte bound, the cache kept up to 10,000 sessions, finished ones too: with prompts of a few
thousand tokens that is gigabytes.

One run: one simulator replica (a child process); for each setting, a fresh `rollout-gateway serve` process, then
`--rounds` rounds of `--sessions` chat sessions (`--concurrency` at once), each one turn with a user message of
`--prompt-chars` characters of random words (14,000: about 3,800 tokens of the tiny tokenizer) and `--max-tokens`
sampled tokens; settings:

- `finished`: every session is finished after its turn (the default bound);
- `unfinished`: sessions are left unfinished (an agent that never calls finish; Redis expires them), so they stay
  in the cache up to its byte bound (`--cache-mib`);
- `unbounded`: unfinished, with the byte bound out of reach (the count bound alone, as before).

Reported: the gateway's RSS (VmRSS) after start and after each round, and the RSS growth per session and per
prompt token of the `unbounded` setting (what a cached session really holds: the figure to check the estimate,
`gateway.session.samples.PROMPT_TOKEN_BYTES`, against). Every turn and finish must answer 200 (exit status 1 else).

    python -m benchmarks.session_memory
    python -m benchmarks.session_memory --quick
    python -m benchmarks.session_memory --rounds 8 --sessions 500 --cache-mib 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from benchmarks._harness import (
    GatewayProcess,
    loopback_client,
    machine_line,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
)

WORDS = "the of and to in is was for on that with as by at from it an be this which or are".split()
CONTEXT = 16384


@dataclass(frozen=True)
class Options:
    rounds: int
    sessions: int
    concurrency: int
    prompt_chars: int
    max_tokens: int
    cache_mib: int
    timeout_s: float


@dataclass
class Setting:
    name: str
    finish: bool
    cache_bytes: int
    rss_mib: list[float] = field(default_factory=list)  # after start, then after each round
    prompt_tokens: int = 0
    failures: int = 0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def user_text(chars: int, rng: random.Random) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


async def one_session(
    client: httpx.AsyncClient, url: str, session: str, options: Options, setting: Setting, rng: random.Random
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": user_text(options.prompt_chars, rng)}],
        "max_tokens": options.max_tokens,
        "temperature": 0,
    }
    reply = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session})
    if reply.status_code != 200:
        setting.failures += 1
        return
    setting.prompt_tokens += reply.json()["usage"]["prompt_tokens"]
    if setting.finish:
        done = await client.post(f"{url}/v1/sessions/{session}/finish", json={"reward": 1.0})
        setting.failures += done.status_code != 200


async def run_setting(sim_url: str, options: Options, setting: Setting) -> None:
    config = {
        "model": {"max_model_len": CONTEXT},
        "store": {"session_cache_bytes": setting.cache_bytes, "max_pending": 1_000_000},
        "generation": {"stream_pacing_s": 0},
    }
    rng = random.Random(7)
    with GatewayProcess([sim_replica_entry(sim_url, "vllm")], config) as gateway:
        assert gateway.pid is not None
        setting.rss_mib.append(rss_mib(gateway.pid))
        async with loopback_client(options.concurrency, 120.0) as client:
            gate = asyncio.Semaphore(options.concurrency)

            async def bounded(session: str) -> None:
                async with gate:
                    await one_session(client, gateway.url, session, options, setting, rng)

            for round_index in range(options.rounds):
                names = [f"{setting.name}-{round_index}-{i}" for i in range(options.sessions)]
                async with asyncio.TaskGroup() as group:
                    for name in names:
                        group.create_task(bounded(name))
                setting.rss_mib.append(rss_mib(gateway.pid))


def report(console: Console, options: Options, settings: Sequence[Setting]) -> None:
    columns = ["setting", "start", *(f"round {i + 1}" for i in range(options.rounds)), "growth, last 2 rounds"]
    rows = []
    for s in settings:
        growth = s.rss_mib[-1] - s.rss_mib[-3] if len(s.rss_mib) >= 3 else float("nan")
        rows.append([s.name, *(f"{v:,.0f}" for v in s.rss_mib), f"{growth:+,.0f}"])
    per_round = options.sessions
    print_table(
        console,
        f"Gateway RSS (MiB) over rounds of {per_round:,} sessions ({options.prompt_chars:,}-character prompts, "
        f"byte bound {options.cache_mib} MiB where bounded) — {machine_line()}",
        columns,
        rows,
        note="flat rows: memory held per session is given back (finished) or capped (the byte bound)",
    )
    unbounded = next((s for s in settings if s.name == "unbounded"), None)
    if unbounded and len(unbounded.rss_mib) > 2 and unbounded.prompt_tokens:
        # From the end of round 1 on (the first round also warms the allocator, the tokenizer, the pools).
        sessions = per_round * (options.rounds - 1)
        grown = (unbounded.rss_mib[-1] - unbounded.rss_mib[1]) * 1024 * 1024
        tokens = unbounded.prompt_tokens * (options.rounds - 1) / options.rounds
        console.print(
            f"unbounded: {grown / sessions / 1024:,.1f} KiB per cached session, {grown / tokens:,.0f} bytes per "
            f"prompt token ({unbounded.prompt_tokens / per_round / options.rounds:,.0f} prompt tokens a session)"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=200, help="sessions per round")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=14000, help="about 3,800 tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cache-mib", type=int, default=64, help="the byte bound of the bounded settings")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 100 sessions")
    parser.add_argument("--timeout", type=float, default=None)
    return parser


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        rounds=3 if args.quick else args.rounds,
        sessions=100 if args.quick else args.sessions,
        concurrency=args.concurrency,
        prompt_chars=args.prompt_chars,
        max_tokens=args.max_tokens,
        cache_mib=args.cache_mib,
        timeout_s=args.timeout or (300.0 if args.quick else 1200.0),
    )


async def main_async(options: Options, console: Console) -> bool:
    bound = options.cache_mib * 1024 * 1024
    settings = [
        Setting("finished", True, bound),
        Setting("unfinished", False, bound),
        Setting("unbounded", False, 1 << 50),
    ]
    sim_args = ["--dialect", "vllm", "--token-delay", "0", "--max-model-len", str(CONTEXT)]
    async with asyncio.timeout(options.timeout_s):
        with sim_replicas([sim_args]) as sims:
            for setting in settings:
                await run_setting(sims[0].url, options, setting)
                console.print(f"  {setting.name}: RSS {' → '.join(f'{v:,.0f}' for v in setting.rss_mib)} MiB")
    report(console, options, settings)
    return not any(s.failures for s in settings)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
