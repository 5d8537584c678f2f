"""Store throughput: trajectories written to and consumed from Redis per second, and their bytes there, for our
binary sample encoding and for a JSON-lists baseline, side by side in one run.

What runs where (the machine this was written on has 2 cores): one `EmbeddedRedis` child process (its own
temporary data directory, loopback only, AOF `appendfsync everysec` as the gateway runs it, automatic AOF rewrites
off so no fork lands in a timed phase); the writers and the consumer in this process, on one uvloop event loop.

Cases, each with a pool of 16 distinct samples generated before any timing (trajectory i carries sample i % 16):

* plain: one sample of 512 prompt + 1,536 response tokens (ids, loss mask with two environment spans, logprobs,
  versions), no routed experts;
* experts: the same plus routed experts of shape (2,047, 48, 8), ids below 128 (uint8 in the binary encoding).

Variants, each writing the same trajectories with `--writers` concurrent tasks (so Redis round trips overlap) and
consuming them in batches of `--batch`:

* store · binary — the real path: `TrajectoryStore.create_session` → `save_sample` → `finish` (backpressure check,
  activity index, WATCHed create, the sample script, the finish transaction, XADD, the `stream_id` claim, the
  pending counter), then `TrajectoryConsumer.next_batch` + `ack`.
* bare · binary — the same `Sample.to_redis()` hash fields through a minimal pipeline: one round trip of HSET +
  EXPIRE + XADD per trajectory; XREADGROUP, a pipelined HGETALL, `Sample.from_redis`, then XACK + XDEL + PEXPIRE.
  Against the store it prices the session lifecycle; against JSON it isolates the encoding.
* bare · JSON (orjson, json) — that minimal pipeline with the sample as ONE JSON document in the hash, every array
  a JSON list of numbers (experts as nested lists); the consumer parses it and converts every list to numpy with
  the dtypes of the binary encoding. orjson serialises the numpy arrays itself (`OPT_SERIALIZE_NUMPY`, its fastest
  way to the same lists); the stdlib `json` writes `.tolist()` with compact separators and reads with `json.loads`.

One round of a variant: FLUSHALL, write n trajectories (timed), measure memory, consume all n (timed), then check
every consumed trajectory against what was written (each exactly once, every array equal in dtype, shape and
values). Rounds split the count and alternate the variant order (A B C D, D C B A, ...) so drift in the machine's
speed falls on every variant; an untimed warm-up round per variant loads the scripts and opens the connections.

Reported per variant: write, consume (read + decode + ack) and end-to-end trajectories/s, end-to-end being n over
write time + consume time (a trajectory's whole trip through Redis with the two phases not overlapping; in one
process on 2 cores they would compete for the same core anyway); the sample payload (hash field names + values as
sent); Redis `MEMORY USAGE key SAMPLES 0` summed over each session's keys (store: meta + sample hash; bare: the
sample hash), and the stream's per entry; Redis commands, this process's CPU and redis-server's CPU per
trajectory. Then binary ÷ JSON ratios: the numbers to compare across machines.

    python -m benchmarks.store_throughput             # 500 plain + 100 with experts per variant
    python -m benchmarks.store_throughput --quick     # 100 + 20 per variant, a few times faster
    python -m benchmarks.store_throughput --cases experts --baselines orjson --writers 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import redis.asyncio as aioredis
import uvloop
from rich.console import Console

from benchmarks._harness import BenchmarkError, machine_line, make_console, print_table
from gateway.embedded_redis import EmbeddedRedis
from gateway.store import Keys, TrajectoryStore, connect
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import ENV_VERSION, F32, I32, U8, Sample

POOL_SIZE = 16  # distinct samples per case: enough that no two neighbouring trajectories are alike
WARMUP_TRAJECTORIES = 4
GROUP = "bench"
CONSUMER = "bench-0"
WRITE_TTL_S = 3_600
ACK_TTL_S = 60.0  # what the consumer sets on acknowledged sessions (TrajectoryConsumer's default), bare ones alike
READ_TIMEOUT_S = 2.0  # everything is written before the consumer starts: an empty read means something is lost
SOCKET_TIMEOUT_S = 30.0  # a batch of 16 samples with experts as JSON is ~42 MB in one reply
VOCAB = 151_000

Fields = Mapping[str, bytes | int | str]


# -- data -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    count: int
    prompt_tokens: int
    response_tokens: int
    experts: tuple[int, int, int] | None  # (layers, top_k, number of experts)

    @property
    def label(self) -> str:
        tokens = f"{self.prompt_tokens:,} prompt + {self.response_tokens:,} response tokens"
        if self.experts is None:
            return f"{tokens}, no routed experts"
        layers, top_k, num = self.experts
        rows = self.prompt_tokens + self.response_tokens - 1
        return f"{tokens}, routed experts ({rows:,}, {layers}, {top_k}) of {num} experts"


def make_sample(rng: np.random.Generator, case: Case) -> Sample:
    """A sample shaped like what the gateway stores: model spans, and environment spans (mask 0, logprob 0,
    version -1) for a tool result and a user turn."""
    p, r = case.prompt_tokens, case.response_tokens
    mask = np.ones(r, U8)
    for start in (r // 3, 2 * r // 3):
        mask[start : start + r // 12] = 0
    model = mask.astype(bool)
    experts = None
    if case.experts is not None:
        layers, top_k, num = case.experts
        experts = rng.integers(0, num, (p + r - 1, layers, top_k), dtype=np.uint8)
    return Sample(
        prompt_ids=rng.integers(0, VOCAB, p).astype(I32),
        response_ids=rng.integers(0, VOCAB, r).astype(I32),
        loss_mask=mask,
        logprobs=np.where(model, -rng.exponential(0.7, r), 0.0).astype(F32),
        versions=np.where(model, 7, ENV_VERSION).astype(I32),
        routed_experts=experts,
        num_turns=3,
    )


# -- encodings --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Codec:
    """How a sample becomes the fields of its Redis hash, and back."""

    name: str
    encode: Callable[[Sample], Fields]
    decode: Callable[[Mapping[bytes, bytes]], Sample]


def _document(sample: Sample, as_list: Callable[[npt.NDArray[Any]], Any]) -> dict[str, Any]:
    experts = sample.routed_experts
    return {
        "prompt_ids": as_list(sample.prompt_ids),
        "response_ids": as_list(sample.response_ids),
        "loss_mask": as_list(sample.loss_mask),
        "logprobs": as_list(sample.logprobs),
        "versions": as_list(sample.versions),
        "routed_experts": None if experts is None else as_list(experts),
        "num_turns": sample.num_turns,
        "cancelled": sample.cancelled,
    }


def _from_document(doc: dict[str, Any]) -> Sample:
    # The dtypes the binary encoding carries; the JSON reader has to know them (a JSON number has none).
    experts = doc["routed_experts"]
    return Sample(
        prompt_ids=np.asarray(doc["prompt_ids"], I32),
        response_ids=np.asarray(doc["response_ids"], I32),
        loss_mask=np.asarray(doc["loss_mask"], U8),
        logprobs=np.asarray(doc["logprobs"], F32),
        versions=np.asarray(doc["versions"], I32),
        routed_experts=None if experts is None else np.asarray(experts, U8),
        num_turns=doc["num_turns"],
        cancelled=doc["cancelled"],
    )


def _orjson_encode(sample: Sample) -> Fields:
    return {"json": orjson.dumps(_document(sample, lambda a: a), option=orjson.OPT_SERIALIZE_NUMPY)}


def _orjson_decode(raw: Mapping[bytes, bytes]) -> Sample:
    return _from_document(orjson.loads(raw[b"json"]))


def _stdlib_encode(sample: Sample) -> Fields:
    return {"json": json.dumps(_document(sample, lambda a: a.tolist()), separators=(",", ":")).encode()}


def _stdlib_decode(raw: Mapping[bytes, bytes]) -> Sample:
    return _from_document(json.loads(raw[b"json"]))


BINARY = Codec("binary", Sample.to_redis, Sample.from_redis)
BASELINES = {
    "orjson": Codec("orjson", _orjson_encode, _orjson_decode),
    "json": Codec("json", _stdlib_encode, _stdlib_decode),
}


def payload_bytes(fields: Fields) -> int:
    """Field names + values as they go over the wire (redis-py sends ints and strings as their text)."""
    return sum(len(k.encode()) + len(v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items())


@dataclass(frozen=True, slots=True)
class Variant:
    key: str
    label: str
    codec: Codec
    store: bool  # through TrajectoryStore + TrajectoryConsumer; else the bare pipeline


def variants_for(baselines: Sequence[str]) -> list[Variant]:
    out = [Variant("store", "store · binary", BINARY, True), Variant("bare-binary", "bare · binary", BINARY, False)]
    return out + [Variant(f"json-{b}", f"bare · JSON {b}", BASELINES[b], False) for b in baselines]


# -- measurement ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    client_cpu_s: float
    redis_cpu_s: float
    commands: int


async def begin(client: aioredis.Redis) -> Snapshot:
    """A phase's start: Redis counters first, then the clocks (the INFO round trip is not part of the phase)."""
    info = await client.info()
    return _snapshot(info, time.perf_counter(), time.process_time())


