"""The numbers to size a fleet (issue 37 §4): many agents' chat sessions through N gateway processes on one Redis (or
a Redis Cluster), many simulator replicas, weight updates every few seconds; side by side for 1, 2 and 4 gateways.

    python -m benchmarks.fleet                                  # 64 replicas, 1,000 sessions, gateways 1 2 4
    python -m benchmarks.fleet --redis cluster --masters 1 3    # the same on a local Redis Cluster (3 + 3 nodes)
    python -m benchmarks.fleet --quick                          # a small run (about a minute)

What runs (all on 127.0.0.1, every part a child process so the load generator never shares a loop with what it
measures):

* **replicas**: `--replicas` simulator replicas (vLLM dialect, `--token-delay` a decode step, EOS off), served
  `--per-host` to a process (`benchmarks.sim_fleet`: one event loop holds many light replicas);
* **Redis**, given to everyone by URL: one `EmbeddedRedis` (the default, over TCP as a fleet reaches it), or with
  `--redis cluster` a `LocalRedisCluster` of M masters and one replica each, per `--masters` count;
* **gateways**: max(`--gateways`) `rollout-gateway serve` processes, each on its own port, all on that Redis and all
  the replicas; a row with N gateways sends its agents to the first N (the others idle, as spares behind a load
  balancer would; they still follow every weight update);
* **agents**: `--sessions` concurrent chat sessions (`benchmarks.loadgen`, `/v1/chat/completions`, each turn the
  conversation so far, the previous reply and 32 more words; 16-32-token replies, not streamed), each session pinned
  to a gateway by a hash of its id (a load balancer with session affinity), for `--duration` seconds;
* **weight updates**: every `--update-every` seconds of a timed run, `POST /admin/weights {mode: abort}` to one of the
  row's gateways in turn; the gateways coordinate it (lock and bus in Redis), abort what the replicas run, and
  resume it on the new weights.

Measured per row (the timed part only): turns/s and turn latency (every turn checked; any error fails the run); CPU
per turn of the gateways, of Redis (all nodes, and the busiest master's), of the replicas; the gateways' RSS growth
per 1,000 sessions opened in the run (left open: the agents never finish them); resume dispatch, the gateways'
histogram `rollout_gateway_resume_dispatch_seconds` (release of the requests an update held → continuation sent),
its delta over the run, summed over the gateways, with p50/p99 interpolated in its buckets and the update's own
duration. From them, as `benchmarks.scaling` does on a small machine, **projected turns/s on N dedicated cores** =
N × 1 / (gateway CPU per turn per process), capped by the Redis bound (1 / the busiest master's CPU per turn):
where the gateways, replicas, Redis and load generator share two cores, measured turns/s cannot grow with N.

Then, on the same Redis, the trainer's side: `--trajectories` finished trajectories of `--trajectory-tokens` tokens
(half prompt, half response, a tenth of the response environment tokens) written through the gateway's
`TrajectoryStore` without routed experts and with them (`--expert-layers` × `--top-k`, one byte an expert id), then
read and acknowledged by a `TrajectoryConsumer` in batches of `--batch`. Redis bytes per 1,000 trajectories = the
masters' `used_memory` growth (INFO memory) over the writes, and `MEMORY USAGE` of one session's keys × 1,000;
trajectories/s into the trainer = those read and acknowledged ÷ the time it took.

Compare figures within one run: absolute ones move with the host (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import orjson
import redis
from rich.console import Console

from benchmarks._harness import (
    ADMIN_HEADERS,
    BenchmarkError,
    GatewayProcess,
    Percentiles,
    cpu_seconds,
    machine_line,
    ms,
    print_table,
    run_benchmark,
    sim_replica_entry,
)
from benchmarks.compare import GATEWAY_SETTINGS, REPLICA_ARGS, Workload, _stdin, _stdout, loadgen_process, split
from benchmarks.episode_writes import episode
from benchmarks.resume_latency import DISPATCH_METRIC, Histogram
from benchmarks.sim_fleet import SimFleet
from gateway.embedded_redis import EmbeddedRedis
from gateway.store import Keys, TrajectoryStore
from gateway.store.keys import connect
from gateway.trainer import TrajectoryConsumer
from rollout_cli.redis_cluster import LocalRedisCluster

API = "chat"  # the agents' protocol (benchmarks.agent_protocols)
CHECKPOINT = "fleet-ckpt"  # the simulator loads any path: the weights' identity becomes `fleet-ckpt-<version>`
WRITE_CONCURRENCY = 32  # trajectories written at once in the store phase (a gateway's finishing sessions)


@dataclass(frozen=True)
class Options:
    gateways: tuple[int, ...] = (1, 2, 4)
    replicas: int = 64
    per_host: int = 16
    sessions: int = 1000
    turns: int = 40  # per session at most; `duration_s` ends a run first at this scale
    duration_s: float = 30.0
    update_every_s: float = 10.0
    token_delay_s: float = 0.01
    stream: bool = False
    redis: str = "single"  # or "cluster"
    masters: tuple[int, ...] = (3,)  # cluster: one setup per master count
    trajectories: int = 1000
    trajectory_tokens: int = 2048
    expert_layers: int = 48
    top_k: int = 8
    batch: int = 64
    timeout_s: float = 900.0
    json_path: Path | None = None

    @property
    def setups(self) -> list[tuple[str, int]]:
        """(redis kind, masters) of each Redis the run sets up in turn."""
        return [("single", 1)] if self.redis == "single" else [("cluster", m) for m in self.masters]


# -- Redis under test ---------------------------------------------------------------------------------------------


@dataclass
class RedisSetup:
    """The Redis everyone is given: its URL (gateways, store, trainer) and the nodes to read CPU and memory from."""

    label: str
    url: str
    nodes: list[EmbeddedRedis]
    cluster: LocalRedisCluster | None = None

    def masters(self) -> list[EmbeddedRedis]:
        return self.cluster.masters() if self.cluster is not None else self.nodes

    def cpu(self) -> dict[int, float]:
        """CPU seconds of each master, by port."""
        return {node.port: cpu_seconds(node.pid) or 0.0 for node in self.masters()}

    def used_memory(self) -> tuple[int, int]:
        """Bytes the masters hold: INFO memory's `used_memory` and `used_memory_dataset` (less Redis's overhead:
        client buffers, the replication backlog, the AOF buffer), each summed over the masters."""
        used = dataset = 0
        for node in self.masters():
            with redis.Redis(host="127.0.0.1", port=node.port, password=node.password) as client:
                memory = client.info("memory")
            used, dataset = used + int(memory["used_memory"]), dataset + int(memory["used_memory_dataset"])
        return used, dataset


@contextlib.contextmanager
def redis_setup(kind: str, masters: int) -> Iterator[RedisSetup]:
    if kind == "single":
        with EmbeddedRedis() as server:
            yield RedisSetup("1 Redis", server.url, [server])
        return
    with LocalRedisCluster(masters=masters, replicas_per_master=1) as cluster:
        yield RedisSetup(f"cluster, {masters} master{'s' * (masters > 1)}", cluster.url, cluster.nodes, cluster)


# -- one timed row ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One timed run: `gateways` gateways on one Redis setup."""

    setup: str
    gateways: int
    sessions: int
    ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = math.nan
    latencies: list[float] = field(default_factory=list)
    cpu_gateways_s: float = 0.0
    cpu_busiest_gateway_s: float = 0.0
    cpu_redis_s: float = 0.0
    cpu_busiest_master_s: float = 0.0
    cpu_replicas_s: float = 0.0
    cpu_loadgen_s: float = 0.0
    rss_before_mib: list[float] = field(default_factory=list)
    rss_after_mib: list[float] = field(default_factory=list)
    updates: int = 0  # that succeeded
    failed_updates: int = 0  # answered other than 200 with every replica updated (counted in `errors`)
    update_s: list[float] = field(default_factory=list)  # each update's own duration (the gateway's report)
    dispatch_buckets: list[tuple[float, float]] = field(default_factory=list)  # cumulative, over the run

    @property
    def dispatch(self) -> Histogram | None:
        if not self.dispatch_buckets:
            return None
        return Histogram(self.dispatch_buckets, self.dispatch_buckets[-1][1])


