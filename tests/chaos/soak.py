"""The chaos soak: hundreds of multi-turn agent sessions through the official `openai` client, spread over two
gateways on one Redis (one in this process, one a `rollout-gateway serve` child), while weight updates fire every
1-2 s (random modes), simulator replicas (real processes) are SIGKILLed and restarted, or hang a few seconds
(SIGSTOP, then SIGCONT), Redis restarts once, the child gateway is SIGKILLed once and restarted on its port, and
clients disconnect mid-turn; meanwhile hostile clients never read their streams (past the process-wide budget of
queued bytes), send 1 MiB headers, trickle a body a byte at a time, and send tools of megabytes. An agent whose
gateway cannot be reached retries its turn on the other one, as behind a load balancer. The verdict is read from the
trainer side.

Everything is on loopback, every loop is bounded in count and time, and one seed drives every random choice
(printed, so a failure can be replayed: `RG_CHAOS_SEED=<seed> python -m pytest tests/chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.model import PREFIX_HASH_START, ModelShape, TokenModel, extend_prefix_hash, weights_key
from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import StoreError
from gateway.server import RunningGateway, serve_gateway
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import ENV_VERSION, Sample, Trajectory
from rollout_cli.redis_cluster import LocalRedisCluster
from tests.cli_helpers import CLI, free_port

ADMIN_TOKEN = "chaos-admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
SHAPE = ModelShape()
DIALECTS = ("vllm", "sglang", "vllm")
EXPERTS_SHAPE = (2, 2)  # the simulator's default (layers, top_k)
FAULT_REACH_S = 6.0  # how long before a turn a fault may still cut it (a hang: its length, then the probe's)
# The hostile clients' limits, set small in the soak's gateways so that each is met within seconds: a body with no
# byte for BODY_TIMEOUT_S, or slower than 1 KiB/s past it, is a 408; what streamed answers hold for their clients,
# all together, is bounded by STREAM_BUDGET_BYTES per process (a never-read stream passes it about a second after
# the kernel's buffers filled, before its stalled send is cut at `server.slow_client_timeout_s`, 2 s). With
# BODY_TIMEOUT_S at 2 s, 2 of 300 agents got the 408 in a soak: under the soak's load the test process's loop (its
# agents and a gateway) can go seconds between a request's head and its body (the client writes them apart).
BODY_TIMEOUT_S = 5.0
STREAM_BUDGET_BYTES = 1024 * 1024
TRICKLE_BOUND_S = 30.0  # a trickled body not answered within this is a violation (the 408 is due after ~5 s)
# A tool flood refused later than this is a violation. Alone, a gateway refuses one in 0.05-0.08 s (by length,
# before rendering; rendered, 128 tools of 96 KB took 7.3 s and 1.1 GB); under the soak's load the child took up to
# 2.7 s. The floods and the heavy never-read streams go to the child only (a process of its own): sent to the
# in-process gateway too, they loaded the test process's event loop (300 agents and a gateway) so that a refusal
# took up to 22 s there, the soak 127-146 s against 72 s, and once a trainer's request met a closed connection.
TOOL_FLOOD_BOUND_S = 10.0
TOOL_FLOOD = (64, 64 * 1024)  # tools, and characters of description (or of parameters schema) each


@dataclass(frozen=True)
class SoakOptions:
    seed: int = 7
    sessions: int = 300
    turns: tuple[int, int] = (2, 3)
    max_tokens: tuple[int, int] = (4, 64)
    token_delay_s: float = 0.002
    duration_s: float = 150.0  # hard bound on the agents' phase; the check after it has its own
    update_every_s: tuple[float, float] = (1.0, 2.0)
    kill_every_s: tuple[float, float] = (2.0, 4.0)
    # A replica hangs (SIGSTOP: its sockets stay open, nothing comes) for `hang_s`, longer than the health probe's
    # timeout, so that the probe marks it down and its requests resume elsewhere, then goes on (SIGCONT).
    hang_every_s: tuple[float, float] = (3.0, 6.0)
    hang_s: tuple[float, float] = (2.5, 4.0)
    # The least chaos a soak must go through: agents past their planned turns go on with more until it happened
    # (within 80 % of `duration_s`). A fast machine finished every episode after one weight update (each admin
    # call then waited seconds on the agents' client pool, see `_run`); the test had nothing to judge.
    min_updates: int = 3
    min_kills: int = 2
    min_hangs: int = 1
    disconnect_rate: float = 0.05
    stream_rate: float = 0.5
    # A client that starts a streamed turn and never reads it, every so often (seconds), and a request with a
    # 1 MiB header.
    slow_reader_every_s: tuple[float, float] = (1.0, 3.0)
    oversized_header_every_s: tuple[float, float] = (1.0, 3.0)
    # A client that sends a complete head with a Content-Length, then its body a byte every 0.25 s (it must get
    # 408 `request_body_timeout`), and a request whose tools carry megabytes of text (`TOOL_FLOOD`: it must get
    # 400 `context_length_exceeded` within TOOL_FLOOD_BOUND_S), every so often (seconds).
    trickle_every_s: tuple[float, float] = (1.0, 3.0)
    tool_flood_every_s: tuple[float, float] = (2.0, 4.0)
    # The least of them a soak must see (agents go on until then, as for `min_updates`): 408s to trickled bodies,
    # refused tool floods, and never-read streams cut by the in-process gateway's budget (`STREAM_BUDGET_BYTES`).
    min_trickled: int = 3
    min_tool_floods: int = 3
    min_budget_cuts: int = 1
    # When the child gateway is SIGKILLed (once) and restarted, in seconds after the agents start.
    gateway_kill_at_s: tuple[float, float] = (4.0, 8.0)
    # The simulators' prefix cache, so that a request admitted after an update onto KV of older weights shows up as
    # tokens no version draws (see docs/reliability.md). RG_CHAOS_PREFIX_CACHE=0 turns it off.
    prefix_cache: bool = True
    # "cluster": a local Redis Cluster (3 masters, a replica each) instead of one server, and the Redis fault is a
    # master SIGKILLed (its replica promoted) instead of a restart.
    redis: str = "single"


@dataclass
class SoakReport:
    seed: int = 0
    sessions: int = 0
    sessions_acked: int = 0
    turns: int = 0
    updates: int = 0
    update_modes: Counter[str] = field(default_factory=Counter)
    kills: int = 0
    hangs: int = 0
    redis_restarts: int = 0
    gateway_kills: int = 0
    slow_readers: int = 0
    oversized_headers: int = 0
    trickled_bodies: Counter[str] = field(default_factory=Counter)  # by outcome: 408, or closed (its gateway killed)
    tool_floods: int = 0
    tool_flood_slowest_s: float = 0.0
    slow_clients_cut: Counter[str] = field(default_factory=Counter)  # both gateways' /metrics at the end, by cause
    least_chaos_at: dict[str, int] = field(default_factory=dict)  # seconds into the agents' phase each was reached
    turns_spanning_updates: int = 0  # replies whose tokens span an update with no kill during the turn
    disconnects: int = 0
    resumes: int = 0
    segments_cut: Counter[str] = field(default_factory=Counter)
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    samples_checked: int = 0
    tokens_checked: int = 0
    samples_spanning_updates: int = 0
    samples_without_experts: int = 0
    documented_503: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def figures(self) -> str:
        return (
            f"seed {self.seed}: sessions {self.sessions} (finish acknowledged {self.sessions_acked}), "
            f"turns {self.turns}, weight updates {self.updates} {dict(self.update_modes)}, replica kills "
            f"{self.kills}, replica hangs {self.hangs}, redis restarts {self.redis_restarts}, "
            f"gateway kills {self.gateway_kills}, client disconnects {self.disconnects}, slow readers "
            f"{self.slow_readers}, 1 MiB headers {self.oversized_headers}, trickled bodies "
            f"{dict(self.trickled_bodies)}, tool floods {self.tool_floods} (slowest refusal "
            f"{self.tool_flood_slowest_s:.2f} s), slow clients cut "
            f"{dict(self.slow_clients_cut)}, "
            f"resumes {self.resumes} (segments cut {dict(self.segments_cut)}), replies spanning an update without "
            f"a kill {self.turns_spanning_updates}, delivered {self.delivered}, "
            f"lost {self.lost}, duplicated {self.duplicated}, "
            f"samples checked {self.samples_checked} ({self.tokens_checked} sampled tokens, "
            f"{self.samples_spanning_updates} spanning an update, {self.samples_without_experts} without routed "
            f"experts), documented 503s {self.documented_503}, "
            f"client retries {dict(self.retries)}, least chaos reached at (s) {self.least_chaos_at}, "
            f"violations {len(self.violations)}, {self.elapsed_s:.0f}s"
        )


class Soak:
    def __init__(self, options: SoakOptions, data_dir: Path) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.report = SoakReport(seed=options.seed, sessions=options.sessions)
        self.redis = EmbeddedRedis(data_dir=data_dir)
        self.cluster = LocalRedisCluster(data_dir=data_dir / "cluster") if options.redis == "cluster" else None
        self.data_dir = data_dir
        args = ["--token-delay", str(options.token_delay_s), "--enable-return-routed-experts"]
        if not options.prefix_cache:
            args += ["--cache-blocks", "0"]
        self.sims = [SimProcess(["--dialect", d, *args]) for d in DIALECTS]
        # A kill and a hang never act on one replica at once (a SIGCONT must reach the process it stopped).
        self.sim_locks = {id(sim): asyncio.Lock() for sim in self.sims}
        self.acked: set[str] = set()
        self._stalled: list[socket.socket] = []  # the slow readers' sockets, never read
        self.update_modes: dict[int, set[str]] = {}  # the modes of the updates that asked for each version
        # Replica kills and hangs, the Redis restart, the gateway kill (monotonic): faults that explain a resume.
        self.kill_times: list[float] = []
        self.agents_done = asyncio.Event()
        self.trainer_errors: Counter[str] = Counter()  # what the trainer's reads failed on, for a failure's report
        self.budget_cuts: dict[str, int] = {}  # the in-process gateway's slow-client cuts by cause, live
        # The child's, from its /metrics: what it counted before its restart (its kill resets them), and since.
        self._child_cuts_before: Counter[str] = Counter()
        self._child_cuts: Counter[str] = Counter()
        self.deadline = 0.0

    # -- setup ---------------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.redis.url

    def settings(self, port: int = 0) -> dict[str, Any]:
        """The gateways' configuration, as the keyword arguments of `Settings` (the child's YAML file too)."""
        settings = gateway_settings(
            self.sims, self.redis_url, port, stream_partitions=3 if self.cluster is not None else 1
        )
        settings["server"] |= {
            "body_timeout_s": BODY_TIMEOUT_S,
            "min_body_rate_bytes_s": 1024,
            "stream_buffer_budget_bytes": STREAM_BUDGET_BYTES,
        }
        return settings

    async def run(self) -> SoakReport:
        started = time.monotonic()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.start)
        else:
            await self.redis.astart()
        child: GatewayChild | None = None
        try:
            for sim in self.sims:
                await asyncio.to_thread(sim.start)
            child = GatewayChild(self.settings(port=free_port()), self.data_dir.parent / "gateway-b")
            await asyncio.to_thread(child.start)
            async with serve_gateway(Settings(**self.settings())) as gw:
                await self._run(gw, child)
        finally:
            if child is not None:
                await asyncio.to_thread(child.stop)
            for sim in self.sims:
                await asyncio.to_thread(sim.stop)
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.stop)
            await self.redis.astop()
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def _run(self, gw: RunningGateway, child: GatewayChild) -> None:
        self.deadline = time.monotonic() + self.o.duration_s
        self.budget_cuts = gw.services.stream_buffers.cuts
        limits = httpx.Limits(max_connections=2 * self.o.sessions, max_keepalive_connections=2 * self.o.sessions)
        fronts = [Front.to(url, limits) for url in (gw.url, child.url)]
        # The trainer's calls go through a client of their own, as a trainer's would. Sent on the agents' shared
        # pool (hundreds of connections), `POST /admin/weights` reached the gateway 4-5 s later and returned after
        # 4-11 s, for updates the gateway did in 0.1-0.6 s; from a client of its own it arrives within 0.15 s.
        trainer_http = httpx.AsyncClient(base_url=gw.url, timeout=120)
        async with contextlib.AsyncExitStack() as stack:
            for front in fronts:
                await stack.enter_async_context(front.http)
            await stack.enter_async_context(trainer_http)
            consumer = await stack.enter_async_context(
                TrajectoryConsumer(self.redis_url, "chaos", "trainer-0", claim_idle_s=5)
            )
            delivered: Counter[str] = Counter()
            trajectories: list[Trajectory] = []
            trainer = asyncio.create_task(self._trainer(consumer, delivered, trajectories))
            chaos = [
                asyncio.create_task(self._updates(trainer_http)),
                asyncio.create_task(self._kills()),
                asyncio.create_task(self._hangs()),
                asyncio.create_task(self._redis_restart()),
                asyncio.create_task(self._gateway_kill(child)),
                asyncio.create_task(self._slow_readers([gw.url, child.url], trainer_http)),
                asyncio.create_task(self._oversized_headers([gw.url, child.url])),
                asyncio.create_task(self._trickled_bodies([gw.url, child.url])),
                asyncio.create_task(self._tool_floods(child.url)),
            ]
            seeds = [self.rng.getrandbits(32) for _ in range(self.o.sessions)]
            await asyncio.gather(*(self._session(Route(fronts, i), i, seeds[i]) for i in range(self.o.sessions)))
            self.agents_done.set()
            for task in chaos:
                await task  # each ends at agents_done; an exception in one is a failure of the soak
            await asyncio.wait_for(trainer, timeout=120)
            for sock in self._stalled:
                sock.close()
            await self._scrape_child_cuts(trainer_http, child.url)
            in_process = await scrape_cuts(trainer_http, gw.url)
            if in_process is None:
                self.report.violations.append("the in-process gateway's /metrics did not answer")
            self.report.slow_clients_cut = (in_process or Counter()) + self._child_cuts_before + self._child_cuts
            generator = gw.services.generator
            self.report.resumes = generator.resumes_total
            self.report.segments_cut.update(replica_out=generator.interrupted_total, stalled=generator.stalled_total)
        self._verdict(delivered, trajectories)

    # -- the agents ----------------------------------------------------------------------------

    async def _session(self, route: Route, index: int, seed: int) -> None:
        rng = random.Random(seed)
        session = f"chaos-{self.o.seed}-{index}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}: {rng.random():.6f}"}]
        planned, turn = rng.randint(*self.o.turns), 0
        while turn < planned or self._chaos_pending():
            reply = await self._turn(route, session, messages, rng)
            if reply is None:
                return  # gave up inside the bound: the session is simply never finished
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on {turn}"}]
            turn += 1
        if await self._finish(route, session, rng.random()):
            self.acked.add(session)
            self.report.sessions_acked += 1

    async def _turn(self, route: Route, session: str, messages: list[dict[str, Any]], rng: random.Random) -> str | None:
        max_tokens = rng.randint(*self.o.max_tokens)
        stream = rng.random() < self.o.stream_rate
        while time.monotonic() < self.deadline:
            began = time.monotonic()
            call = asyncio.ensure_future(create_turn(route.front.api, session, messages, max_tokens, stream))
            if rng.random() < self.o.disconnect_rate:
                await asyncio.wait({call}, timeout=rng.uniform(0.0, 0.1))
                if not call.done():  # the client leaves mid-turn: the connection closes, the agent retries
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                    self.report.disconnects += 1
                    continue
            try:
                content, finish, versions = await call
            except openai.APIStatusError as exc:
                if not self._retryable_status(exc):
                    self.report.violations.append(f"{session}: HTTP {exc.status_code}: {exc.message}")
                    return None
                continue
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                self.report.retries[type(exc).__name__] += 1
                route.fail_over()
                continue
            if finish not in ("stop", "length", "tool_calls"):
                self.report.violations.append(f"{session}: agent-visible finish_reason {finish!r}")
            self._check_wait(session, versions, began)
            self.report.turns += 1
            return content
        self.report.violations.append(f"{session}: turn not done within the soak's bound")
        return None

    def _check_wait(self, session: str, versions: list[int], began: float) -> None:
        spans, violations = check_wait_span(session, versions, began, self.kill_times, self.update_modes)
        self.report.turns_spanning_updates += spans
        self.report.violations += violations

    def _chaos_pending(self) -> bool:
        """Whether the soak's least chaos (`min_updates`, `min_kills`, the Redis restart) is still to come while
        there is time for it: the agents keep the gateway busy until then."""
        r, o = self.report, self.o
        reached = {
            "updates": r.updates >= o.min_updates,
            "kills": r.kills >= o.min_kills,
            "hangs": r.hangs >= o.min_hangs,
            "redis restart": r.redis_restarts >= 1,
            "gateway kill": r.gateway_kills >= 1,
            "trickled 408s": r.trickled_bodies["408"] >= o.min_trickled,
            "tool floods": r.tool_floods >= o.min_tool_floods,
            "budget cuts": self.budget_cuts.get("budget", 0)
            + self._child_cuts_before["budget"]
            + self._child_cuts["budget"]
            >= o.min_budget_cuts,
        }
        since = time.monotonic() - (self.deadline - o.duration_s)
        for what in (what for what, done in reached.items() if done and what not in r.least_chaos_at):
            r.least_chaos_at[what] = round(since)  # when each was first seen reached: what made the soak long
        return not all(reached.values()) and time.monotonic() < self.deadline - o.duration_s / 5

    def _retryable_status(self, exc: openai.APIStatusError) -> bool:
        if exc.status_code == 503 and "no replica can serve" in exc.message:
            self.report.documented_503 += 1  # all replicas down past the wait budget (documented)
            return True
        if exc.status_code == 429:
            self.report.retries["429"] += 1
            return True
        return False

    async def _finish(self, route: Route, session: str, reward: float) -> bool:
        while time.monotonic() < self.deadline:
            try:
                response = await route.front.http.post(f"/v1/sessions/{session}/finish", json={"reward": reward})
            except httpx.TransportError as exc:
                self.report.retries[f"finish {type(exc).__name__}"] += 1
                route.fail_over()
                continue
            if response.status_code == 200:
                return True
            if response.status_code != 503:
                self.report.violations.append(f"{session}: finish answered {response.status_code}: {response.text}")
                return False
            self.report.retries["finish 503"] += 1
            await asyncio.sleep(0.2)  # back off before retrying (the store is restarting), not synchronisation
        self.report.violations.append(f"{session}: finish not acknowledged within the soak's bound")
        return False

    # -- the chaos -----------------------------------------------------------------------------

    async def _pause(self, bounds: tuple[float, float]) -> bool:
        """Wait a random time in `bounds`; False once the agents are done."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.agents_done.wait(), self.rng.uniform(*bounds))
        return not self.agents_done.is_set()

    async def _updates(self, http: httpx.AsyncClient) -> None:
        version = 0
        while await self._pause(self.o.update_every_s):
            mode = self.rng.choice(("abort", "keep", "wait"))
            body = {"version": version + 1, "path": f"ckpt-{version + 1}", "mode": mode}
            self.update_modes.setdefault(version + 1, set()).add(mode)  # before: replies may end under it first
            response = await http.post("/admin/weights", json=body, headers=ADMIN)
            if response.status_code in (200, 207):  # 207: a replica was down (killed); it is stale until it returns
                version += 1
                self.report.updates += 1
                self.report.update_modes[mode] += 1
            elif response.status_code == 503:
                self.report.retries["update 503"] += 1  # Redis (the coordination lock) is restarting
            elif self._loaded_nowhere(response, version):
                # Every replica was down or dropped its connections (kills): the documented 502, the gateway kept
                # the version it had; the next update asks for the same version again.
                self.report.retries["update 502"] += 1
            else:
                self.report.violations.append(f"weight update answered {response.status_code}: {response.text}")

    @staticmethod
    def _loaded_nowhere(response: httpx.Response, version: int) -> bool:
        """A 502 `weights_not_updated` that says the gateway still serves `version`."""
        if response.status_code != 502:
            return False
        error = response.json().get("error", {})
        return bool(error.get("code") == "weights_not_updated" and error.get("version") == version)

    async def _kills(self) -> None:
        while await self._pause(self.o.kill_every_s):
            victim = self.rng.choice(self.sims)
            async with self.sim_locks[id(victim)]:
                self.kill_times.append(time.monotonic())
                await asyncio.to_thread(victim.kill)  # SIGKILL: connections reset mid-generation
                self.report.kills += 1
                await asyncio.to_thread(victim.start)  # the same port, its initial weights

    async def _hangs(self) -> None:
        while await self._pause(self.o.hang_every_s):
            victim = self.rng.choice(self.sims)
            hang_s = self.rng.uniform(*self.o.hang_s)
            async with self.sim_locks[id(victim)]:
                pid = victim.pid
                assert pid is not None
                self.kill_times.append(time.monotonic())
                os.kill(pid, signal.SIGSTOP)  # hung: its connections stay open, nothing more comes
                self.report.hangs += 1
                try:
                    # The hang's length, not synchronisation: the replica stays stopped this long whatever happens.
                    await asyncio.sleep(hang_s)
                finally:
                    os.kill(pid, signal.SIGCONT)

    async def _redis_restart(self) -> None:
        """A restart of the one server; on a cluster, a master SIGKILLed, its replica promoted, and the killed node
        started again (it rejoins as the new master's replica: until then, finishes and weight records on that
        shard wait for a replica, `redis.durable_replicas`)."""
        if await self._pause((3.0, 6.0)):
            self.kill_times.append(time.monotonic())
            if self.cluster is not None:
                victim = await asyncio.to_thread(self.cluster.kill_master, 0)
                await asyncio.to_thread(self.cluster.wait_for_failover)
                await asyncio.to_thread(self.cluster.revive, victim)
            else:
                await self.redis.arestart()
            self.report.redis_restarts += 1

    async def _gateway_kill(self, child: GatewayChild) -> None:
        if await self._pause(self.o.gateway_kill_at_s):
            self.kill_times.append(time.monotonic())
            await asyncio.to_thread(child.kill)  # SIGKILL: its agents' connections drop mid-turn
            self.report.gateway_kills += 1
            await asyncio.to_thread(child.start)  # the same port, the same Redis

    async def _slow_readers(self, urls: list[str], http: httpx.AsyncClient) -> None:
        """Clients that start a streamed turn and stop reading (a tiny receive buffer, nothing read past the
        head): the gateway must go on at engine speed (a `wait` update never waits for them) and cut them, past
        `server.stream_buffer_budget_bytes` (STREAM_BUDGET_BYTES, all streams together) or a stalled send. Those
        to the child (every other one) ask `ignore_eos`; its cuts are read from its /metrics (`http`) as they come."""
        index = 0
        while await self._pause(self.o.slow_reader_every_s):
            await self._scrape_child_cuts(http, urls[1])
            heavy = index % len(urls) == 1  # to the child
            url = urlsplit(urls[index % len(urls)])
            body = orjson.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"slow {index}"}],
                    "max_tokens": 2500,  # with 20 top logprobs a token: ~5 MB, past what the kernel buffers
                    # To the child all of them, past the kernel's buffers and the budget (the simulator's EOS ended
                    # most answers before). Not to the in-process gateway: each such answer costs ~3 s of generation
                    # at full speed (an engine and a gateway encoding 20 top logprobs a token) before its cut, which
                    # there loaded the test's own event loop.
                    "ignore_eos": heavy,
                    "stream": True,
                    "logprobs": True,
                    "top_logprobs": 20,  # big events: the answer outgrows the socket buffers
                }
            )
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
                f"x-session-id: slow-{self.o.seed}-{index}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            index += 1
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
                await asyncio.get_running_loop().sock_sendall(sock, head + body)
            except OSError:
                sock.close()  # its gateway is down (the kill): no reader this time
                continue
            self.report.slow_readers += 1
            self._stalled.append(sock)  # closed at the end, unread

    async def _oversized_headers(self, urls: list[str]) -> None:
        """Requests with a 1 MiB header: each one must be refused with 431 while the agents go on."""
        async with httpx.AsyncClient(timeout=30) as client:
            index = 0
            while await self._pause(self.o.oversized_header_every_s):
                url = urls[index % len(urls)]
                index += 1
                try:
                    answer = await client.get(f"{url}/health", headers={"x-padding": "a" * (1 << 20)})
                except httpx.TransportError:
                    continue  # its gateway is down (the kill)
                self.report.oversized_headers += 1
                if answer.status_code != 431:
                    self.report.violations.append(f"a 1 MiB header answered {answer.status_code}, not 431")

    async def _trickled_bodies(self, urls: list[str]) -> None:
        """Clients that send a complete head with a Content-Length, then the body a byte at a time: each must be
        answered 408 `request_body_timeout` (and its connection closed) while the agents go on."""
        index = 0
        while await self._pause(self.o.trickle_every_s):
            url = urlsplit(urls[index % len(urls)])
            index += 1
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
                "content-length: 100000\r\n\r\n"
            ).encode()
            try:
                async with asyncio.timeout(TRICKLE_BOUND_S):
                    answer = await trickled_answer(url.hostname or "", url.port or 80, head)
            except TimeoutError:
                self.report.violations.append(f"a trickled body was not answered within {TRICKLE_BOUND_S:g} s")
                continue
            except OSError:
                continue  # its gateway is down (the kill): refused before the head
            head, _, body = answer.partition(b"\r\n\r\n")
            if not answer:
                self.report.trickled_bodies["closed"] += 1  # closed without an answer (its gateway killed)
            elif head.startswith(b"HTTP/1.1 408 ") and (not body or b"request_body_timeout" in body):
                self.report.trickled_bodies["408"] += 1
            else:
                self.report.violations.append(f"a trickled body answered {answer[:200]!r}, not 408")

    async def _tool_floods(self, url: str) -> None:
        """Requests whose tools carry megabytes of text (descriptions, or parameter schemas, in turn) to the gateway
        at `url`: each must be refused 400 `context_length_exceeded` within TOOL_FLOOD_BOUND_S while the agents go
        on."""
        count, size = TOOL_FLOOD
        bodies = [
            orjson.dumps({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": t})
            for t in (described_tools(count, size), schema_tools(count, size))
        ]
        # A thread's client: the 4 MB leave at the socket's pace, not a write per turn of this busy loop.
        with httpx.Client(timeout=60) as client:
            index = 0
            while await self._pause(self.o.tool_flood_every_s):
                body = bodies[index % len(bodies)]
                index += 1
                began = time.monotonic()
                try:
                    answer = await asyncio.to_thread(
                        client.post,
                        f"{url}/v1/chat/completions",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                except httpx.TransportError:
                    continue  # its gateway is down (the kill)
                took = time.monotonic() - began
                self.report.tool_floods += 1
                self.report.tool_flood_slowest_s = max(self.report.tool_flood_slowest_s, took)
                code = answer.json().get("error", {}).get("code") if answer.status_code == 400 else None
                if code != "context_length_exceeded":
                    self.report.violations.append(f"a tool flood answered {answer.status_code}: {answer.text[:200]}")
                elif took > TOOL_FLOOD_BOUND_S:
                    self.report.violations.append(f"a tool flood was refused after {took:.1f} s")

    async def _scrape_child_cuts(self, http: httpx.AsyncClient, url: str) -> None:
        """Read the child's slow-client cuts; a count lower than the last read means it restarted (its kill)."""
        cuts = await scrape_cuts(http, url)
        if cuts is None:
            return  # down (the kill): read next time
        if any(cuts[cause] < count for cause, count in self._child_cuts.items()):
            self._child_cuts_before += self._child_cuts
        self._child_cuts = cuts

    # -- the trainer ---------------------------------------------------------------------------

    async def _trainer(
        self, consumer: TrajectoryConsumer, delivered: Counter[str], trajectories: list[Trajectory]
    ) -> None:
        await consume_trajectories(
            consumer,
            delivered,
            trajectories,
            self.agents_done,
            self.acked,
            self.deadline + 90,
            self.report.retries,
            self.trainer_errors,
        )

    # -- the verdict ---------------------------------------------------------------------------

    def _verdict(self, delivered: Counter[str], trajectories: list[Trajectory]) -> None:
        judge_delivery(self.report, self.acked, delivered, trajectories)


async def consume_trajectories(
    consumer: TrajectoryConsumer,
    delivered: Counter[str],
    trajectories: list[Trajectory],
    agents_done: asyncio.Event,
    acked: set[str],
    hard_stop: float,
    retries: Counter[str],
    errors: Counter[str] | None = None,
) -> None:
    """The trainer: read and acknowledge trajectories into `delivered` (per session) and `trajectories` until the
    agents are done and every session in `acked` arrived, or nothing came for 10 s, or `hard_stop` (monotonic)."""
    quiet_since: float | None = None
    while time.monotonic() < hard_stop:
        try:
            batch = await consumer.next_batch(64, timeout=0.5)
            if batch.trajectories:
                await consumer.ack(batch)
        except StoreError as exc:
            retries["trainer StoreError"] += 1  # Redis restarting: read again
            if errors is not None:
                errors[str(exc)[:120]] += 1  # what the reads failed on, for a failure's report
            await asyncio.sleep(0.05)  # not a busy loop while Redis is away
            continue
        for trajectory in batch.trajectories:
            delivered[trajectory.session_id] += 1  # counted only once acknowledged
            trajectories.append(trajectory)
        if not agents_done.is_set() or batch.trajectories:
            quiet_since = None
            continue
        quiet_since = quiet_since or time.monotonic()
        if acked <= set(delivered) or time.monotonic() - quiet_since > 10:
            return


def judge_delivery(r: SoakReport, acked: set[str], delivered: Counter[str], trajectories: list[Trajectory]) -> None:
    """Fill `r`'s delivery figures: sessions lost (finish acknowledged, never delivered) or duplicated, and every
    sample checked token by token against the simulator (`check_sample`)."""
    r.delivered = len(delivered)
    r.lost = len(acked - set(delivered))
    r.duplicated = sum(count - 1 for count in delivered.values())
    for session in sorted(set(delivered) - acked):
        r.violations.append(f"{session}: delivered but its finish was never acknowledged")
    for trajectory in trajectories:
        for index, sample in enumerate(trajectory.samples):
            where = f"{trajectory.session_id} sample {index}"
            r.violations += [f"{where}: {v}" for v in check_sample(sample)]
            r.samples_checked += 1
            r.tokens_checked += int(sample.loss_mask.sum())
            r.samples_spanning_updates += len(set(sample.model_versions.tolist())) > 1
            # A segment cut by a crash before the engine sent its experts leaves them unknown: the sample then
            # has none (never misaligned ones). Counted and printed; see docs/reliability.md.
            r.samples_without_experts += sample.routed_experts is None


async def create_turn(
    api: openai.AsyncOpenAI, session: str | None, messages: list[dict[str, Any]], max_tokens: int, stream: bool
) -> tuple[str, str | None, list[int]]:
    """One chat turn through the official client: the reply's text, finish reason and per-token weight versions
    (the vendor field `rollout`). `session` goes in `X-Session-ID`; None: the client's base URL names it."""
    kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if session is not None:
        kwargs["extra_headers"] = {"X-Session-ID": session}
    if not stream:
        chat = await api.chat.completions.create(**kwargs)
        return chat.choices[0].message.content or "", chat.choices[0].finish_reason, reply_versions(chat)
    text, finish, versions = "", None, []
    async with await api.chat.completions.create(**kwargs, stream=True) as chunks:
        async for chunk in chunks:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
            versions = reply_versions(chunk) or versions
    return text, finish, versions


async def scrape_cuts(http: httpx.AsyncClient, url: str) -> Counter[str] | None:
    """A gateway's `rollout_gateway_slow_clients_cut_total` by cause, from its /metrics; None if it did not answer."""
    try:
        answer = await http.get(f"{url}/metrics")
    except httpx.TransportError:
        return None
    cuts: Counter[str] = Counter()
    for family in text_string_to_metric_families(answer.text):
        if family.name == "rollout_gateway_slow_clients_cut":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    cuts[sample.labels["cause"]] += int(sample.value)
    return cuts


async def trickled_answer(host: str, port: int, head: bytes) -> bytes:
    """Send `head`, then its body a byte every 0.25 s until the gateway answers; what it sent until it closed the
    connection (empty if it closed it without an answer, or reset it)."""
    reader, writer = await asyncio.open_connection(host, port)

    async def trickle() -> None:
        with contextlib.suppress(OSError):  # the gateway closed the connection: the answer says why
            writer.write(head)
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.25)  # the trickle's pace, not synchronisation

    sending = asyncio.create_task(trickle())
    try:
        try:
            answer = await reader.readuntil(b"\r\n\r\n")  # the answer's head
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except ConnectionResetError:
            return b""
        sending.cancel()  # no byte more: what follows the head arrives before any reset our bytes could cause
        with contextlib.suppress(OSError):
            answer += await reader.read(-1)  # its body, until the gateway closes the connection
        return answer
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def described_tools(count: int, size: int) -> list[dict[str, Any]]:
    """`count` tools of `size` characters of description each."""
    return [
        {"type": "function", "function": {"name": f"f{i}", "description": "word " * (size // 5)}} for i in range(count)
    ]


def schema_tools(count: int, size: int) -> list[dict[str, Any]]:
    """`count` tools whose parameter schema holds about `size` characters."""
    properties = {f"p{j}": {"type": "string", "description": "word " * 100} for j in range(size // 540)}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": properties}}}
        for i in range(count)
    ]


def check_wait_span(
    session: str, versions: list[int], began: float, fault_times: list[float], update_modes: dict[int, set[str]]
) -> tuple[bool, list[str]]:
    """Whether a reply's per-token `versions` span an update with no fault to explain it, and the violations: a
    reply whose tokens span a `wait` update was cut by it, unless a fault (`fault_times`, monotonic: a replica or
    gateway kill, a Redis restart) shortly before or during the turn explains its resume: `wait` lets every
    in-flight request end first, on every gateway. `update_modes`: the modes of the updates that asked for each
    version."""
    changes = [(a, b) for a, b in itertools.pairwise(versions) if a != b]
    # A fault shortly before the turn counts too: a hung replica is taken out a probe's timeout after its stop.
    if not changes or any(began - FAULT_REACH_S <= at for at in fault_times):
        return False, []
    return True, [
        f"{session}: one reply spans the wait update v{old} -> v{new}"
        for old, new in changes
        if all(update_modes.get(v) == {"wait"} for v in range(old + 1, new + 1))
    ]


def gateway_settings(
    sims: list[SimProcess], redis_url: str, port: int = 0, stream_partitions: int = 1
) -> dict[str, Any]:
    """A soak gateway's configuration over `sims` (one per dialect of `DIALECTS`), as the keyword arguments of
    `Settings` (a child's YAML file too)."""
    replicas = [
        ReplicaConfig(
            url=s.url,
            backend="sim",
            dialect=d,
            routed_experts=True,
            routed_experts_shape=EXPERTS_SHAPE if d == "sglang" else None,
        ).model_dump(mode="json", exclude_none=True)
        for s, d in zip(sims, DIALECTS, strict=True)
    ]
    return {
        # A client that stops reading is cut after 2 s (60 s by default): the soak's slow readers meet the limit.
        "server": {"port": port, "admin_token": ADMIN_TOKEN, "slow_client_timeout_s": 2.0},
        "redis": {"url": redis_url, "retry_budget_s": 60},
        "replicas": replicas,
        "routing": {"health_interval_s": 0.2, "circuit_open_s": 1.0},
        "generation": {"max_wait_s": 60, "request_timeout_s": 120},
        "store": {"stream_partitions": stream_partitions},
        # The staleness budget is on (the soak's trainer publishes its batch size, so every admission runs its
        # script, through the Redis faults too) and never binds: a soak session spans many updates on purpose.
        "weights": {"max_staleness": 1000},
    }


@dataclass
class Front:
    """One gateway as the agents reach it."""

    http: httpx.AsyncClient
    api: openai.AsyncOpenAI

    @classmethod
    def to(cls, url: str, limits: httpx.Limits) -> Front:
        http = httpx.AsyncClient(base_url=url, timeout=120, limits=limits)
        return cls(http, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http))


@dataclass
class Route:
    """The gateway an agent talks to: the `index`-th, round robin; a connection error moves it on to the next, as
    a load balancer would."""

    fronts: list[Front]
    index: int

    @property
    def front(self) -> Front:
        return self.fronts[self.index % len(self.fronts)]

    def fail_over(self) -> None:
        self.index += 1


class GatewayChild:
    """The second gateway: `rollout-gateway serve` in a process of its own, on a fixed port, configured by a YAML
    file, so that it can be SIGKILLed and started again where agents expect it."""

    def __init__(self, settings: dict[str, Any], folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.config = folder / "config.yaml"
        self.config.write_text(yaml.safe_dump(settings))
        self.log = folder / "serve.log"
        self.url = f"http://127.0.0.1:{settings['server']['port']}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 100.0) -> None:
        """Start `serve` and wait for its health (generous: under pytest-xdist the heavy tests load the machine, and a
        gateway's imports then took over a minute once); a child that does not come up is killed, never left to
        outlive its test."""
        with self.log.open("ab") as log:  # the child keeps its own descriptor
            command = [
                *CLI,
                "serve",
                "--config",
                str(self.config),
                "--log-level",
                os.environ.get("RG_CHILD_LOG", "warning"),
            ]
            self.process = process = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            if process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the child gateway did not come up; its log ends:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()


def reply_versions(answer: openai.BaseModel) -> list[int]:
    """The per-token weight versions of the first choice, from the vendor field `rollout` (empty when absent)."""
    rollout = (answer.model_extra or {}).get("rollout") or {}
    choices = rollout.get("choices") or [{}]
    return list(choices[0].get("versions") or [])


def weights_of(version: int) -> tuple[str, str]:
    """The simulator's (weights identity, label) once the soak published `version` from `ckpt-<version>`."""
    return ("init", "default") if version == 0 else (f"ckpt-{version}", str(version))


def check_sample(sample: Sample) -> list[str]:
    """Every way `sample` can disagree with the simulator's deterministic reference."""
    problems: list[str] = []
    ids = sample.prompt_ids.tolist() + sample.response_ids.tolist()
    mask, versions = sample.loss_mask.tolist(), sample.versions.tolist()
    logprobs = sample.logprobs.tolist()
    if any(v != ENV_VERSION for v, m in zip(versions, mask, strict=True) if not m):
        problems.append("an environment token carries a model version")
    if any(lp != 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m):
        problems.append("an environment token carries a logprob")
    model = sample.model_versions.tolist()
    if model != sorted(model):
        problems.append(f"versions decrease: {model}")
    problems += _check_spans(sample, ids, mask, versions, logprobs)
    experts = sample.routed_experts
    if experts is not None and experts.shape != (len(ids) - 1, *EXPERTS_SHAPE):
        problems.append(f"routed experts shape {experts.shape} for {len(ids)} tokens")
    return problems


def _check_spans(
    sample: Sample, ids: list[int], mask: list[int], versions: list[int], logprobs: list[float]
) -> list[str]:
    """Each run of sampled tokens must be what the simulator draws from the ids before it, token by token under
    the version recorded for that token (a continuation after a resume included)."""
    problems: list[str] = []
    tokens = TokenModel(SHAPE)
    offset = len(sample.prompt_ids)
    position = 0
    while position < len(mask):
        if not mask[position]:
            position += 1
            continue
        state = PREFIX_HASH_START
        for token in ids[: offset + position]:
            state = extend_prefix_hash(state, token)
        while position < len(mask) and mask[position]:
            key = tokens.sample_key(weights_key(*weights_of(versions[position])), 0)
            draw = tokens.draw(state, key, allow_eos=True)
            actual = ids[offset + position]
            if draw.token != actual:
                context = versions[max(0, position - 3) : position + 3]
                matching = [
                    v
                    for v in range(0, 64)
                    if tokens.draw(state, tokens.sample_key(weights_key(*weights_of(v)), 0), allow_eos=True).token
                    == actual
                ]
                return [
                    f"token {position} is {actual}, the reference under v{versions[position]} is {draw.token} "
                    f"(versions around it {context}, {sample.num_turns} turns, cancelled {sample.cancelled}; "
                    f"the versions that draw it: {matching})"
                ]
            if not np.isclose(draw.logprob, logprobs[position], atol=1e-4):
                problems.append(f"logprob {position} is {logprobs[position]}, the reference {draw.logprob}")
            state = extend_prefix_hash(state, actual)
            position += 1
    return problems