async def end(client: aioredis.Redis) -> Snapshot:
    at, cpu = time.perf_counter(), time.process_time()
    return _snapshot(await client.info(), at, cpu)


def _snapshot(info: Mapping[str, Any], at: float, cpu: float) -> Snapshot:
    redis_cpu = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return Snapshot(at, cpu, redis_cpu, int(info["total_commands_processed"]))


@dataclass(slots=True)
class Tally:
    """One variant's measurements, summed over its rounds."""

    trajectories: int = 0
    write_s: float = 0.0
    consume_s: float = 0.0
    payload_bytes: int = 0
    session_memory_bytes: int = 0
    stream_memory_bytes: int = 0
    commands: int = 0
    client_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0
    verified: int = 0
    problems: list[str] = field(default_factory=list)

    def add_phase(self, start: Snapshot, stop: Snapshot) -> None:
        self.client_cpu_s += stop.client_cpu_s - start.client_cpu_s
        self.redis_cpu_s += stop.redis_cpu_s - start.redis_cpu_s
        self.commands += stop.commands - start.commands - 1  # the starting INFO itself is counted

    def merge(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(slots=True)
class Bench:
    client: aioredis.Redis
    store: TrajectoryStore
    url: str
    writers: int
    batch: int
    bare_keys: Keys = field(default_factory=lambda: Keys("bare:"))

    def keys(self, variant: Variant) -> Keys:
        return self.store.keys if variant.store else self.bare_keys

    def session_keys(self, variant: Variant, session_id: str) -> list[str]:
        keys = self.keys(variant)
        sample = keys.sample(session_id, 0)
        return [keys.meta(session_id), sample] if variant.store else [sample]


Consumed = list[tuple[int, list[Sample]]]  # (trajectory index, its samples) in the order consumed


# -- writing ----------------------------------------------------------------------------------------------------


async def write_one(bench: Bench, variant: Variant, sample: Sample, i: int) -> str:
    if variant.store:
        meta = await bench.store.create_session({"i": i})
        await bench.store.save_sample(meta.id, 0, sample)
        await bench.store.finish(meta.id, reward=1.0)
        return meta.id
    session_id = f"t{i}"
    key = bench.bare_keys.sample(session_id, 0)
    fields = variant.codec.encode(sample)  # inside the timed phase: encoding is part of the write's cost
    async with bench.client.pipeline(transaction=False) as pipe:
        pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
        pipe.expire(key, WRITE_TTL_S)
        entry = {"session_id": session_id, "i": i, "reward": "1.0", "samples": 1}
        pipe.xadd(bench.bare_keys.trajectories, entry)  # type: ignore[arg-type]
        await pipe.execute()
    return session_id


async def write_all(bench: Bench, variant: Variant, pool: Sequence[Sample], indices: range) -> list[str]:
    """Write trajectories `indices` with `bench.writers` concurrent tasks; their session ids."""
    ids: dict[int, str] = {}
    todo = iter(indices)  # shared: each task takes the next index (one event loop, so no two take the same)

    async def writer() -> None:
        for i in todo:
            ids[i] = await write_one(bench, variant, pool[i % len(pool)], i)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(bench.writers, len(indices))):
            group.create_task(writer())
    return [ids[i] for i in indices]


