"""Storing a long episode: each turn's write whole vs extending, with and without routed experts, side by side.

A multi-turn episode is one sample that grows turn after turn, and the gateway writes it to Redis at the end of
every turn (and at segment boundaries). Written whole, an episode of T turns sends O(T × length) bytes: 13 bytes
a token for the ids, mask, logprob and version, plus layers × top-k bytes a position for routed experts (R3;
48 × 8 for a 30B-A3B-like MoE). Extending (`TrajectoryStore.save_sample(stored=...)`, what the session manager
does) sends each turn's new tokens and expert rows once, and the chat conversation's new messages (`--chat-chars`
characters of text a turn, as its messages; the scalars are still sent whole).

Both variants write the same episodes, built before any timing, through the real `TrajectoryStore` into an
`EmbeddedRedis` (AOF `appendfsync everysec`, as the gateway runs it), episodes alternating A B B A. Measured per
episode: redis-server's CPU (its CPU clock), this process's CPU (the gateway's share: encoding and sending), Redis's
`total_net_input_bytes`, wall time, and the last turn's write. Each variant's stored sample is read back and
compared with the episode's final sample (exit status 1 on any difference).

    python -m benchmarks.episode_writes                      # 20 turns up to ~32k tokens; 48 × 8 experts, and none
    python -m benchmarks.episode_writes --quick
    python -m benchmarks.episode_writes --turns 50 --tokens-per-turn 1300 --layers 94 --top-k 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from redis.asyncio import Redis

from benchmarks._harness import cpu_seconds, machine_line, make_console, print_table
from gateway.embedded_redis import EmbeddedRedis
from gateway.store import Keys, TrajectoryStore
from gateway.trajectory import F32, I32, U8, Sample, SampleSaved

VARIANTS = ("whole", "extending")


@dataclass
class Totals:
    """One variant's figures, summed over its episodes."""

    redis_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    net_in_bytes: int = 0
    last_write_s: list[float] = field(default_factory=list)


def episode(
    turns: int, prompt: int, per_turn: int, layers: int, top_k: int, seed: int, chat_chars: int = 0
) -> list[Sample]:
    """The sample as stored after each turn: a prompt, then per turn a tenth of environment tokens and the rest
    sampled, with the routed experts of every position the model ran (ids below 128: one byte each; none when
    `layers` is 0), and with `chat_chars` the chat conversation these ids render: a system prompt, then per turn
    a user message (a tenth of the characters) and the assistant's reply."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghij klmnopqrst uvwxyz", np.uint8)

    def text(chars: int) -> str:
        return bytes(rng.choice(letters, chars)).decode()

    conversation = [{"role": "system", "content": text(chat_chars)}] if chat_chars else []
    for _ in range(turns if chat_chars else 0):
        conversation.append({"role": "user", "content": text(chat_chars // 10)})
        conversation.append({"role": "assistant", "content": text(chat_chars - chat_chars // 10)})
    total = prompt + turns * per_turn
    ids = rng.integers(0, 50_000, total).astype(I32)
    experts = rng.integers(0, 128, (total - 1, layers, top_k)).astype(np.uint8)
    env = per_turn // 10
    mask = np.tile(np.concatenate([np.zeros(env, U8), np.ones(per_turn - env, U8)]), turns)
    logprobs = np.where(mask == 1, -rng.random(mask.size), 0.0).astype(F32)
    versions = np.where(mask == 1, 3, -1).astype(I32)
    samples = []
    for turn in range(1, turns + 1):
        length = turn * per_turn
        samples.append(
            Sample(
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt : prompt + length],
                loss_mask=mask[:length],
                logprobs=logprobs[:length],
                versions=versions[:length],
                routed_experts=experts[: prompt + length - 1] if layers else None,
                num_turns=turn,
                conversation=conversation[: 1 + 2 * turn] if chat_chars else None,
            )
        )
    return samples


async def write_episode(
    store: TrajectoryStore, client: Redis, redis_pid: int | None, samples: list[Sample], variant: str, totals: Totals
) -> bool:
    """Write one episode's turns in `variant`, add its figures to `totals`; whether Redis holds the last sample."""
    meta = await store.create_session()
    net_before = (await client.info("stats"))["total_net_input_bytes"]
    redis_before, client_before, started = cpu_seconds(redis_pid), time.process_time(), time.perf_counter()
    saved: SampleSaved | None = None
    last = 0.0
    for sample in samples:
        stored = saved.stored if saved is not None and variant == "extending" else None
        began = time.perf_counter()
        saved = await store.save_sample(meta.id, 0, sample, stored=stored)
        last = time.perf_counter() - began
    totals.wall_s += time.perf_counter() - started
    totals.client_cpu_s += time.process_time() - client_before
    redis_after = cpu_seconds(redis_pid)
    if redis_before is not None and redis_after is not None:
        totals.redis_cpu_s += redis_after - redis_before
    totals.net_in_bytes += (await client.info("stats"))["total_net_input_bytes"] - net_before
    totals.last_write_s.append(last)
    [loaded] = await store.load_samples(meta.id)
    await client.delete(store.keys.meta(meta.id), store.keys.sample(meta.id, 0))
    want = samples[-1]
    same_experts = (
        loaded.routed_experts is None
        if want.routed_experts is None
        else loaded.routed_experts is not None and np.array_equal(loaded.routed_experts, want.routed_experts)
    )
    return bool(
        np.array_equal(loaded.response_ids, want.response_ids)
        and np.array_equal(loaded.loss_mask, want.loss_mask)
        and np.array_equal(loaded.logprobs, want.logprobs)
        and np.array_equal(loaded.versions, want.versions)
        and same_experts
        and loaded.conversation == want.conversation
    )