def rss_mib(pid: int | None) -> float:
    """Resident set size of a live process, MiB (NaN where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


async def dispatch_histogram(client: httpx.AsyncClient, gateways: Sequence[GatewayProcess]) -> dict[float, float]:
    """The resume-dispatch histogram of every gateway, summed: cumulative count per upper bound."""
    total: dict[float, float] = {}
    for gateway in gateways:
        response = await client.get(f"{gateway.url}/metrics")
        response.raise_for_status()
        histogram = Histogram.scrape(response.text, DISPATCH_METRIC)
        for le, count in histogram.buckets if histogram is not None else []:
            total[le] = total.get(le, 0.0) + count
    return total


class Updater:
    """Posts a weight update (`mode: abort`) every `every_s` seconds to the row's gateways in turn, until stopped."""

    def __init__(self, client: httpx.AsyncClient, urls: Sequence[str], every_s: float, versions: Iterator[int]):
        self.client, self.urls, self.every_s, self.versions = client, list(urls), every_s, versions
        self.durations: list[float] = []
        self.failures: list[str] = []
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        for index in itertools.count():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.every_s)
            if self.stopping.is_set():
                return
            version = next(self.versions)
            body = {"version": version, "path": f"{CHECKPOINT}-{version}", "mode": "abort"}
            url = self.urls[index % len(self.urls)]
            response = await self.client.post(f"{url}/admin/weights", json=body, headers=ADMIN_HEADERS)
            report = response.json() if response.headers.get("content-type") == "application/json" else {}
            if response.status_code != 200 or report.get("stale") or not report.get("updated"):
                # Counted as the row's error (the run fails), and the run goes on: its other figures still print.
                errors = report.get("errors") or response.text
                self.failures.append(f"weight update {version} via {url}: HTTP {response.status_code}: {errors}")
                continue
            self.durations.append(float(report["duration_s"]))