async def measure_memory(bench: Bench, variant: Variant, session_ids: Sequence[str]) -> tuple[int, int]:
    """(MEMORY USAGE summed over the sessions' keys, MEMORY USAGE of the stream), every field counted."""
    names = [key for session_id in session_ids for key in bench.session_keys(variant, session_id)]
    async with bench.client.pipeline(transaction=False) as pipe:
        for name in [*names, bench.keys(variant).trajectories]:
            pipe.memory_usage(name, samples=0)
        usage = await pipe.execute()
    if any(u is None for u in usage):
        raise BenchmarkError(f"{variant.label}: a key written this round is missing")
    return sum(usage[:-1]), usage[-1]


# -- consuming --------------------------------------------------------------------------------------------------


async def consume_store(source: TrajectoryConsumer, n: int, batch_size: int, out: Consumed) -> None:
    while len(out) < n:
        batch = await source.next_batch(min(batch_size, n - len(out)), timeout=READ_TIMEOUT_S)
        dropped = batch.dropped_duplicate + batch.dropped_unreadable + batch.dropped_stale + batch.dropped_incomplete
        if not batch or dropped:
            raise BenchmarkError(f"store consumer: {batch!r} after {len(out)} of {n} trajectories")
        out.extend((int(t.meta.metadata["i"]), t.samples) for t in batch.trajectories)
        await source.ack(batch)


