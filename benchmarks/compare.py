"""This gateway side by side with direct access and the two Rust routers, on the same simulator replicas, in one run.

    python -m benchmarks.compare              # the real figures (the longest run)
    python -m benchmarks.compare --quick      # a small version, for development
    python -m benchmarks.compare --targets direct gateway --workloads short-c1 multiturn --json out.json
    python -m benchmarks.compare --agents         # the agent rows: the gateway's chat/messages/responses, LiteLLM

What runs where (`--layout shared`, written for a 2-core machine; `--layout dedicated` gives each replica, each
of `--loadgens` load generators and the proxy a CPU of its own, on a machine with 6 or more; `auto`, the default,
picks `dedicated` where the CPUs hold it):

* two simulator replicas (`python -m backends.sim --dialect vllm`, the gateway's tiny tokenizer) on core 0;
* each target on core 1, alone: `direct` (no proxy: the load generator picks the replica by a hash of the
  session id), `gateway` (`rollout-gateway serve`, with its embedded redis-server child, also on core 1;
  `gateway-generate` is the same process driven through its token-in/token-out `POST /generate`),
  `sglang-manual` (sglang-router `--policy manual`: sticky on `X-SMG-Routing-Key`), `vllm-consistent_hash` and
  `vllm-sticky_least_loaded` (vllm-router, keyed on `X-Session-ID`), `python-relay` (`benchmarks/python_relay.py`:
  a pass-through relay on the gateway's own stack, uvicorn + aiohttp, the floor of that stack); optional
  `sglang-cache_aware`; the agent routes (`--agents`): `gateway-chat`, `gateway-messages`, `gateway-responses` (the
  same gateway process on `/v1/chat/completions`, Anthropic `/v1/messages`, OpenAI `/v1/responses`;
  `gateway-responses-chained`: each turn only the new message and `previous_response_id`) and
  `litellm-chat`, `litellm-messages`, `litellm-responses` (LiteLLM's proxy on the same three routes,
  `benchmarks/litellm_target.py`, from the venv `scripts/bench/litellm_setup.sh` makes; skipped with a message where
  it is absent; its chat front runs on core 0 beside the replicas). All targets are started once and stay up (idle
  ones cost nothing measurable); each fronts both replicas;
* the load generator (`python -m benchmarks.loadgen`, see there) in its own process on core 0, one per timed
  run, loopback only, bounded in requests and time (`--timeout` per run).

Workloads (`--workloads`): `short-c1` and `short-c64` (1-8 tokens, not streamed: pure proxy cost, at concurrency
1 and 64), `stream` (256 tokens streamed, no token delay: relay cost), `rl` (many concurrent sessions, one long
stream each with a per-token delay: RL-shaped), `rl-whole` (the same, not streamed: an agent loop that waits for
the whole answer), `multiturn` (sessions × turns whose prompts grow: affinity,
balance, prefix-cache hits); `agent` and `agent-stream` (`--agents`): an agent's sessions, each turn the whole
conversation so far, the previous replies included, and 32 more words (the agent routes in their protocol, the
others as one `/v1/completions` prompt), whole or streamed answers: the CPU per turn of each protocol. Each workload
runs every target `--rounds` times in ABBA order (targets forward, then backward, ...), so drift in the shared
machine's speed falls on all of them alike.

Measured per (workload, target): req/s, tokens/s, latency p50/p99 (send → last byte) and what it adds over
`direct`, time to first event (streams), the proxy's CPU (user + system time of all its threads, from its CPU
clock, read around the timed part only) per 1k requests and per 1k tokens, and the capacity it implies on one core
(1 / CPU per request); from the replicas' side: affinity (share of a session's requests that reached the
same replica as its previous one; from `/sim/prompt_log`), balance (the busiest replica's share of requests)
and the prefix-cache hit ratio (`/sim/state` counters). Every figure also shows its ratio to the best proxy.
Every request is checked (status, token count); errors are counted and shown, and make the exit status 1. After the
agent tables, the targets of the agent rows are checked and said (never asserted): each protocol's gateway route
within 1.2× of the chat route's CPU per turn, and every gateway route (its Redis included) below LiteLLM's.

This supersedes the former `benchmarks/gateway_overhead.py` (direct vs gateway on one replica): the same
comparison, with the routers beside it, a load generator in its own process and the proxy on its own core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import math
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from rich.console import Console

from backends.sim.server import SimProcess
from benchmarks._harness import (
    BenchmarkError,
    GatewayProcess,
    Percentiles,
    child_pids,
    cpu_seconds,
    free_port,
    log_tail,
    machine_line,
    pin_process,
    pinned,
    print_table,
    run_benchmark,
    sim_replica_entry,
    sim_replicas,
    terminate,
)
from benchmarks.litellm_target import LiteLLMProcess, litellm_missing
from benchmarks.loadgen import Result, session_of
from gateway.config import DEFAULT_TOKENIZER

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_LOG_HEAD = 48  # tokens of each prompt the replicas log: "bench-<tag>-<n> " after the chat template's preamble
AGENT_ROUTES = ("gateway-chat", "gateway-messages", "gateway-responses", "gateway-responses-chained")
LITELLM_ROUTES = ("litellm-chat", "litellm-messages", "litellm-responses")
ALL_TARGETS = (
    "direct",
    "gateway",
    "gateway-generate",
    *AGENT_ROUTES,
    "sglang-manual",
    "vllm-consistent_hash",
    "vllm-sticky_least_loaded",
    "sglang-cache_aware",
    "python-relay",
    *LITELLM_ROUTES,
)
DEFAULT_TARGETS = tuple(t for t in ALL_TARGETS if t not in ("sglang-cache_aware", *AGENT_ROUTES, *LITELLM_ROUTES))
AGENT_TARGETS = tuple(t for t in ALL_TARGETS if t not in ("gateway-generate", "sglang-cache_aware"))
"""`--agents`: the agent routes of the gateway and of LiteLLM beside the relays (which send `/v1/completions` turns
of the same conversations) and direct access."""
AGENT_WORKLOADS = ("agent", "agent-stream")
REPLICA_ARGS = ("--dialect", "vllm", "--token-delay", "0", "--eos-prob", "0", "--tokenizer", str(DEFAULT_TOKENIZER))
"""Each simulator replica's command line (the benchmarks set the token delay per workload, `POST /sim/speed`). EOS
is off: every answer runs to its token budget, also on the agent protocols, which have no `ignore_eos`."""
GATEWAY_SETTINGS = {"generation": {"max_connections_per_replica": 2048}, "store": {"max_pending": 10**9}}
"""Config sections of the benchmarked gateways: a connection pool per replica that never makes a request wait, and
no backpressure (no trainer consumes what a benchmark finishes: one-turn requests finish a session each)."""


# -- workloads ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: int
    turns: int  # per session (0: `requests` in all, shared by the sessions)
    requests: int
    min_tokens: int
    max_tokens: int
    stream: bool
    token_delay_s: float = 0.0
    duration_s: float = 0.0  # no new request after this long (0: only the count bounds the run)
    grow: bool = False
    prompt_words: int = 16
    one_turn: bool = False  # requests name no session (the gateway makes each a one-turn session)
    echo: bool = False  # each turn's prompt carries the previous reply (an agent's conversation)
    columns: tuple[str, ...] = ()
    what: str = ""

    def spec(self, urls: list[str], tag: int, timeout_s: float, api: str, chained: bool = False) -> dict[str, Any]:
        return {
            "api": api,
            "urls": urls,
            "tag": tag,
            "sessions": self.sessions,
            "turns": self.turns,
            "requests": self.requests,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "grow": self.grow,
            "prompt_words": self.prompt_words,
            "append_words": 32,
            "warmup": 1,
            "timeout_s": timeout_s,
            "seed": tag,
            "duration_s": self.duration_s,
            "one_turn": self.one_turn,
            "echo": self.echo and api == "completions",
            "chained": chained,
        }


def workloads(quick: bool, rl_sessions: int | None, rl_tokens: Sequence[int] | None, rl_delay: float) -> list[Workload]:
    """The six workloads and the two agent ones, at full size or (`quick`) small. Counts bound the fast targets,
    durations the slow."""
    q = quick
    rl_lo, rl_hi = rl_tokens or ((32, 128) if q else (128, 256))
    short = {"turns": 0, "min_tokens": 1, "max_tokens": 8, "stream": False, "duration_s": 3.0 if q else 6.0}
    latency_columns = ("req/s", "p50", "p99", "+p50", "+p99", "cpu/req")
    rl = Workload(
        "rl",
        sessions=rl_sessions or (32 if q else 256),
        turns=1,
        requests=0,
        min_tokens=rl_lo,
        max_tokens=rl_hi,
        stream=True,
        token_delay_s=rl_delay,
        columns=("tok/s", "x direct", "ttft50", "ttft99", "p99", "cpu/ktok", "redis/ktok", "balance", "errors"),
        what=f"RL-shaped: all sessions at once, one stream of {rl_lo}-{rl_hi} tokens each, "
        f"{rl_delay * 1000:g} ms per token",
    )
    return [
        Workload(
            "short-c1",
            sessions=1,
            requests=300 if q else 3000,
            **short,  # type: ignore[arg-type]
            columns=(*latency_columns, "cap/core", "errors"),
            what="1-8 tokens, not streamed, one agent: the latency a proxy adds",
        ),
        Workload(
            "short-c64",
            sessions=64,
            requests=1000 if q else 6000,
            **short,  # type: ignore[arg-type]
            columns=(*latency_columns, "redis/req", "cap/core", "errors"),
            what="1-8 tokens, not streamed, 64 agents: capacity (req/s per core = 1 / proxy CPU per request)",
        ),
        Workload(
            "stream",
            sessions=16,
            turns=0,
            requests=64 if q else 400,
            min_tokens=256,
            max_tokens=256,
            stream=True,
            duration_s=3.0 if q else 6.0,
            columns=("tok/s", "ttft50", "p50", "p99", "+p50", "cpu/ktok", "redis/ktok", "errors"),
            what="256 tokens streamed, no token delay, 16 agents: relay cost per token",
        ),
        rl,
        replace(
            rl,
            name="rl-whole",
            stream=False,
            columns=("tok/s", "x direct", "p50", "p99", "cpu/ktok", "redis/ktok", "balance", "errors"),
            what=f"RL-shaped, not streamed (an agent loop that waits for the whole answer): all sessions at once, "
            f"{rl_lo}-{rl_hi} tokens each, {rl_delay * 1000:g} ms per token",
        ),
        Workload(
            "multiturn",
            sessions=16 if q else 64,
            turns=4 if q else 8,
            requests=0,
            min_tokens=16,
            max_tokens=32,
            stream=False,
            grow=True,
            prompt_words=64,
            columns=("req/s", "p50", "+p50", "cpu/req", "redis/req", "affinity", "balance", "prefix hit", "errors"),
            what="sessions × turns, each prompt = the previous one + 32 words: affinity and prefix-cache hits",
        ),
        *agent_workloads(quick),
    ]


def agent_workloads(quick: bool) -> list[Workload]:
    """`agent` and `agent-stream`: sessions of an agent on its protocol (the relays: `/v1/completions` with the same
    growing conversation), each turn the whole conversation so far, the previous reply and 32 more words."""
    columns = ("req/s", "p50", "+p50", "cpu/req", "redis/req", "cap/core", "affinity", "balance", "errors")
    agent = Workload(
        "agent",
        sessions=8 if quick else 32,
        turns=4 if quick else 8,
        requests=0,
        min_tokens=16,
        max_tokens=32,
        stream=False,
        grow=True,
        echo=True,
        prompt_words=64,
        columns=columns,
        what="an agent's session: sessions × turns, each the conversation so far (replies included) + 32 words, "
        "16-32 tokens a reply, not streamed: CPU per turn of each protocol",
    )
    return [
        agent,
        replace(
            agent,
            name="agent-stream",
            stream=True,
            columns=(*columns[:3], "ttft50", *columns[3:]),
            what=agent.what.replace("not streamed", "streamed"),
        ),
    ]


# -- targets -----------------------------------------------------------------------------------------------------


@dataclass
class RouterProcess:
    """A Rust router (sglang-router or vllm-router) in a child process, pinned to `cpus`."""

    name: str
    command: list[str]
    cpus: set[int] | None
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, log_dir: Path, timeout_s: float = 60.0) -> RouterProcess:
        port, metrics_port = free_port(), free_port()
        command = [*self.command, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port)]
        self.log = log_dir / f"{self.name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(self.cpus))
        self.url = f"http://127.0.0.1:{port}"
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        # Ready = it routes a real completion (its /health can answer before its workers are registered).
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        body = {"model": "tiny", "prompt": "ready?", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                with contextlib.suppress(httpx.HTTPError):
                    if client.post(f"{self.url}/v1/completions", json=body).status_code == 200:
                        return
                time.sleep(0.2)
        raise BenchmarkError(f"{self.name} did not become ready:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        terminate(self.process)


def api_of(target: str) -> str:
    """What the load generator speaks to a target: `generate`, an agent protocol (`gateway-chat`: `chat`, ...), or
    `completions` (direct access, the relays, the gateway's `gateway` row)."""
    if target == "gateway-generate":
        return "generate"
    if target in AGENT_ROUTES or target in LITELLM_ROUTES:
        return target.split("-")[1]  # gateway-responses-chained: responses, each turn naming the previous response
    return "completions"


def router_command(target: str) -> list[str] | None:
    """The command line of a router target, or None where its package is not installed."""
    if target == "python-relay":
        return [sys.executable, str(REPO_ROOT / "benchmarks" / "python_relay.py")]
    family, policy = target.split("-", 1)
    if family == "sglang":
        if importlib.util.find_spec("sglang_router") is None:
            return None
        return [sys.executable, "-m", "sglang_router.launch_router", "--policy", policy, "--log-level", "warn"]
    script = Path(sys.executable).with_name("vllm-router")
    found = str(script) if script.exists() else shutil.which("vllm-router")
    if found is None:
        return None
    return [found, "--policy", policy, "--log-level", "warning"]


@dataclass
class Target:
    name: str
    url: str  # "" for direct
    pid: int | None  # the proxy process (None for direct)

    def cpu(self) -> dict[str, float]:
        """CPU seconds of the proxy and, separately, of its child processes (the gateway's redis-server)."""
        if self.pid is None:
            return {"proxy": 0.0, "children": 0.0}
        children = sum(cpu_seconds(child) or 0.0 for child in child_pids(self.pid))
        return {"proxy": cpu_seconds(self.pid) or 0.0, "children": children}


# -- one timed run -----------------------------------------------------------------------------------------------


@dataclass
class RunResult(Result):
    """One load-generator run against one target (the load generator's `Result`), plus the CPU of every process
    and what the replicas saw during it."""

    cpu_proxy_s: float = 0.0
    cpu_children_s: float = 0.0
    cpu_replicas_s: float = 0.0
    cpu_loadgen_s: float = 0.0
    pairs: int = 0  # consecutive requests of one session (affinity's denominator)
    same: int = 0  # ... that reached the same replica as the previous one
    per_replica: list[int] = field(default_factory=list)
    cache_queries: int = 0
    cache_hits: int = 0

    def add(self, other: RunResult) -> None:
        for name, value in asdict(other).items():
            if name == "per_replica":
                self.per_replica = [a + b for a, b in itertools.zip_longest(self.per_replica, value, fillvalue=0)]
            elif name == "error_samples":
                self.error_samples = (self.error_samples + value)[:5]
            else:
                setattr(self, name, getattr(self, name) + value)


class Bench:
    """Timed runs of load-generator processes against a target, reading every process's CPU around them.

    `loadgens`: one load-generator process per entry, each pinned to its CPUs (None: anywhere), the workload's
    agents and requests split between them. `affinity`: read the replicas' prompt logs after each run (affinity and
    balance; costs a decode per request in this process).
    """

    def __init__(
        self,
        replicas: list[SimProcess],
        timeout_s: float,
        loadgens: Sequence[set[int] | None] = (None,),
        affinity: bool = True,
    ) -> None:
        self.replicas = replicas
        self.loadgens = list(loadgens)
        self.timeout_s = timeout_s
        self.affinity = affinity
        self.tags = itertools.count(2, 2)  # the load generator uses tag + 1 for its warm-up sessions
        self.http = httpx.AsyncClient(timeout=10.0)
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER / "tokenizer.json"))

    async def replica_post(self, path: str, body: dict[str, Any]) -> None:
        for replica in self.replicas:
            (await self.http.post(f"{replica.url}{path}", json=body)).raise_for_status()

    async def cache_counters(self) -> tuple[int, int]:
        queries = hits = 0
        for replica in self.replicas:
            counters = (await self.http.get(f"{replica.url}/sim/state")).json()["counters"]
            queries += counters.get("prefix_cache_queries", 0)
            hits += counters.get("prefix_cache_hits", 0)
        return queries, hits

    def replica_cpu(self) -> float:
        return sum(cpu_seconds(replica.pid) or 0.0 for replica in self.replicas)

    async def run(self, target: Target, workload: Workload) -> RunResult:
        """One timed run: every load generator warms up, then all get `go` at once; their results are summed (the
        wall time is the longest one's). The other processes' CPU is read just before `go` and after the end; the load
        generators report their own."""
        urls = [target.url] if target.url else [replica.url for replica in self.replicas]
        api = api_of(target.name)
        loadgens = self.loadgens[: max(1, min(len(self.loadgens), workload.sessions))]  # each needs an agent
        tags = [next(self.tags) for _ in loadgens]
        chained = target.name.endswith("-chained")
        specs = [
            part.spec(urls, tag, self.timeout_s, api, chained)
            for part, tag in zip(split(workload, len(tags)), tags, strict=True)
        ]
        async with contextlib.AsyncExitStack() as stack:
            processes = [await stack.enter_async_context(loadgen_process(cpus)) for cpus in loadgens]
            for process, spec in zip(processes, specs, strict=True):
                _stdin(process).write(orjson.dumps(spec) + b"\n")
                await _stdin(process).drain()
            warms = [orjson.loads(await asyncio.wait_for(_stdout(p).readline(), self.timeout_s)) for p in processes]
            if self.affinity:
                await self.replica_post("/sim/prompt_log", {"head": PROMPT_LOG_HEAD})
            queries0, hits0 = await self.cache_counters()
            cpu0, replicas0 = target.cpu(), self.replica_cpu()
            for process in processes:  # all at once, then wait for the pipes
                _stdin(process).write(b"go\n")
            for process in processes:
                await _stdin(process).drain()
            lines = [await asyncio.wait_for(_stdout(p).readline(), self.timeout_s + 30) for p in processes]
            cpu1, replicas1 = target.cpu(), self.replica_cpu()
            queries1, hits1 = await self.cache_counters()
            for process in processes:
                await asyncio.wait_for(process.wait(), 30)
        if not all(lines):
            raise BenchmarkError(f"a load generator against {target.name} stopped without a result")
        result = RunResult()
        for line, warm in zip(lines, warms, strict=True):
            answer = orjson.loads(line)
            part = RunResult(**{k: v for k, v in answer.items() if k in RunResult.__dataclass_fields__})
            if warm.get("errors"):
                part.errors += warm["errors"]
                part.error_samples = (["warm-up: " + m for m in warm["error_samples"]] + part.error_samples)[:5]
            wall_s = max(result.wall_s, part.wall_s)  # they ran side by side: the run lasted as long as the longest
            result.add(part)
            result.wall_s = wall_s
        result.cpu_proxy_s = cpu1["proxy"] - cpu0["proxy"]
        result.cpu_children_s = cpu1["children"] - cpu0["children"]
        result.cpu_replicas_s = replicas1 - replicas0
        result.cache_queries, result.cache_hits = queries1 - queries0, hits1 - hits0
        if self.affinity:
            await self.placement(set(tags), result)
        return result

    async def placement(self, tags: set[int], result: RunResult) -> None:
        """Affinity and balance of the run from the replicas' prompt logs (sessions decoded from prompt heads)."""
        arrivals: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
        result.per_replica = [0] * len(self.replicas)
        for index, replica in enumerate(self.replicas):
            log = (await self.http.get(f"{replica.url}/sim/prompt_log")).json()["requests"]
            for head, _length, at in log:
                found = session_of(self.tokenizer.decode(head))
                if found is not None and found[0] in tags:
                    arrivals[found].append((at, index))
                    result.per_replica[index] += 1
        for visits in arrivals.values():
            visits.sort()
            result.pairs += len(visits) - 1
            result.same += sum(a[1] == b[1] for a, b in itertools.pairwise(visits))