def workload(options: Options, sessions: int) -> Workload:
    return Workload(
        "fleet",
        sessions=sessions,
        turns=options.turns,
        requests=0,
        min_tokens=16,
        max_tokens=32,
        stream=options.stream,
        duration_s=options.duration_s,
        grow=True,
        echo=True,
        prompt_words=64,
    )


async def run_row(
    options: Options,
    setup: RedisSetup,
    gateways: Sequence[GatewayProcess],
    fleet: SimFleet,
    tag: int,
    versions: Iterator[int],
) -> Row:
    """One timed run on `gateways`: the load generator warms up (one turn per agent, on sessions of its own), then
    the timed part runs with weight updates; every process's CPU, RSS and the dispatch histogram are read around it."""
    row = Row(setup.label, len(gateways), options.sessions)
    urls = [gateway.url for gateway in gateways]
    [spec] = [part.spec(urls, tag, options.timeout_s, API) for part in split(workload(options, options.sessions), 1)]
    async with httpx.AsyncClient(timeout=options.timeout_s) as admin, loadgen_process(None) as process:
        _stdin(process).write(orjson.dumps(spec) + b"\n")
        await _stdin(process).drain()
        warm = orjson.loads(await asyncio.wait_for(_stdout(process).readline(), options.timeout_s))
        if warm.get("errors"):
            row.errors += warm["errors"]
            row.error_samples += ["warm-up: " + message for message in warm["error_samples"]]
        pids = [gateway.pid for gateway in gateways]
        dispatch0 = await dispatch_histogram(admin, gateways)
        row.rss_before_mib = [rss_mib(pid) for pid in pids]
        gateway_cpu0, redis_cpu0 = [cpu_seconds(pid) or 0.0 for pid in pids], setup.cpu()
        replicas_cpu0 = sum(cpu_seconds(pid) or 0.0 for pid in fleet.pids)
        updater = Updater(admin, urls, options.update_every_s, versions)
        _stdin(process).write(b"go\n")
        await _stdin(process).drain()
        updating = asyncio.create_task(updater.run())
        line = await asyncio.wait_for(_stdout(process).readline(), options.timeout_s + 30)
        updater.stopping.set()
        await updating  # an update under way ends first (its failure is the run's)
        gateway_cpu = [(cpu_seconds(pid) or 0.0) - before for pid, before in zip(pids, gateway_cpu0, strict=True)]
        redis_cpu = {port: cpu - redis_cpu0.get(port, 0.0) for port, cpu in setup.cpu().items()}
        row.cpu_replicas_s = sum(cpu_seconds(pid) or 0.0 for pid in fleet.pids) - replicas_cpu0
        row.rss_after_mib = [rss_mib(pid) for pid in pids]
        dispatch1 = await dispatch_histogram(admin, gateways)
        await asyncio.wait_for(process.wait(), 30)
    if not line:
        raise BenchmarkError("the load generator stopped without a result")
    result = orjson.loads(line)
    row.ok, row.errors = result["ok"], row.errors + result["errors"]
    row.error_samples = (row.error_samples + result["error_samples"])[:5]
    row.wall_s, row.latencies, row.cpu_loadgen_s = result["wall_s"], result["latencies"], result["cpu_loadgen_s"]
    row.cpu_gateways_s, row.cpu_busiest_gateway_s = sum(gateway_cpu), max(gateway_cpu)
    row.cpu_redis_s, row.cpu_busiest_master_s = sum(redis_cpu.values()), max(redis_cpu.values(), default=0.0)
    row.updates, row.update_s = len(updater.durations), updater.durations
    row.failed_updates = len(updater.failures)
    row.errors += len(updater.failures)
    row.error_samples = (updater.failures + row.error_samples)[:5]
    row.dispatch_buckets = sorted((le, count - dispatch0.get(le, 0.0)) for le, count in dispatch1.items())
    return row


