"""Long prompts beside streaming agents: tokenized in worker threads vs on the event loop, side by side.

A raw completion's text prompt is tokenized by the gateway (so are a new chat conversation and a chat turn's new
tail). On the event loop, a 64,000-character prompt holds every other request for the whole encode. With
`model.encode_threads`, texts of at least `model.encode_thread_min_chars` characters are encoded in worker threads
(the tokenizer releases the GIL), and the loop goes on relaying the other streams.

One run: two simulator replicas (child processes, `--token-delay` per token), then, for each setting in turn
(ABAB over `--rounds`, a fresh gateway process each time, the replicas shared), `--streams` streaming `/generate`
requests of `--stream-tokens` tokens, while `--long-workers` clients send `/v1/completions` requests with a text
prompt of `--prompt-chars` characters (1 token each) back to back until the streams end. Stream pacing is off, so
every token goes on as it comes and the gap between two events of a stream is what the gateway added to the
engine's token delay.

The simulator spends more on a long prompt than the gateway does (a hash per prompt token, in Python, on its one
event loop), so the streams and the long prompts must not share a replica: the streams' session ids are chosen to
land on the first replica and the long prompts' (a session each) on the second, by the gateway's own placement
hash (rendezvous over the replica ids, with the bounded-load rule off: `routing.balance_factor` 1,000). Each
replica's prompt log checks that placement afterwards.

Reported per setting (all rounds pooled): the streams' gaps between consecutive events (p50, p99, max), the long
requests' latency and count, and the gateway's CPU seconds over the timed part (its threads included). Checks,
counted as failures (must be 0): every request answers 200, every stream ends with `--stream-tokens` tokens and
every long request with one, and no replica saw a request meant for the other.

    python -m benchmarks.long_prompts
    python -m benchmarks.long_prompts --quick
    python -m benchmarks.long_prompts --threads 0 4 --prompt-chars 200000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console

from benchmarks._harness import (
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
from common.hashing import mix64, string_key

CONTEXT = 131_072  # the replicas' and the gateway's context: a long prompt's tokens fit
STREAM_PROMPT_MAX = 64  # a stream's prompt is 4 tokens (a continuation adds its output); a long prompt, thousands
WORDS = "alpha beta gamma delta river stone cloud forest — 你好 🙂 def return self value".split()


@dataclass(frozen=True)
class Options:
    threads: tuple[int, ...]
    rounds: int
    streams: int
    stream_tokens: int
    token_delay_s: float
    long_workers: int
    prompt_chars: int
    timeout_s: float


@dataclass
class Side:
    """What one setting measured over its rounds."""

    threads: int
    gaps: list[float] = field(default_factory=list)
    long_latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)


def long_prompt(chars: int, seed: int) -> str:
    """Words in random order: text the tokenizer cannot take in long repeated pieces."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def replica_id(url: str) -> str:
    """The gateway's id of a replica configured by `url` alone (host:port)."""
    return url.split("://", 1)[1].rstrip("/")


def sessions_on(replica: str, replicas: Sequence[str], prefix: str) -> Iterator[str]:
    """Session ids that the gateway's sticky placement (rendezvous hashing, no load rule) puts on `replica`."""
    keys = {r: string_key(r) for r in replicas}
    for number in itertools.count():
        session_id = f"{prefix}-{number}"
        key = string_key(session_id)
        if max(replicas, key=lambda r: mix64(key ^ keys[r])) == replica:
            yield session_id


