"""SGLang's stream events, cumulative (its default) or deltas: what decoding them costs the gateway per token.

Without `--incremental-streaming-output` every event of an SGLang stream repeats all the output ids and logprobs so
far, so the JSON the gateway decodes grows with the square of the output's length. This runs one stream's events,
in the shape the simulator writes them, through the gateway's SSE decode and the SGLang adapter (`_decode_events` or
`decode_latest`, then `SglangBackend._chunk`), in this process, no sockets, for each output length:

* `deltas`: one event a token, each with that token only (the server runs with `--incremental-streaming-output`);
* `cumulative, 1 a read`: each event with every token so far, one event per socket read (a lightly loaded
  gateway);
* `cumulative, K a read`: K events per read (paced reads under load), every one decoded (before 2026-11-27), and
  only the last one decoded (`decode_latest`, what the adapter does once a stream shows itself cumulative).

The figure is CPU time per output token, the best of `--repeats` runs; every run checks that the tokens came out
whole and in order.

    python -m benchmarks.sglang_events
    python -m benchmarks.sglang_events --tokens 256 1024 --events-per-read 4
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from backends.base import ReplicaSpec, SamplingParams
from backends.http_client import _decode_events, decode_latest
from backends.sglang import SglangBackend
from benchmarks._harness import machine_line, make_console, print_table

Decode = Callable[[bytes], tuple[bytes, list[Any], bool, tuple[int, str] | None]]
FIRST_ID = 100


def events(tokens: int, cumulative: bool) -> list[bytes]:
    """The SSE events of one stream of `tokens` output tokens, in the shape the SGLang simulator writes."""
    out = []
    for total in range(1, tokens + 1):
        start = 0 if cumulative else total - 1
        meta = {
            "id": "8e1276f631774a02970b17ed6264de55",
            "finish_reason": None,
            "prompt_tokens": 8,
            "completion_tokens": total,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.0123,
            "output_token_logprobs": [[-0.389, FIRST_ID + i, None] for i in range(start, total)],
            "output_token_logprobs_length": total - start,
        }
        event = {"text": "", "output_ids": list(range(FIRST_ID + start, FIRST_ID + total)), "meta_info": meta}
        out.append(b"data: " + orjson.dumps(event) + b"\n\n")
    return out


def cost_per_token(reads: Sequence[bytes], decode: Decode, tokens: int, repeats: int) -> float:
    """µs of CPU per output token to decode `reads` and turn them into chunks, the best of `repeats` runs."""
    backend = SglangBackend(ReplicaSpec(id="r0", url="http://127.0.0.1:1"))
    sampling = SamplingParams(max_tokens=tokens)
    best = float("inf")
    for _ in range(repeats):
        ids: list[int] = []
        seen = 0
        started = time.process_time()
        for read in reads:
            _, batch, _, _ = decode(read)
            for event in batch:
                chunk, seen = backend._chunk(event, sampling, 8, 0, seen)
                ids += chunk.token_ids
        best = min(best, time.process_time() - started)
        if ids != list(range(FIRST_ID, FIRST_ID + tokens)):
            raise AssertionError(f"{decode.__name__}: the tokens did not come out whole and in order")
    return best / tokens * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sglang_events", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096], help="output lengths")
    p.add_argument("--events-per-read", type=int, default=7, help="events per socket read under load (7)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, the best counts (3)")
    args = p.parse_args(argv)
    per_read = max(1, args.events_per_read)
    rows = []
    for tokens in args.tokens:
        deltas, cumulative = events(tokens, False), events(tokens, True)
        batched = [b"".join(cumulative[i : i + per_read]) for i in range(0, tokens, per_read)]
        every = cost_per_token(batched, _decode_events, tokens, args.repeats)
        latest = cost_per_token(batched, decode_latest, tokens, args.repeats)
        rows.append(
            [
                f"{tokens:,}",
                f"{cost_per_token(deltas, _decode_events, tokens, args.repeats):.1f}",
                f"{cost_per_token(cumulative, _decode_events, tokens, args.repeats):.1f}",
                f"{every:.1f}",
                f"{latest:.1f}",
                f"{latest / every:.2f}",
                f"{sum(map(len, cumulative)) / tokens / 1e3:.1f}",
            ]
        )
    console = make_console()
    console.print(machine_line())
    print_table(
        console,
        "SGLang stream events: the gateway's decode and adapter, CPU µs per output token",
        [
            "output tokens",
            "deltas",
            "cumulative, 1 a read",
            f"cumulative, {per_read} a read",
            f"{per_read} a read, last only",
            "last only ÷ all",
            "cumulative kB/token",
        ],
        rows,
        "deltas = --incremental-streaming-output; cumulative = SGLang's default. 'last only' is what the adapter does "
        "once a stream shows itself cumulative (backends.http_client.decode_latest).",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