def split(workload: Workload, parts: int) -> list[Workload]:
    """`workload` shared by `parts` load generators: each gets its share of the agents and of the request count."""

    def share(total: int, index: int) -> int:
        return total // parts + (index < total % parts)

    return [
        replace(workload, sessions=share(workload.sessions, i), requests=share(workload.requests, i))
        for i in range(parts)
    ]


@contextlib.asynccontextmanager
async def loadgen_process(cpus: set[int] | None) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m benchmarks.loadgen` pinned to `cpus`, killed on exit if it is still running."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.loadgen",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        preexec_fn=pinned(cpus),
        limit=1 << 26,
        cwd=REPO_ROOT,  # `benchmarks` is not an installed package
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _stdin(process: asyncio.subprocess.Process) -> asyncio.StreamWriter:
    assert process.stdin is not None
    return process.stdin


def _stdout(process: asyncio.subprocess.Process) -> asyncio.StreamReader:
    assert process.stdout is not None
    return process.stdout


# -- the whole run -----------------------------------------------------------------------------------------------


LayoutName = Literal["shared", "dedicated", "auto"]


@dataclass(frozen=True)
class Options:
    targets: tuple[str, ...]
    workloads: tuple[Workload, ...]
    rounds: int
    timeout_s: float
    pin: bool
    json_path: Path | None
    layout: LayoutName = "shared"  # auto: dedicated where the CPUs hold it
    loadgens: int = 2
    cpus: tuple[int, ...] = ()  # of a dedicated layout (empty: every CPU this process may use)


def cpu_split(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(CPUs of the replicas and the load generator, CPUs of the proxy): core 0 and core 1 where there are two."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, {cpus[1]}


@dataclass(frozen=True)
class Placement:
    """Where each process of a run goes (None: anywhere): each replica, each load generator, the proxy."""

    replicas: tuple[set[int] | None, ...]
    loadgens: tuple[set[int] | None, ...]
    proxy: set[int] | None

    def describe(self) -> str:
        replicas, loadgens = list(self.replicas), list(self.loadgens)
        return f"replicas on CPUs {replicas}, load generators on {loadgens}, proxy on {self.proxy}"


def place_processes(
    layout_name: LayoutName, loadgens: int = 2, pin: bool = True, cpus: Sequence[int] = (), replicas: int = 2
) -> Placement:
    """Shared (the 2-core machine): the replicas and one load generator on core 0, the proxy on core 1. Dedicated
    (a many-core machine): every replica and load generator on a CPU of its own, the proxy (with the gateway's
    redis-server child) alone on another, its SMT siblings idle; `benchmarks.scaling.plan` lays it out. Auto:
    dedicated where the CPUs hold it, else shared."""
    from benchmarks.scaling import plan

    cpus = list(cpus) or sorted(
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    try:
        layout = plan(cpus, 1, replicas, loadgens, pin) if layout_name != "shared" else None
    except ValueError as exc:
        if layout_name == "dedicated":
            raise SystemExit(f"--layout dedicated: {exc}") from exc
        layout = None
    if layout is None:
        shared, proxy = cpu_split(pin)
        return Placement((shared,) * replicas, (shared,), proxy)
    # plan() keeps a CPU for a Redis shared by workers; here the gateway's Redis stays on the proxy's CPU (the
    # routers have none), so that CPU is left idle.
    return Placement(
        tuple(layout.cpus(cpu) for cpu in layout.replicas),
        tuple(layout.cpus(cpu) for cpu in layout.loadgens),
        layout.cpus(layout.workers[0]),
    )


@contextlib.contextmanager
def targets_up(
    options: Options, replicas: list[SimProcess], proxy_cpus: set[int] | None, front_cpus: set[int] | None = None
) -> Iterator[list[Target]]:
    """Start every requested target (each fronting both replicas); stop them all on exit. `front_cpus`: where
    LiteLLM's chat front runs (beside the replicas)."""
    urls = [replica.url for replica in replicas]
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(_tmpdir()))
        targets = []
        gateway: GatewayProcess | None = None
        litellm: LiteLLMProcess | None = None
        for name in options.targets:
            if name == "direct":
                targets.append(Target(name, "", None))
            elif name.startswith("gateway"):
                if gateway is None:  # one gateway process serves all of its rows (each a route)
                    entries = [sim_replica_entry(url, "vllm") for url in urls]
                    gateway = stack.enter_context(GatewayProcess(entries, GATEWAY_SETTINGS, cpus=proxy_cpus))
                targets.append(Target(name, gateway.url, gateway.pid))
            elif name in LITELLM_ROUTES:
                if litellm is None:  # one LiteLLM process serves its three routes
                    litellm = LiteLLMProcess(urls, proxy_cpus, front_cpus)
                    stack.callback(litellm.stop)
                    litellm.start(log_dir)
                targets.append(Target(name, litellm.url, litellm.pid))
            else:
                command = router_command(name)
                if command is None:
                    raise BenchmarkError(f"{name}: its package is not installed (pip install -e '.[bench]')")
                router = RouterProcess(name, [*command, "--worker-urls", *urls], proxy_cpus)
                stack.callback(router.stop)
                router.start(log_dir)
                targets.append(Target(name, router.url, router.pid))
        yield targets


@contextlib.contextmanager
def _tmpdir() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rg-compare-") as path:
        yield path


async def run_all(options: Options, console: Console) -> dict[str, dict[str, RunResult]]:
    where = place_processes(options.layout, options.loadgens, options.pin, options.cpus)
    results: dict[str, dict[str, RunResult]] = {}
    missing = litellm_missing()
    if missing and set(options.targets) & set(LITELLM_ROUTES):
        console.print(f"[yellow]litellm targets skipped: {missing}[/]")
        options = replace(options, targets=tuple(t for t in options.targets if t not in LITELLM_ROUTES))
    with sim_replicas([REPLICA_ARGS, REPLICA_ARGS]) as replicas:
        for replica, cpus in zip(replicas, where.replicas, strict=True):
            if replica.pid is not None:
                pin_process(replica.pid, cpus)
        with targets_up(options, replicas, where.proxy, where.replicas[0]) as targets:
            names = ", ".join(t.name for t in targets)
            console.print(f"{len(replicas)} replicas up, targets: {names}; {where.describe()}")
            bench = Bench(replicas, options.timeout_s, where.loadgens)
            try:
                for workload in options.workloads:
                    await bench.replica_post("/sim/speed", {"token_delay": workload.token_delay_s})
                    runs = results.setdefault(workload.name, {t.name: RunResult() for t in targets})
                    for round_number in range(options.rounds):
                        order = targets if round_number % 2 == 0 else targets[::-1]  # ABBA
                        for target in order:
                            started = time.monotonic()
                            run = await bench.run(target, workload)
                            runs[target.name].add(run)
                            console.print(
                                f"  {workload.name:<10} round {round_number + 1}  {target.name:<25} "
                                f"{run.ok:>6,} ok {run.errors:>3} errors  {time.monotonic() - started:5.1f} s"
                            )
            finally:
                await bench.http.aclose()
    return results


# -- report ------------------------------------------------------------------------------------------------------

# column -> (header, which way is better: "max", "min" or "" for no ratio)
COLUMNS: dict[str, tuple[str, str]] = {
    "req/s": ("req/s", "max"),
    "tok/s": ("tokens/s", "max"),
    "x direct": ("× direct", "max"),
    "p50": ("p50 ms", "min"),
    "p99": ("p99 ms", "min"),
    "+p50": ("+p50 ms", "min"),
    "+p99": ("+p99 ms", "min"),
    "ttft50": ("TTFT p50 ms", "min"),
    "ttft99": ("TTFT p99 ms", "min"),
    "cpu/req": ("CPU s/1k req", "min"),
    "cpu/ktok": ("CPU s/1k tok", "min"),
    "redis/req": ("+redis s/1k req", ""),
    "redis/ktok": ("+redis s/1k tok", ""),
    "cap/core": ("req/s per core", "max"),
    "affinity": ("affinity", "max"),
    "balance": ("busiest replica", ""),
    "prefix hit": ("prefix hit", "max"),
    "errors": ("errors", ""),
}


def figures(run: RunResult, direct: RunResult | None) -> dict[str, float]:
    lat, ttft = Percentiles.of(run.latencies), Percentiles.of(run.ttfts)
    wall = run.wall_s or math.nan
    out = {
        "req/s": run.ok / wall,
        "tok/s": run.tokens / wall,
        "p50": lat.p50 * 1000,
        "p99": lat.p99 * 1000,
        "ttft50": ttft.p50 * 1000,
        "ttft99": ttft.p99 * 1000,
        "cpu/req": run.cpu_proxy_s / max(1, run.ok) * 1000 if run.ok else math.nan,
        "cpu/ktok": run.cpu_proxy_s / max(1, run.tokens) * 1000 if run.tokens else math.nan,
        "affinity": run.same / run.pairs if run.pairs else math.nan,
        "balance": max(run.per_replica) / sum(run.per_replica) if sum(run.per_replica) else math.nan,
        "prefix hit": run.cache_hits / run.cache_queries if run.cache_queries else math.nan,
        "errors": float(run.errors),
        "redis/req": run.cpu_children_s / run.ok * 1000 if run.ok else math.nan,
        "redis/ktok": run.cpu_children_s / run.tokens * 1000 if run.tokens else math.nan,
    }
    out["cap/core"] = 1000 / out["cpu/req"] if out["cpu/req"] > 0 else math.nan
    if direct is not None and direct.latencies:
        d = Percentiles.of(direct.latencies)
        out["+p50"], out["+p99"] = out["p50"] - d.p50 * 1000, out["p99"] - d.p99 * 1000
        out["x direct"] = out["tok/s"] / (direct.tokens / direct.wall_s) if direct.wall_s else math.nan
    else:
        out["+p50"] = out["+p99"] = out["x direct"] = math.nan
    return out


def fmt(column: str, value: float) -> str:
    if value != value:
        return "—"
    if column in ("affinity", "balance", "prefix hit"):
        return f"{value * 100:.1f}%"
    if column in ("req/s", "tok/s", "cap/core", "errors"):
        return f"{value:,.0f}"
    if column == "x direct":
        return f"{value:.2f}"
    if column in ("cpu/req", "cpu/ktok", "redis/req", "redis/ktok"):
        return f"{value:.3f}"
    return f"{value:,.2f}"


def report(console: Console, options: Options, results: dict[str, dict[str, RunResult]]) -> None:
    console.print(f"\n[bold]rollout-gateway vs direct vs Rust routers[/] — {machine_line()}")
    for workload in options.workloads:
        runs = results.get(workload.name, {})
        direct = runs.get("direct")
        table = {name: figures(run, direct) for name, run in runs.items()}
        proxies = [name for name in table if name != "direct"]
        rows = []
        for name, values in table.items():
            row = [name]
            for column in workload.columns:
                cell = fmt(column, values[column])
                better = COLUMNS[column][1]
                peers = [table[p][column] for p in proxies if table[p][column] == table[p][column]]
                if better and name != "direct" and len(peers) > 1 and cell != "—":
                    best = max(peers) if better == "max" else min(peers)
                    if best > 0 and values[column] >= 0:  # a ratio to a negative (noise below direct) means nothing
                        ratio = values[column] / best
                        cell += f" ({ratio:.2f})"
                row.append(cell)
            rows.append(row)
        headers = ["target", *(COLUMNS[c][0] for c in workload.columns)]
        print_table(console, f"{workload.name}: {workload.what}", headers, rows)
        for name, run in runs.items():
            for sample in run.error_samples:
                console.print(f"  [red]{name} error:[/] {sample}")
    console.print(
        "[dim]How to read this:[/] (x.xx) = the figure ÷ the best proxy's (direct excluded): 1.00 is the best; "
        "above 1 is worse for latency/CPU, below 1 worse for throughput/affinity. +p50/+p99 = minus direct's. "
        "CPU = utime+stime of the proxy process (all its threads) during the timed part; +redis = the "
        "gateway's embedded redis-server child besides (same core; the routers have none). "
        "req/s per core = 1 / CPU per request: the capacity of one core spent on the proxy alone. "
        "busiest replica = its share of requests (50% = even). Absolute figures on a shared machine move "
        "from run to run; the ratios move less."
    )
    for line in agent_checks(results):
        console.print(line)


def turn_cpu_ms(run: RunResult) -> float:
    """CPU ms per turn of a proxy, its children (the gateway's Redis) included: what the turn cost in all."""
    return (run.cpu_proxy_s + run.cpu_children_s) / run.ok * 1000 if run.ok else math.nan


def agent_checks(results: dict[str, dict[str, RunResult]]) -> list[str]:
    """The targets of the agent rows (issue 36 §4), checked and said, never asserted: each protocol's gateway route
    within 1.2× of the chat route's CPU per turn, and every gateway route below LiteLLM's (the gateway's Redis
    counted: LiteLLM keeps no trajectory)."""
    lines = []
    for name in AGENT_WORKLOADS:
        runs = results.get(name, {})
        cpu = {target: turn_cpu_ms(run) for target, run in runs.items() if target in (*AGENT_ROUTES, *LITELLM_ROUTES)}
        chat = cpu.get("gateway-chat", math.nan)
        for route in AGENT_ROUTES[1:]:
            if route in cpu and chat == chat:
                ratio = cpu[route] / chat
                verdict = "yes" if ratio <= 1.2 else "NO"
                lines.append(
                    f"{name}: {route} {cpu[route]:.3f} ms a turn = {ratio:.2f}× gateway-chat: ≤ 1.2×? {verdict}"
                )
        for route in AGENT_ROUTES:
            theirs = cpu.get(route.replace("gateway", "litellm"))
            if route in cpu and theirs is not None and theirs == theirs:
                verdict = "yes" if cpu[route] < theirs else "NO"
                lines.append(
                    f"{name}: {route} {cpu[route]:.3f} ms a turn (Redis included), LiteLLM's {theirs:.3f} ms: "
                    f"{cpu[route] / theirs:.2f}×, below? {verdict}"
                )
    return lines


def write_json(path: Path, options: Options, results: dict[str, dict[str, RunResult]]) -> None:
    out: dict[str, Any] = {"machine": machine_line(), "rounds": options.rounds, "workloads": {}}
    for workload in options.workloads:
        runs = results.get(workload.name, {})
        direct = runs.get("direct")
        out["workloads"][workload.name] = {
            "workload": asdict(workload),
            "targets": {
                name: {
                    "figures": figures(run, direct),
                    **{k: v for k, v in asdict(run).items() if k not in ("latencies", "ttfts")},
                }
                for name, run in runs.items()
            },
        }
    out["agent_checks"] = agent_checks(results)
    path.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


# -- command line ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small counts and one round: about 3 minutes")
    p.add_argument("--targets", nargs="+", choices=ALL_TARGETS, default=None, help="default: all but the agent routes")
    names = "short-c1 short-c64 stream rl rl-whole multiturn agent agent-stream"
    p.add_argument("--workloads", nargs="+", default=None, help=f"{names} (default: all but the agent ones)")
    p.add_argument(
        "--agents",
        action="store_true",
        help="the agent rows: workloads agent and agent-stream, the gateway's chat/messages/responses routes and "
        "LiteLLM's beside direct, the gateway's /v1/completions and the relays (unless --targets/--workloads say)",
    )
    p.add_argument("--rounds", type=int, default=None, help="timed runs per target and workload, ABBA (default 2)")
    p.add_argument("--rl-sessions", type=int, default=None, help="concurrent sessions of `rl` (default 256; quick 32)")
    p.add_argument("--rl-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="tokens per rl stream")
    p.add_argument("--rl-token-delay", type=float, default=0.03, help="seconds per decode step in `rl` (0.03)")
    p.add_argument("--timeout", type=float, default=180.0, help="bound of each load-generator run, s")
    p.add_argument("--no-pin", action="store_true", help="do not pin the proxy and the rest to separate cores")
    add_layout_arguments(p)
    p.add_argument("--json", type=Path, default=None, help="also write every figure (and raw counts) here")
    return p


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """`--layout`, `--loadgens` and `--cpus` (see `place_processes`), for this benchmark and `benchmarks.ab`."""
    p.add_argument(
        "--layout",
        choices=("auto", "shared", "dedicated"),
        default="auto",
        help="shared: replicas and load generator on core 0, proxy on core 1 (a 2-core machine); dedicated: every "
        "replica, load generator and the proxy on CPUs of their own (needs 6 or more); auto: dedicated where the "
        "CPUs hold it (default)",
    )
    p.add_argument(
        "--loadgens", type=_at_least_one, default=2, help="load-generator processes with --layout dedicated (2)"
    )
    p.add_argument("--cpus", type=int, nargs="+", default=None, help="the CPUs a dedicated layout uses (default all)")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, not {value}")
    return value


def options_from(args: argparse.Namespace) -> Options:
    available = workloads(args.quick, args.rl_sessions, args.rl_tokens, args.rl_token_delay)
    by_name = {w.name: w for w in available}
    chosen = args.workloads or (
        list(AGENT_WORKLOADS) if args.agents else [n for n in by_name if n not in AGENT_WORKLOADS]
    )
    unknown = [name for name in chosen if name not in by_name]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(by_name)}")
    rounds = args.rounds or (1 if args.quick else 2)
    if rounds < 1:
        raise SystemExit("--rounds must be ≥ 1")
    targets = tuple(dict.fromkeys(args.targets or (AGENT_TARGETS if args.agents else DEFAULT_TARGETS)))
    return Options(
        targets,
        tuple(by_name[n] for n in chosen),
        rounds,
        args.timeout,
        not args.no_pin,
        args.json,
        layout=args.layout,
        loadgens=args.loadgens,
        cpus=tuple(args.cpus or ()),
    )


async def main_async(options: Options, console: Console) -> bool:
    results = await run_all(options, console)
    report(console, options, results)
    if options.json_path is not None:
        write_json(options.json_path, options, results)
    return all(run.errors == 0 for runs in results.values() for run in runs.values())


def main(argv: Sequence[str] | None = None) -> int:
    options = options_from(build_parser().parse_args(argv))
    total_timeout = options.timeout_s * len(options.targets) * len(options.workloads) * options.rounds
    return run_benchmark(main_async, options, total_timeout)


if __name__ == "__main__":
    sys.exit(main())