async def run_stream(client: httpx.AsyncClient, url: str, session_id: str, options: Options, side: Side) -> None:
    body = {
        "session_id": session_id,
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": options.stream_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    tokens = 0
    last: float | None = None
    gaps: list[float] = []
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        if response.status_code != 200:
            side.failures[f"stream HTTP {response.status_code}"] += 1
            await response.aread()
            return
        async for arrived, event in sse_events(response):
            if "error" in event:
                side.failures["stream error event"] += 1
                return
            new = len(event.get("output_ids") or ())
            if new:
                if last is not None:
                    gaps.append(arrived - last)
                last = arrived
                tokens += new
    if tokens != options.stream_tokens:
        side.failures[f"a stream ended with {tokens} tokens"] += 1
    side.gaps += gaps


async def send_long_prompts(
    client: httpx.AsyncClient,
    url: str,
    prompts: Sequence[str],
    sessions: Iterator[str],
    until: asyncio.Event,
    side: Side,
) -> None:
    for prompt in itertools.cycle(prompts):
        if until.is_set():
            return
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        request = json_post(client, f"{url}/v1/completions", body)
        request.headers["x-session-id"] = next(sessions)
        started = time.perf_counter()
        response = await client.send(request)
        if response.status_code != 200:
            side.failures[f"long prompt HTTP {response.status_code}: {response.text[:120]}"] += 1
            continue
        if response.json()["usage"]["completion_tokens"] != 1:
            side.failures["a long prompt's answer is not one token"] += 1
        side.long_latencies.append(time.perf_counter() - started)


async def prompt_lengths(admin: httpx.AsyncClient, url: str) -> list[int]:
    """The prompt length of every request the replica logged since its log was (re)started."""
    response = await admin.get(f"{url}/sim/prompt_log")
    response.raise_for_status()
    return [length for _, length, _ in response.json()["requests"]]


async def run_round(sims: Sequence[Any], threads: int, options: Options, side: Side, round_index: int) -> None:
    settings = {
        "model": {"max_model_len": CONTEXT, "encode_threads": threads},
        "generation": {"stream_pacing_s": 0},
        "routing": {"balance_factor": 1000},
    }
    entries = [sim_replica_entry(sim.url, "vllm") for sim in sims]
    ids = [replica_id(sim.url) for sim in sims]
    # Four prompts per client, none shared: the gateway encodes a text that concurrent callers share once.
    prompts = [[long_prompt(options.prompt_chars, 4 * c + k) for k in range(4)] for c in range(options.long_workers)]
    tag = f"{threads}-{round_index}"  # fresh sessions each round (the gateways share nothing, Redis included)
    stream_sessions = list(itertools.islice(sessions_on(ids[0], ids, f"stream-{tag}"), options.streams))
    long_sessions = sessions_on(ids[1], ids, f"long-{tag}")
    with GatewayProcess(entries, settings) as gateway:
        async with (
            agent_clients(options.streams, options.timeout_s) as clients,
            loopback_client(options.long_workers + 2, options.timeout_s) as client,
        ):
            for sim in sims:
                (await client.post(f"{sim.url}/sim/prompt_log", json={"head": 1})).raise_for_status()
            done = asyncio.Event()
            cpu_before = gateway.cpu_seconds() or 0.0
            senders = [
                asyncio.create_task(send_long_prompts(client, gateway.url, own, long_sessions, done, side))
                for own in prompts
            ]
            try:
                await asyncio.gather(
                    *(
                        run_stream(c, gateway.url, s, options, side)
                        for c, s in zip(clients, stream_sessions, strict=True)
                    )
                )
            finally:
                done.set()
                await asyncio.gather(*senders)
            side.cpu_s += (gateway.cpu_seconds() or 0.0) - cpu_before
            streams_seen = await prompt_lengths(client, sims[0].url)
            long_seen = await prompt_lengths(client, sims[1].url)
            if any(length > STREAM_PROMPT_MAX for length in streams_seen):
                side.failures["a long prompt reached the streams' replica"] += 1
            if any(length <= STREAM_PROMPT_MAX for length in long_seen):
                side.failures["a stream reached the long prompts' replica"] += 1


def report(console: Console, options: Options, sides: Sequence[Side]) -> None:
    rows: list[list[str]] = []
    for side in sides:
        gaps, long = Percentiles.of(side.gaps), Percentiles.of(side.long_latencies)
        rows.append(
            [
                f"{side.threads} thread{'s' if side.threads != 1 else ''}" if side.threads else "on the loop",
                ms(gaps.p50),
                ms(gaps.p99),
                ms(gaps.max),
                f"{long.count:,}",
                ms(long.p50),
                ms(long.p99),
                f"{side.cpu_s:.2f}",
                f"{sum(side.failures.values())}",
            ]
        )
    title = (
        f"Long prompts ({options.prompt_chars:,} characters, {options.long_workers} clients back to back) beside "
        f"{options.streams} streams of {options.stream_tokens} tokens at {options.token_delay_s * 1000:g} ms a "
        f"token, {options.rounds} round(s) each; {machine_line()}"
    )
    columns = [
        "tokenizing",
        "gap p50 ms",
        "gap p99 ms",
        "gap max ms",
        "long prompts",
        "long p50 ms",
        "long p99 ms",
        "gateway CPU s",
        "failures",
    ]
    note = (
        "gap = time between two events of one stream at the client (the engine's token delay plus what the "
        "gateway added; stream pacing off). long = latency of one long-prompt request (tokenizing, one token, "
        "the record in Redis). CPU = the gateway process's utime+stime over the timed part, threads included."
    )
    print_table(console, title, columns, rows, note)
    for side in sides:
        for reason, count in side.failures.most_common():
            console.print(f"[red]threads {side.threads}: {count} × {reason}[/]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.long_prompts",
        description="Streams' gaps while long text prompts are tokenized: in worker threads vs on the event loop.",
    )
    p.add_argument("--threads", type=int, nargs="+", default=[0, 2], help="model.encode_threads settings (0 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per setting, alternating (2; quick 1)")
    p.add_argument("--streams", type=int, default=64, help="streaming /generate requests per round (64; quick 16)")
    p.add_argument("--stream-tokens", type=int, default=300, help="tokens per stream (300; quick 100)")
    p.add_argument("--token-delay", type=float, default=0.01, help="simulated seconds per token (0.01)")
    p.add_argument("--long-workers", type=int, default=2, help="clients sending long prompts back to back (2)")
    p.add_argument("--prompt-chars", type=int, default=64_000, help="characters per long prompt (64,000)")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole run, s (600; quick 180)")
    p.add_argument("--quick", action="store_true", help="one short round per setting")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if min(args.threads) < 0 or args.rounds < 1 or args.streams < 1 or args.long_workers < 1:
        raise SystemExit("--threads must be >= 0; --rounds, --streams and --long-workers >= 1")
    if args.stream_tokens < 2 or args.token_delay <= 0 or args.prompt_chars < 1:
        raise SystemExit("--stream-tokens must be >= 2, --token-delay > 0 and --prompt-chars >= 1")
    if args.prompt_chars > CONTEXT:
        raise SystemExit(f"--prompt-chars must be at most {CONTEXT:,} (the context holds a token per character)")
    return Options(
        threads=tuple(args.threads),
        rounds=1 if args.quick and args.rounds == 2 else args.rounds,
        streams=16 if args.quick and args.streams == 64 else args.streams,
        stream_tokens=100 if args.quick and args.stream_tokens == 300 else args.stream_tokens,
        token_delay_s=args.token_delay,
        long_workers=args.long_workers,
        prompt_chars=args.prompt_chars,
        timeout_s=args.timeout or (180.0 if args.quick else 600.0),
    )


async def main_async(options: Options, console: Console) -> bool:
    sides = [Side(threads) for threads in options.threads]
    sim_args = ["--dialect", "vllm", "--token-delay", str(options.token_delay_s), "--max-model-len", str(CONTEXT)]
    async with asyncio.timeout(options.timeout_s):
        with sim_replicas([sim_args, sim_args]) as sims:
            for round_index in range(options.rounds):
                order = sides if round_index % 2 == 0 else sides[::-1]
                for side in order:
                    await run_round(sims, side.threads, options, side, round_index)
                    console.print(
                        f"  round {round_index + 1}  threads {side.threads}: {len(side.long_latencies):,} long "
                        f"prompts so far, {sum(side.failures.values())} failures"
                    )
    report(console, options, sides)
    return not any(side.failures for side in sides)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