async def consume_bare(bench: Bench, codec: Codec, n: int, out: Consumed) -> None:
    keys = bench.bare_keys
    while len(out) < n:
        count = min(bench.batch, n - len(out))
        reply = await bench.client.xreadgroup(
            GROUP, CONSUMER, {keys.trajectories: ">"}, count=count, block=int(READ_TIMEOUT_S * 1000)
        )
        entries = [entry for _, stream_entries in reply or () for entry in stream_entries]
        if not entries:
            raise BenchmarkError(f"bare consumer ({codec.name}): nothing to read after {len(out)} of {n}")
        sample_keys = [keys.sample(fields[b"session_id"].decode(), 0) for _, fields in entries]
        async with bench.client.pipeline(transaction=False) as pipe:
            for key in sample_keys:
                pipe.hgetall(key)
            raws = await pipe.execute()
        out.extend((int(fields[b"i"]), [codec.decode(raw)]) for (_, fields), raw in zip(entries, raws, strict=True))
        ids = [entry_id for entry_id, _ in entries]
        async with bench.client.pipeline(transaction=False) as pipe:
            pipe.xack(keys.trajectories, GROUP, *ids)
            pipe.xdel(keys.trajectories, *ids)
            for key in sample_keys:
                pipe.pexpire(key, int(ACK_TTL_S * 1000))
            await pipe.execute()


# -- checking ---------------------------------------------------------------------------------------------------


def differences(got: Sample, want: Sample) -> list[str]:
    """Names of the fields of `got` that differ from `want` in dtype, shape or any value."""
    names = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "routed_experts")
    bad = []
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if (a is None) != (b is None) or (a is not None and (a.dtype != b.dtype or not np.array_equal(a, b))):
            bad.append(name)
    if (got.num_turns, got.cancelled) != (want.num_turns, want.cancelled):
        bad.append("num_turns/cancelled")
    return bad


def verify(consumed: Consumed, pool: Sequence[Sample], indices: range) -> tuple[int, list[str]]:
    """(trajectories consumed once with every array equal to what was written, what went wrong)."""
    counts = Counter(i for i, _ in consumed)
    problems = [f"trajectory {i} consumed {c} times" for i, c in counts.items() if c != 1]
    problems += [f"trajectory {i} never consumed" for i in indices if i not in counts]
    verified = 0
    for i, samples in consumed:
        bad = ["sample count"] if len(samples) != 1 else differences(samples[0], pool[i % len(pool)])
        if bad:
            problems.append(f"trajectory {i}: {', '.join(bad)} differ")
        elif counts[i] == 1 and i in indices:
            verified += 1
    return verified, problems