# -- the trainer's side: bytes per trajectory, trajectories/s ------------------------------------------------------


@dataclass
class StoreRow:
    setup: str
    experts: str
    trajectories: int
    tokens: int
    used_memory_bytes: float = math.nan  # growth of the masters' used_memory over the writes, per trajectory
    dataset_bytes: float = math.nan  # the same of used_memory_dataset (used_memory less Redis's own overhead)
    key_bytes: float = math.nan  # MEMORY USAGE of one trajectory's keys
    write_s: float = math.nan
    read_s: float = math.nan
    read: int = 0
    error: str = ""


async def store_row(options: Options, setup: RedisSetup, layers: int, seed: int) -> StoreRow:
    """Write `options.trajectories` finished trajectories through `TrajectoryStore`, measure what Redis holds, then
    read and acknowledge them all with one `TrajectoryConsumer`."""
    half = options.trajectory_tokens // 2
    [sample] = episode(1, half, options.trajectory_tokens - half, layers, options.top_k, seed)
    row = StoreRow(setup.label, f"{layers} × {options.top_k}" if layers else "none", options.trajectories, half * 2)
    group = f"fleet-{seed}"
    client = connect(setup.url)
    store = TrajectoryStore(client, Keys(), max_pending=10**9, sweep_interval_s=None)
    try:
        async with TrajectoryConsumer(setup.url, group, "trainer-0", ack_ttl_s=0) as consumer:  # the group exists
            memory0 = setup.used_memory()
            started = time.perf_counter()
            ids: list[str] = []

            async def write(index: int) -> None:
                meta = await store.create_session({"task": f"fleet-{index}"})
                await store.save_sample(meta.id, 0, sample)
                await store.finish(meta.id, reward=1.0)
                ids.append(meta.id)

            for first in range(0, options.trajectories, WRITE_CONCURRENCY):
                last = min(first + WRITE_CONCURRENCY, options.trajectories)
                await asyncio.gather(*(write(i) for i in range(first, last)))
            row.write_s = time.perf_counter() - started
            await asyncio.sleep(1.0)  # Redis shrinks idle clients' query buffers in its cron (10 a second)
            memory1 = setup.used_memory()
            row.used_memory_bytes = (memory1[0] - memory0[0]) / options.trajectories
            row.dataset_bytes = (memory1[1] - memory0[1]) / options.trajectories
            keys = store.keys
            usage = [await client.memory_usage(key, samples=0) for key in (keys.meta(ids[0]), keys.sample(ids[0], 0))]
            row.key_bytes = float(sum(u or 0 for u in usage))
            started = time.perf_counter()
            while row.read < options.trajectories and time.perf_counter() - started < options.timeout_s:
                batch = await consumer.next_batch(min(options.batch, options.trajectories - row.read), timeout=5.0)
                if len(batch) == 0:
                    break
                row.read += len(batch)
                await consumer.ack(batch)
            row.read_s = time.perf_counter() - started
    finally:
        await store.aclose()
        await client.aclose()
    if row.read != options.trajectories:
        row.error = f"the trainer read {row.read} of {options.trajectories} trajectories"
    return row