async def run(options: argparse.Namespace, layers: int) -> tuple[dict[str, Totals], bool]:
    episodes = [
        episode(options.turns, options.prompt, options.tokens_per_turn, layers, options.top_k, seed, options.chat_chars)
        for seed in range(options.episodes)
    ]
    totals = {variant: Totals() for variant in VARIANTS}
    ok = True
    async with EmbeddedRedis() as server:
        client = Redis.from_url(server.url)
        store = TrajectoryStore(client, Keys(), sweep_interval_s=None)
        try:
            await write_episode(store, client, server.pid, episodes[0][:2], "extending", Totals())  # warm-up
            for index, samples in enumerate(episodes):
                order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    if not await write_episode(store, client, server.pid, samples, variant, totals[variant]):
                        ok = False
        finally:
            await store.aclose()
            await client.aclose()
    return totals, ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.episode_writes", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=500, help="prompt tokens")
    parser.add_argument("--tokens-per-turn", type=int, default=1_600, help="tokens each turn adds")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers of the routed experts (0: none)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument(
        "--chat-chars", type=int, default=5_000, help="characters of chat conversation a turn adds (0: none)"
    )
    parser.add_argument("--episodes", type=int, default=4, help="episodes per variant")
    parser.add_argument("--quick", action="store_true", help="8 turns of 400 tokens, 2 episodes")
    options = parser.parse_args(argv)
    if options.quick:
        options.turns, options.tokens_per_turn, options.episodes = 8, 400, 2
    if options.chat_chars < 0:
        parser.error("--chat-chars must be >= 0")
    console = make_console()
    n = options.episodes
    length = options.prompt + options.turns * options.tokens_per_turn
    rows, ok = [], True
    for layers in dict.fromkeys([options.layers, 0]):
        case = f"experts {layers} × {options.top_k}" if layers else "no experts"
        totals, case_ok = asyncio.run(run(options, layers))
        ok = ok and case_ok
        for variant in VARIANTS:
            t = totals[variant]
            rows.append(
                [
                    f"{case}, {variant}",
                    f"{t.net_in_bytes / n / 1e6:,.2f}",
                    f"{t.redis_cpu_s / n * 1e3:,.0f}",
                    f"{t.client_cpu_s / n * 1e3:,.0f}",
                    f"{t.wall_s / n * 1e3:,.0f}",
                    f"{float(np.median(t.last_write_s)) * 1e3:,.2f}",
                ]
            )
        whole, extending = totals["whole"], totals["extending"]
        rows.append(
            [
                f"{case}, whole ÷ extending",
                _ratio(whole.net_in_bytes, extending.net_in_bytes),
                _ratio(whole.redis_cpu_s, extending.redis_cpu_s),
                _ratio(whole.client_cpu_s, extending.client_cpu_s),
                _ratio(whole.wall_s, extending.wall_s),
                _ratio(float(np.median(whole.last_write_s)), float(np.median(extending.last_write_s))),
            ]
        )
    print_table(
        console,
        f"One episode of {options.turns} turns growing to {length:,} tokens"
        + (f" and {options.chat_chars:,} characters of chat a turn" if options.chat_chars else "")
        + f" — {machine_line()}",
        ["case, variant", "MB sent to Redis", "redis CPU ms", "gateway CPU ms", "wall ms", "last turn's write ms"],
        rows,
        f"per episode, mean of {n}; 'gateway CPU' is this process (encoding and sending); the last turn's write is "
        "the median over episodes.",
    )
    if not ok:
        console.print("[red]a stored sample differs from the episode's last sample[/]")
    return 0 if ok else 1


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}×" if b > 0 else "—"


if __name__ == "__main__":
    sys.exit(main())