# -- rounds -----------------------------------------------------------------------------------------------------


async def run_round(bench: Bench, variant: Variant, pool: Sequence[Sample], indices: range) -> Tally:
    """FLUSHALL, write `indices` (timed), measure memory, consume them (timed), verify."""
    client = bench.client
    await client.flushall()
    tally = Tally(trajectories=len(indices))
    start = await begin(client)
    session_ids = await write_all(bench, variant, pool, indices)
    stop = await end(client)
    tally.write_s = stop.at - start.at
    tally.add_phase(start, stop)
    tally.session_memory_bytes, tally.stream_memory_bytes = await measure_memory(bench, variant, session_ids)
    consumed: Consumed = []
    if variant.store:
        async with TrajectoryConsumer(
            bench.url, GROUP, CONSUMER, ack_ttl_s=ACK_TTL_S, socket_timeout_s=SOCKET_TIMEOUT_S
        ) as source:
            start = await begin(client)
            await consume_store(source, len(indices), bench.batch, consumed)
            stop = await end(client)
    else:
        await client.xgroup_create(bench.bare_keys.trajectories, GROUP, id="0", mkstream=True)
        start = await begin(client)
        await consume_bare(bench, variant.codec, len(indices), consumed)
        stop = await end(client)
    tally.consume_s = stop.at - start.at
    tally.add_phase(start, stop)
    tally.verified, tally.problems = verify(consumed, pool, indices)
    return tally


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


async def run_case(
    bench: Bench, case: Case, variants: Sequence[Variant], rounds: int, seed: int, progress: Console
) -> dict[str, Tally]:
    rng = np.random.default_rng(seed)
    pool = [make_sample(rng, case) for _ in range(min(POOL_SIZE, case.count))]
    sizes = {v.key: [payload_bytes(v.codec.encode(s)) for s in pool] for v in variants}
    for variant in variants:  # untimed: Lua scripts loaded, connections open, consumer code paths warm
        warm = await run_round(bench, variant, pool, range(min(WARMUP_TRAJECTORIES, case.count)))
        if warm.problems:
            raise BenchmarkError(f"{case.name} / {variant.label} warm-up: {warm.problems[0]}")
    totals = {v.key: Tally() for v in variants}
    first = 0
    for r, n in enumerate(split(case.count, min(rounds, case.count))):
        indices = range(first, first + n)
        for variant in variants if r % 2 == 0 else variants[::-1]:
            tally = await run_round(bench, variant, pool, indices)
            tally.payload_bytes = sum(sizes[variant.key][i % len(pool)] for i in indices)
            totals[variant.key].merge(tally)
            progress.log(
                f"{case.name} round {r + 1} {variant.label}: write {n / tally.write_s:,.0f}/s, "
                f"consume {n / tally.consume_s:,.0f}/s, verified {tally.verified}/{n}"
            )
        first += n
    return totals


# -- report -----------------------------------------------------------------------------------------------------


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("nan")


@dataclass(frozen=True, slots=True)
class Metric:
    label: str
    value: Callable[[Tally], float]
    fmt: str


METRICS = (
    Metric("write, trajectories/s", lambda t: _rate(t.trajectories, t.write_s), "{:,.0f}"),
    Metric("consume (read + decode + ack), trajectories/s", lambda t: _rate(t.trajectories, t.consume_s), "{:,.0f}"),
    Metric(
        "end-to-end (write + consume), trajectories/s",
        lambda t: _rate(t.trajectories, t.write_s + t.consume_s),
        "{:,.0f}",
    ),
    Metric("sample payload sent, KiB / trajectory", lambda t: t.payload_bytes / t.trajectories / 1024, "{:,.1f}"),
    Metric(
        "MEMORY USAGE of session keys, KiB / trajectory",
        lambda t: t.session_memory_bytes / t.trajectories / 1024,
        "{:,.1f}",
    ),
    Metric("MEMORY USAGE of the stream, B / entry", lambda t: t.stream_memory_bytes / t.trajectories, "{:,.0f}"),
    Metric("Redis commands / trajectory", lambda t: t.commands / t.trajectories, "{:,.1f}"),
    Metric("this process CPU, ms / trajectory", lambda t: 1000 * t.client_cpu_s / t.trajectories, "{:,.2f}"),
    Metric("redis-server CPU, ms / trajectory", lambda t: 1000 * t.redis_cpu_s / t.trajectories, "{:,.2f}"),
)