# -- the whole run ------------------------------------------------------------------------------------------------


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    store: list[StoreRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def gateways_up(options: Options, setup: RedisSetup, fleet: SimFleet) -> AsyncIterator[list[GatewayProcess]]:
    """max(--gateways) gateway processes on `setup` and every replica, started one after another (each import takes
    a core for seconds), stopped on exit."""
    entries = [sim_replica_entry(url, "vllm") for url in fleet.urls]
    settings = {**GATEWAY_SETTINGS, "redis": {"url": setup.url}}
    with contextlib.ExitStack() as stack:
        gateways = []
        for _ in range(max(options.gateways)):
            gateway = GatewayProcess(entries, settings, 180.0)
            stack.callback(gateway.stop)
            gateways.append(await asyncio.to_thread(gateway.start))
        yield gateways


async def measure(options: Options, console: Console) -> Results:
    results = Results()
    sim_args = [*REPLICA_ARGS, "--token-delay", str(options.token_delay_s), "--max-model-len", "32768"]
    hosts = math.ceil(options.replicas / options.per_host)
    versions = itertools.count(1)
    tags = itertools.count(2, 2)  # the load generator takes tag + 1 for its warm-up sessions
    with SimFleet(hosts, options.per_host, sim_args) as fleet:
        fleet.urls = fleet.urls[: options.replicas]
        console.print(f"{len(fleet.urls)} replicas in {hosts} processes")
        for kind, masters in options.setups:
            with redis_setup(kind, masters) as setup:
                console.print(f"{setup.label}: {setup.url.rpartition('@')[2]}")
                with reported(f"{setup.label}, gateways", results, console):
                    await gateway_rows(options, setup, fleet, versions, tags, results, console)
                for seed, layers in enumerate(dict.fromkeys([0, options.expert_layers])):
                    with reported(f"{setup.label}, trajectories with {layers} expert layers", results, console):
                        store = await store_row(options, setup, layers, seed)
                        results.store.append(store)
                        console.print(f"  trajectories, experts {store.experts}: {store.read:,} read {store.error}")
    return results


@contextlib.contextmanager
def reported(what: str, results: Results, console: Console) -> Iterator[None]:
    """A part that does not work (the cluster, on a branch whose store cannot use one yet) is reported, and the run
    goes on with the next part."""
    try:
        yield
    except Exception as exc:
        message = f"{what}: {type(exc).__name__}: {str(exc)[:1500]}"
        results.failures.append(message)
        console.print(f"[red]{message}[/]")


async def gateway_rows(
    options: Options,
    setup: RedisSetup,
    fleet: SimFleet,
    versions: Iterator[int],
    tags: Iterator[int],
    results: Results,
    console: Console,
) -> None:
    async with gateways_up(options, setup, fleet) as gateways:
        console.print(f"  {len(gateways)} gateways up")
        for n in options.gateways:
            row = await run_row(options, setup, gateways[:n], fleet, next(tags), versions)
            results.rows.append(row)
            console.print(f"  {n} gateway(s): {row.ok:,} turns, {row.errors} errors, {row.updates} updates")


# -- report -------------------------------------------------------------------------------------------------------


def figures(row: Row) -> dict[str, float]:
    nan = math.nan
    per_turn = 1e3 / row.ok if row.ok else nan
    latency = Percentiles.of(row.latencies)
    dispatch = row.dispatch
    rss_growth = sum(after - before for before, after in zip(row.rss_before_mib, row.rss_after_mib, strict=True))
    gateway_ms = row.cpu_gateways_s * per_turn
    busiest_share = row.cpu_busiest_gateway_s / row.cpu_gateways_s if row.cpu_gateways_s else nan
    master_ms = row.cpu_busiest_master_s * per_turn
    redis_bound = 1e3 / master_ms if master_ms > 0 else math.inf
    projected = min(1e3 / (busiest_share * gateway_ms), redis_bound) if gateway_ms > 0 else nan
    return {
        "turns_s": row.ok / row.wall_s if row.wall_s > 0 else nan,
        "turns_per_session": row.ok / row.sessions,
        "p50": latency.p50,
        "p99": latency.p99,
        "gateway_ms": gateway_ms,
        "per_gateway_turns_s": 1e3 / gateway_ms if gateway_ms > 0 else nan,
        "busiest_share": busiest_share,
        "redis_ms": row.cpu_redis_s * per_turn,
        "master_ms": master_ms,
        "redis_bound": redis_bound,
        "projected": projected,
        "replicas_ms": row.cpu_replicas_s * per_turn,
        "loadgen_ms": row.cpu_loadgen_s * per_turn,
        "rss_per_1000": rss_growth / row.sessions * 1000,
        "rss_gateway": statistics.mean(row.rss_after_mib) if row.rss_after_mib else nan,
        "updates": row.updates,
        "update_p50": statistics.median(row.update_s) if row.update_s else nan,
        "dispatched_per_update": dispatch.count / row.updates if dispatch is not None and row.updates else nan,
        "dispatch_p50": dispatch.quantile(0.5) if dispatch is not None else nan,
        "dispatch_p99": dispatch.quantile(0.99) if dispatch is not None else nan,
        "dispatch_within_100ms": dispatch.share_within(0.1) if dispatch is not None else nan,
    }


def show(value: float, spec: str) -> str:
    return "—" if value != value else format(value, spec)  # NaN: nothing measured


def row_cells(row: Row, first: Row) -> dict[str, str]:
    f, base = figures(row), figures(first)
    n = row.gateways
    return {
        "turns/s here (all processes on this machine)": show(f["turns_s"], ",.0f"),
        "turns per session in the run": show(f["turns_per_session"], ",.1f"),
        "turn latency p50, ms": ms(f["p50"]),
        "turn latency p99, ms": ms(f["p99"]),
        "gateway CPU ms / turn (all gateways)": show(f["gateway_ms"], ".3f"),
        "  ÷ first row": show(f["gateway_ms"] / base["gateway_ms"], ".2f"),
        "  turns/s one gateway core holds (1 / that)": show(f["per_gateway_turns_s"], ",.0f"),
        "  busiest gateway's share (1/N even)": show(f["busiest_share"], ".0%"),
        "Redis CPU ms / turn (all masters)": show(f["redis_ms"], ".3f"),
        "  busiest master's; bound it sets, turns/s": f"{show(f['master_ms'], '.3f')}; "
        + ("—" if f["redis_bound"] == math.inf else show(f["redis_bound"], ",.0f")),
        "replicas CPU ms / turn; load generator's": f"{show(f['replicas_ms'], '.2f')}; {show(f['loadgen_ms'], '.2f')}",
        "projected turns/s, N dedicated gateway cores": show(f["projected"], ",.0f"),
        "  efficiency (÷ N × first row's per gateway)": show(
            f["projected"] / (n * base["projected"] / first.gateways), ".2f"
        ),
        "gateway RSS growth per 1,000 open sessions, MiB": show(f["rss_per_1000"], ",.1f"),
        "gateway RSS after the run (mean), MiB": show(f["rss_gateway"], ",.0f"),
        "weight updates (abort) in the run; failed": f"{row.updates}; {row.failed_updates}",
        "  update duration p50 (gateway's report), ms": ms(f["update_p50"]),
        "  continuations dispatched per update": show(f["dispatched_per_update"], ",.0f"),
        "  resume dispatch p50, ms": ms(f["dispatch_p50"]),
        "  resume dispatch p99, ms": ms(f["dispatch_p99"]),
        "  dispatched within 100 ms, %": show(f["dispatch_within_100ms"] * 100, ".1f"),
        "errors (must be 0)": str(row.errors),
    }


def report(console: Console, options: Options, results: Results) -> None:
    rows = results.rows
    if rows:
        firsts = {row.setup: row for row in reversed(rows)}  # each setup's first row
        columns = [row_cells(row, firsts[row.setup]) for row in rows]
        table = [[label, *(column[label] for column in columns)] for label in columns[0]]
        heads = [f"{row.gateways} gw · {row.setup}" for row in rows]
        title = (
            f"Fleet: {options.replicas} sim replicas ({options.per_host} a process, token delay "
            f"{options.token_delay_s * 1000:g} ms), {options.sessions:,} chat sessions for {options.duration_s:g} s, "
            f"weight update every {options.update_every_s:g} s — {machine_line()}"
        )
        note = (
            "every figure over the timed part. CPU per turn = CPU time of the row's processes ÷ ok turns. 'turns/s one "
            "gateway core holds' is what a gateway process serves when it has a core to itself; projected = 1 / "
            "(busiest gateway's share × gateway CPU per turn), capped by the busiest master's bound. RSS growth: the "
            "row's gateways' VmRSS after − before, per 1,000 sessions the row opened and left open (their length: "
            "turns per session). Resume dispatch: the gateways' histogram over the run (release → continuation sent), "
            "interpolated in its buckets."
        )
        print_table(console, title, ["", *heads], table, note)
        for row in rows:
            for sample in row.error_samples:
                console.print(f"  [red]{row.gateways} gw · {row.setup}, error:[/] {sample}")
    if results.store:
        store_table = []
        for s in results.store:
            store_table.append(
                [
                    f"{s.setup}, experts {s.experts}",
                    f"{s.tokens:,}",
                    show(s.used_memory_bytes * 1000 / 2**20, ",.1f"),
                    show(s.dataset_bytes * 1000 / 2**20, ",.1f"),
                    show(s.key_bytes * 1000 / 2**20, ",.1f"),
                    show(s.used_memory_bytes / s.tokens, ",.1f"),
                    show(s.trajectories / s.write_s, ",.0f"),
                    show(s.read / s.read_s if s.read_s > 0 else math.nan, ",.0f"),
                    s.error or "0",
                ]
            )
        print_table(
            console,
            f"Trajectories: {options.trajectories:,} finished through TrajectoryStore, read by one TrajectoryConsumer "
            f"(batches of {options.batch})",
            [
                "Redis, routed experts",
                "tokens each",
                "MiB / 1,000: used_memory Δ",
                "dataset Δ",
                "MEMORY USAGE",
                "bytes / token",
                "written / s",
                "into the trainer / s",
                "errors",
            ],
            store_table,
            "used_memory Δ: the masters' INFO memory growth over the writes, per 1,000 trajectories (all Redis holds "
            "for them, its own buffers included); dataset Δ: the growth of used_memory_dataset (used_memory less what "
            "Redis counts as overhead: client and AOF buffers, the key space's hash tables); MEMORY USAGE: one "
            "trajectory's meta and sample hashes × 1,000; bytes / token from used_memory Δ. 'written / s' is one "
            f"process writing {WRITE_CONCURRENCY} at a time (create, save, finish); 'into the trainer / s' reads and "
            "acknowledges.",
        )
    sizing(console, results)
    for failure in results.failures:
        console.print(f"[red]not measured: {failure}[/]")


def sizing(console: Console, results: Results) -> None:
    """Per Redis setup, the unit figures a fleet is sized from on paper: a gateway core's turns/s and a session's
    memory (from the setup's first row, fewest gateways), a master core's turns/s, the worst resume dispatch p99 of
    its rows, and a trajectory's bytes and trainer rate."""
    table = []
    for setup in dict.fromkeys([row.setup for row in results.rows] + [s.setup for s in results.store]):
        rows = [row for row in results.rows if row.setup == setup]
        stores = {s.experts: s for s in results.store if s.setup == setup}
        first = figures(rows[0]) if rows else {}
        p99s = [figures(row)["dispatch_p99"] for row in rows]
        plain, experts = stores.get("none"), next((s for k, s in stores.items() if k != "none"), None)
        table.append(
            [
                setup,
                show(first.get("per_gateway_turns_s", math.nan), ",.0f"),
                show(first.get("redis_bound", math.nan), ",.0f") if first.get("redis_bound") != math.inf else "—",
                show(first.get("rss_per_1000", math.nan), ",.1f"),
                ms(max((p for p in p99s if p == p), default=math.nan)),
                show(plain.used_memory_bytes * 1000 / 2**20 if plain else math.nan, ",.1f"),
                show(experts.used_memory_bytes * 1000 / 2**20 if experts else math.nan, ",.1f"),
                show(plain.read / plain.read_s if plain and plain.read_s > 0 else math.nan, ",.0f"),
            ]
        )
    if table:
        print_table(
            console,
            "Sizing figures",
            [
                "Redis",
                "turns/s a gateway core",
                "turns/s a master core",
                "gateway MiB / 1,000 open sessions",
                "resume dispatch p99, ms (worst row)",
                "Redis MiB / 1,000 trajectories",
                "… with experts",
                "trajectories/s into one trainer",
            ],
            table,
        )


def write_json(path: Path, options: Options, results: Results) -> None:
    out = {
        "machine": machine_line(),
        "options": {k: v for k, v in asdict(options).items() if k != "json_path"},
        "rows": [{**asdict(row), "figures": figures(row)} for row in results.rows],
        "store": [asdict(s) for s in results.store],
        "failures": results.failures,
    }
    path.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


async def main_async(options: Options, console: Console) -> bool:
    async with asyncio.timeout(options.timeout_s * 4):
        results = await measure(options, console)
    report(console, options, results)
    if options.json_path is not None:
        write_json(options.json_path, options, results)
    ok_rows = all(row.errors == 0 for row in results.rows)
    ok_store = all(not s.error for s in results.store)
    return ok_rows and ok_store and not results.failures and bool(results.rows)


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--gateways", type=int, nargs="+", default=list(d.gateways), help="gateway counts (1 2 4)")
    p.add_argument("--replicas", type=int, default=d.replicas, help=f"simulator replicas ({d.replicas})")
    p.add_argument("--per-host", type=int, default=d.per_host, help=f"replicas per process ({d.per_host})")
    p.add_argument("--sessions", type=int, default=d.sessions, help=f"concurrent chat sessions ({d.sessions:,})")
    p.add_argument("--turns", type=int, default=d.turns, help=f"turns per session at most ({d.turns})")
    p.add_argument("--duration", type=float, default=d.duration_s, help=f"seconds of each timed run ({d.duration_s:g})")
    p.add_argument("--update-every", type=float, default=d.update_every_s, help="seconds between weight updates")
    p.add_argument("--token-delay", type=float, default=d.token_delay_s, help="a replica's seconds per decode step")
    p.add_argument("--stream", action="store_true", help="the agents stream their replies")
    p.add_argument("--redis", choices=("single", "cluster"), default=d.redis)
    p.add_argument("--masters", type=int, nargs="+", default=list(d.masters), help="cluster: master counts (3)")
    p.add_argument("--trajectories", type=int, default=d.trajectories, help="written and read in the store part")
    p.add_argument("--trajectory-tokens", type=int, default=d.trajectory_tokens)
    p.add_argument("--expert-layers", type=int, default=d.expert_layers, help="routed experts' layers (0: none)")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--batch", type=int, default=d.batch, help="the trainer's batch size")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="bound of each timed run, s")
    p.add_argument("--quick", action="store_true", help="8 replicas, 64 sessions, 8 s runs, 100 trajectories")
    p.add_argument("--json", type=Path, default=None, help="also write every figure (and raw readings) here")
    return p


def options_from(args: argparse.Namespace) -> Options:
    options = Options(
        gateways=tuple(sorted(set(args.gateways))),
        replicas=args.replicas,
        per_host=args.per_host,
        sessions=args.sessions,
        turns=args.turns,
        duration_s=args.duration,
        update_every_s=args.update_every,
        token_delay_s=args.token_delay,
        stream=args.stream,
        redis=args.redis,
        masters=tuple(dict.fromkeys(args.masters)),
        trajectories=args.trajectories,
        trajectory_tokens=args.trajectory_tokens,
        expert_layers=args.expert_layers,
        top_k=args.top_k,
        batch=args.batch,
        timeout_s=args.timeout,
        json_path=args.json,
    )
    if args.quick:
        options = replace(
            options, replicas=8, per_host=4, sessions=64, duration_s=8.0, update_every_s=3.0, trajectories=100
        )
    counts = [*options.gateways, options.replicas, options.per_host, options.sessions, options.turns, options.batch]
    if min(counts) < 1 or min(options.masters) < 1 or options.trajectories < 1:
        raise SystemExit("counts must be ≥ 1")
    if options.duration_s <= 0 or options.update_every_s <= 0 or options.token_delay_s < 0:
        raise SystemExit("--duration and --update-every must be > 0, --token-delay ≥ 0")
    if options.trajectory_tokens < 4 or options.expert_layers < 0 or options.top_k < 1:
        raise SystemExit("--trajectory-tokens must be ≥ 4, --expert-layers ≥ 0, --top-k ≥ 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    return run_benchmark(main_async, options, options.timeout_s * 4)


if __name__ == "__main__":
    sys.exit(main())