def ratio(a: float, b: float) -> str:
    if not b or a != a or b != b:
        return "—"
    r = a / b
    return f"{r:.3f}×" if r < 0.1 else f"{r:.2f}×"


def case_rows(totals: Mapping[str, Tally], variants: Sequence[Variant], baselines: Sequence[str]) -> list[list[str]]:
    pairs = [(binary, f"json-{b}") for b in baselines for binary in ("store", "bare-binary")]
    rows = []
    for metric in METRICS:
        values = {key: metric.value(tally) for key, tally in totals.items()}
        cells = [metric.fmt.format(values[v.key]) for v in variants]
        rows.append([metric.label, *cells, *(ratio(values[a], values[b]) for a, b in pairs)])
    verified = [f"{totals[v.key].verified:,}/{totals[v.key].trajectories:,}" for v in variants]
    rows.append(["verified (each once, arrays equal)", *verified, *([""] * len(pairs))])
    return rows


def report(console: Console, options: Options, server: str, results: Mapping[str, dict[str, Tally]]) -> None:
    variants = variants_for(options.baselines)
    ratios = [f"{binary} ÷ {b}" for b in options.baselines for binary in ("store", "bare bin")]
    note = (
        "each column is one variant over the same trajectories, run in alternating order in this one run; a ratio "
        "column divides a binary variant's number by a JSON baseline's: above 1 for trajectories/s means binary is "
        "faster, below 1 for KiB, commands and CPU means binary is smaller or cheaper. 'store' also pays the session "
        "lifecycle the bare pipelines skip (see its commands per trajectory), so 'store ÷ JSON' is what the gateway "
        "gains and 'bare bin ÷ JSON' what the encoding alone gains. End-to-end is n / (write s + consume s). The "
        "stream row is coarse (its listpack nodes' slack, split over few entries; the store's entries carry a "
        "32-character session id, the bare ones a short one). Absolute rates depend on the machine and its load: "
        "compare the ratios."
    )
    for case in options.cases:
        title = (
            f"Store throughput — {case.label}; {case.count:,} trajectories per variant in "
            f"{min(options.rounds, case.count)} rounds, {options.writers} writers, consumer batches of "
            f"{options.batch}; {server}; {machine_line()}"
        )
        rows = case_rows(results[case.name], variants, options.baselines)
        print_table(console, title, ["", *(v.label for v in variants), *ratios], rows, note)


# -- driver -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    cases: tuple[Case, ...]
    baselines: tuple[str, ...]
    writers: int
    batch: int
    rounds: int
    aof: bool
    seed: int
    timeout_s: float
    json_path: str | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.store_throughput",
        description="Trajectories/s and bytes in Redis: binary sample encoding vs JSON lists, side by side.",
    )
    p.add_argument("--cases", default="plain,experts", help="comma-separated: plain,experts")
    p.add_argument("--count", type=int, default=None, help="trajectories per variant, plain (default 500; quick 100)")
    p.add_argument(
        "--count-experts", type=int, default=None, help="trajectories per variant with experts (default 100; quick 20)"
    )
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--response-tokens", type=int, default=1536)
    p.add_argument("--layers", type=int, default=48, help="MoE layers of the routed experts")
    p.add_argument("--top-k", type=int, default=8, help="experts per token and layer")
    p.add_argument("--num-experts", type=int, default=128, help="experts per layer (ids below it; at most 256)")
    p.add_argument("--baselines", default="orjson,json", help="JSON libraries to compare: orjson,json")
    p.add_argument("--writers", type=int, default=8, help="concurrent writer tasks")
    p.add_argument("--batch", type=int, default=16, help="trajectories per consumer read")
    p.add_argument("--rounds", type=int, default=2, help="rounds per variant, order alternating (the count is split)")
    p.add_argument("--no-aof", action="store_true", help="run Redis without its append-only file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole run, s (default 600; quick 120)")
    p.add_argument("--quick", action="store_true", help="100 plain + 20 with experts per variant (~20 s)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the totals to this JSON file")
    return p


def options_from(args: argparse.Namespace) -> Options:
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if not names or any(c not in ("plain", "experts") for c in names):
        raise SystemExit(f"--cases takes plain and/or experts, got {args.cases!r}")
    if any(b not in BASELINES for b in baselines):
        raise SystemExit(f"--baselines takes {', '.join(BASELINES)}, got {args.baselines!r}")
    count = args.count or (100 if args.quick else 500)
    count_experts = args.count_experts or (20 if args.quick else 100)
    sizes = (count, count_experts, args.prompt_tokens, args.response_tokens, args.layers, args.top_k)
    if min(*sizes, args.writers, args.batch, args.rounds) < 1 or not 1 <= args.num_experts <= 256:
        raise SystemExit(
            "counts, token counts, --layers, --top-k, --writers, --batch and --rounds must be ≥ 1; "
            "--num-experts in 1..256 (uint8 ids)"
        )
    experts = (args.layers, args.top_k, args.num_experts)
    cases = {
        "plain": Case("plain", count, args.prompt_tokens, args.response_tokens, None),
        "experts": Case("experts", count_experts, args.prompt_tokens, args.response_tokens, experts),
    }
    return Options(
        cases=tuple(cases[name] for name in dict.fromkeys(names)),
        baselines=tuple(dict.fromkeys(baselines)),
        writers=args.writers,
        batch=args.batch,
        rounds=args.rounds,
        aof=not args.no_aof,
        seed=args.seed,
        timeout_s=args.timeout or (120.0 if args.quick else 600.0),
        json_path=args.json_path,
    )


async def main_async(options: Options, progress: Console) -> tuple[str, dict[str, dict[str, Tally]]]:
    # No AOF rewrite during the run: its fork and disk writes would land in whichever phase happened to be timed.
    config = {"auto-aof-rewrite-percentage": "0"} | ({} if options.aof else {"appendonly": "no"})
    results: dict[str, dict[str, Tally]] = {}
    async with asyncio.timeout(options.timeout_s), EmbeddedRedis(extra_config=config) as server:
        client = connect(server.url, socket_timeout_s=SOCKET_TIMEOUT_S)
        store = TrajectoryStore(client, Keys(), sweep_interval_s=None)
        try:
            info = await client.info()
            aof = "AOF everysec" if options.aof else "no AOF"
            described = f"redis {info['redis_version']} ({info['mem_allocator']}, {aof})"
            bench = Bench(client, store, server.url, options.writers, options.batch)
            variants = variants_for(options.baselines)
            for case in options.cases:
                progress.log(f"{case.name}: {case.label}")
                results[case.name] = await run_case(bench, case, variants, options.rounds, options.seed, progress)
        finally:
            await store.aclose()
            await client.aclose()
    return described, results


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    progress = Console(stderr=True, log_path=False, width=None if sys.stderr.isatty() else 160)
    try:
        server, results = uvloop.run(main_async(options, progress))
    except TimeoutError:
        progress.print(f"[red]stopped: the run passed its deadline of {options.timeout_s:g} s (--timeout)[/]")
        return 1
    except BenchmarkError as exc:
        progress.print(f"[red]{exc}[/]")
        return 1
    console = make_console()
    report(console, options, server, results)
    failed = False
    for case, totals in results.items():
        for key, tally in totals.items():
            for problem in tally.problems[:5]:
                console.print(f"[red]{case} / {key}: {problem}[/]")
            failed |= bool(tally.problems) or tally.verified != tally.trajectories
    if options.json_path:
        with open(options.json_path, "w") as f:
            json.dump(
                {case: {k: dataclasses.asdict(t) for k, t in totals.items()} for case, totals in results.items()},
                f,
                indent=2,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
