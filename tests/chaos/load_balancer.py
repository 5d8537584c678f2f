"""Three gateways behind HAProxy (issue 37 §2): multi-turn agent sessions through the official `openai` client reach
three `rollout-gateway serve` processes on one Redis only through HAProxy, which runs the shipped
`docker/haproxy/haproxy.cfg` (round robin per request, health checks on `/ready`; addresses from the environment).
The trainer posts weight updates through HAProxy too, so they land on any gateway and are coordinated across all
three (the Redis lock and bus). One gateway is SIGKILLed mid-run and restarted on its port.

Half the agents name their session with `X-Session-ID`, half with the `/sessions/{id}/v1` base URL; no
stickiness: every turn may land on another gateway. The verdict: every turn done with at most one failed attempt
(the one in flight on the killed gateway), no session lost or delivered twice on the trainer side
(`TrajectoryConsumer`), every sampled token the simulator's under the version it records (`check_sample`), no
reply across a `wait` update, and every gateway on the last version at the end.

The Redis URL is a parameter: the harness runs on whatever Redis the test hands it. One seed drives every random
choice (`RG_LB_SEED=<seed>` replays a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import os
import random
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from backends.sim.server import SimProcess
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import Trajectory
from rollout_cli.redis_cluster import LocalRedisCluster
from tests.chaos.soak import (
    ADMIN,
    DIALECTS,
    GatewayChild,
    SoakReport,
    check_wait_span,
    consume_trajectories,
    create_turn,
    gateway_settings,
    judge_delivery,
)
from tests.cli_helpers import free_port

HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "docker" / "haproxy" / "haproxy.cfg"
GATEWAYS = 3  # the `server` lines of HAPROXY_CONFIG


@dataclass(frozen=True)
class LoadBalancerOptions:
    seed: int = 11
    sessions: int = 48
    turns: tuple[int, int] = (2, 4)
    max_tokens: tuple[int, int] = (4, 48)
    token_delay_s: float = 0.002
    stream_rate: float = 0.5
    duration_s: float = 40.0  # hard bound on the agents' phase
    update_every_s: tuple[float, float] = (0.8, 1.6)
    kill_at_s: tuple[float, float] = (2.0, 4.0)  # when the gateway is SIGKILLed, after the agents start
    master_kill_at_s: tuple[float, float] = (5.0, 8.0)  # on a cluster: when a master is SIGKILLed
    # The least a run must go through: agents go on past their planned turns until the killed gateway is back in
    # HAProxy's rotation and this many updates were coordinated after that (within 80 % of `duration_s`).
    # 8 updates, each reaching any of the three gateways: all on one gateway has a chance of 3 in 3^8.
    min_updates: int = 8
    min_updates_after_return: int = 2


@dataclass
class LoadBalancerReport(SoakReport):
    failed_attempts: Counter[str] = field(default_factory=Counter)  # agent-visible failures, by kind
    failed_attempts_after_kill: int = 0  # ... of attempts sent after the kill (HAProxy should have hidden them)
    failures: list[str] = field(default_factory=list)  # each failed attempt: kind, sent and failed (from the kill)
    retried_turns: int = 0
    most_failures_in_a_turn: int = 0
    most_retried_turns_in_a_session: int = 0
    restart_s: float = 0.0  # SIGKILL → the new process answers /health
    out_of_rotation_s: float | None = None  # SIGKILL → HAProxy marks it DOWN
    back_in_rotation_s: float | None = None  # SIGKILL → HAProxy marks it UP again
    updates_by_gateway: Counter[str] = field(default_factory=Counter)
    longest_update_s: float = 0.0
    update_times: list[str] = field(default_factory=list)  # each update: mode, seconds taken, when after the kill
    requests_by_gateway: dict[str, int] = field(default_factory=dict)  # HAProxy's count, per server
    fallback_requests: int = 0  # sent to `gateways-alive` while no gateway was ready
    final_versions: dict[str, int] = field(default_factory=dict)

    def lb_figures(self) -> str:
        parts = [
            f"seed {self.seed}: sessions {self.sessions} (finish acknowledged {self.sessions_acked})",
            f"turns {self.turns}, retried turns {self.retried_turns} (failed attempts {dict(self.failed_attempts)}, "
            f"{self.failed_attempts_after_kill} sent after the kill: {'; '.join(self.failures)}; at most "
            f"{self.most_failures_in_a_turn} in a turn, {self.most_retried_turns_in_a_session} retried turns in a "
            "session)",
            f"gateway kills {self.gateway_kills}: restarted in {self.restart_s:.2f}s, out of HAProxy's rotation "
            f"after {_seconds(self.out_of_rotation_s)}, back after {_seconds(self.back_in_rotation_s)}",
            f"weight updates {self.updates} {dict(self.update_modes)} coordinated by "
            f"{dict(self.updates_by_gateway)} (longest {self.longest_update_s:.2f}s: {'; '.join(self.update_times)})",
            f"Redis masters killed {self.redis_restarts}",
            f"requests per gateway {self.requests_by_gateway}, while none was ready {self.fallback_requests}",
            f"final versions {self.final_versions}",
            f"delivered {self.delivered}, lost {self.lost}, duplicated {self.duplicated}",
            f"samples checked {self.samples_checked} ({self.tokens_checked} sampled tokens, "
            f"{self.samples_spanning_updates} spanning an update)",
            f"replies spanning an update without a fault {self.turns_spanning_updates}",
            f"other retries {dict(self.retries)}, violations {len(self.violations)}, {self.elapsed_s:.0f}s",
        ]
        return "; ".join(parts)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}s"


class HAProxy:
    """`haproxy` running HAPROXY_CONFIG as shipped, its addresses set through the environment."""

    def __init__(self, gateways: list[str], folder: Path) -> None:
        assert len(gateways) == GATEWAYS
        self.binary = shutil.which("haproxy") or "haproxy"
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats_url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        self.env = {
            **os.environ,
            "HAPROXY_BIND": f"127.0.0.1:{self.port}",
            "HAPROXY_STATS_BIND": f"127.0.0.1:{self.stats_port}",
        }
        self.env.update({f"GATEWAY_{i + 1}": address for i, address in enumerate(gateways)})
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "haproxy.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until every gateway is UP in its rotation."""
        with self.log.open("ab") as log:
            command = [self.binary, "-W", "-db", "-f", str(HAPROXY_CONFIG)]
            self.process = process = subprocess.Popen(command, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                states = parse_stats(httpx.get(self.stats_url, timeout=1).text)
                if all(states.get(("gateways", f"gateway-{i + 1}"), {}).get("status") == "UP" for i in range(3)):
                    return
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy did not put the gateways in rotation; its log ends:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def parse_stats(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """HAProxy's CSV statistics, by (proxy, server)."""
    rows = csv.DictReader(io.StringIO(text.removeprefix("# ")))
    return {(row["pxname"], row["svname"]): row for row in rows}


class LoadBalancerSoak:
    def __init__(
        self,
        options: LoadBalancerOptions,
        redis_url: str,
        folder: Path,
        cluster: LocalRedisCluster | None = None,
        kill_a_master: bool = False,
    ) -> None:
        self.o = options
        self.cluster = cluster  # a Redis Cluster: 3 stream partitions
        self.kill_a_master = kill_a_master and cluster is not None  # ... and one of its masters SIGKILLed mid-run
        self.stream_partitions = 3 if cluster is not None else 1
        self.rng = random.Random(options.seed)
        self.redis_url = redis_url
        self.folder = folder
        self.report = LoadBalancerReport(seed=options.seed, sessions=options.sessions)
        args = ["--token-delay", str(options.token_delay_s), "--enable-return-routed-experts"]
        self.sims = [SimProcess(["--dialect", d, *args]) for d in DIALECTS]
        self.children: list[GatewayChild] = []
        self.haproxy: HAProxy | None = None
        self.acked: set[str] = set()
        self.update_modes: dict[int, set[str]] = {}
        self.kill_times: list[float] = []
        self.kill_lock = asyncio.Lock()  # a kill never lands inside an update (see docs/serving.md)
        self.back_in_rotation = asyncio.Event()
        self.updates_after_return = 0
        self.agents_done = asyncio.Event()
        self.deadline = 0.0

    async def run(self) -> LoadBalancerReport:
        started = time.monotonic()
        try:
            await asyncio.gather(*(asyncio.to_thread(sim.start) for sim in self.sims))
            for i in range(GATEWAYS):
                settings = gateway_settings(
                    self.sims, self.redis_url, port=free_port(), stream_partitions=self.stream_partitions
                )
                self.children.append(GatewayChild(settings, self.folder / f"gateway-{i + 1}"))
            await asyncio.gather(*(asyncio.to_thread(child.start) for child in self.children))
            addresses = [child.url.removeprefix("http://") for child in self.children]
            self.haproxy = HAProxy(addresses, self.folder / "haproxy")
            await asyncio.to_thread(self.haproxy.start)
            await self._run(self.haproxy)
        finally:
            if self.haproxy is not None:
                await asyncio.to_thread(self.haproxy.stop)
            await asyncio.gather(*(asyncio.to_thread(child.stop) for child in self.children))
            await asyncio.gather(*(asyncio.to_thread(sim.stop) for sim in self.sims))
            self._print_gateway_warnings()  # shown with a failure (pytest keeps a passing test's output to itself)
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    def _print_gateway_warnings(self, most: int = 40) -> None:
        """Each gateway's last warnings and errors (its log is in the test's tmp folder, gone from a CI run)."""
        noise = ("streams cumulative events", "gateway.config.environment ignoring")
        for i, child in enumerate(self.children):
            lines = child.log.read_text(errors="replace").splitlines() if child.log.exists() else []
            kept = [
                line
                for line in lines
                if (" WARNING " in line or " ERROR " in line or line.startswith(("Traceback", "  File", "E ")))
                and not any(n in line for n in noise)
            ]
            print(f"gateway-{i + 1}: last {min(most, len(kept))} of {len(kept)} warnings and errors")
            for line in kept[-most:]:
                print(f"  {line[:300]}")

    async def _run(self, haproxy: HAProxy) -> None:
        self.deadline = time.monotonic() + self.o.duration_s
        limits = httpx.Limits(max_connections=2 * self.o.sessions, max_keepalive_connections=2 * self.o.sessions)
        async with contextlib.AsyncExitStack() as stack:
            agents_http = await stack.enter_async_context(httpx.AsyncClient(timeout=120, limits=limits))
            trainer_http = await stack.enter_async_context(httpx.AsyncClient(base_url=haproxy.url, timeout=120))
            consumer = await stack.enter_async_context(
                TrajectoryConsumer(self.redis_url, "lb", "trainer-0", claim_idle_s=5)
            )
            delivered: Counter[str] = Counter()
            trajectories: list[Trajectory] = []
            trainer = asyncio.create_task(
                consume_trajectories(
                    consumer, delivered, trajectories, self.agents_done, self.acked, self.deadline + 60,
                    self.report.retries,
                )
            )  # fmt: skip
            victim = self.rng.randrange(GATEWAYS)
            chaos = [
                asyncio.create_task(self._updates(trainer_http)),
                asyncio.create_task(self._gateway_kill(victim)),
                asyncio.create_task(self._watch_rotation(haproxy, victim)),
                asyncio.create_task(self._master_kill()),
            ]
            seeds = [self.rng.getrandbits(32) for _ in range(self.o.sessions)]
            await asyncio.gather(
                *(self._session(agents_http, haproxy.url, i, seeds[i]) for i in range(self.o.sessions))
            )
            self.agents_done.set()
            for task in chaos:
                await task  # each ends at agents_done; an exception in one is a failure of the run
            await asyncio.wait_for(trainer, timeout=90)
            await self._read_ends(agents_http, haproxy)
        judge_delivery(self.report, self.acked, delivered, trajectories)

    async def _read_ends(self, http: httpx.AsyncClient, haproxy: HAProxy) -> None:
        """Each gateway's version (asked directly, not through HAProxy) and HAProxy's request counts."""
        for i, child in enumerate(self.children):
            health = (await http.get(f"{child.url}/health")).json()
            self.report.final_versions[f"gateway-{i + 1}"] = health["version"]
        stats = parse_stats((await http.get(haproxy.stats_url)).text)
        for (proxy, server), row in stats.items():
            if proxy == "gateways" and server.startswith("gateway-"):
                self.report.requests_by_gateway[server] = int(row["stot"])
            if proxy == "gateways-alive" and server == "BACKEND":
                self.report.fallback_requests = int(row["stot"])

    # -- the agents ----------------------------------------------------------------------------

    async def _session(self, http: httpx.AsyncClient, url: str, index: int, seed: int) -> None:
        rng = random.Random(seed)
        session = f"lb-{self.o.seed}-{index}"
        by_path = index % 2 == 1  # the session in the base URL; otherwise in X-Session-ID
        base_url = f"{url}/sessions/{session}/v1" if by_path else f"{url}/v1"
        api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}: {rng.random():.6f}"}]
        planned, turn, retried = rng.randint(*self.o.turns), 0, 0
        while turn < planned or self._chaos_pending():
            outcome = await self._turn(api, None if by_path else session, session, messages, rng)
            if outcome is None:
                return  # gave up inside the bound: the session is simply never finished
            reply, failures = outcome
            retried += failures > 0
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on {turn}"}]
            turn += 1
        r = self.report
        r.most_retried_turns_in_a_session = max(r.most_retried_turns_in_a_session, retried)
        if await self._finish(http, f"{url}/v1/sessions/{session}/finish", session, rng.random()):
            self.acked.add(session)
            r.sessions_acked += 1

    async def _turn(
        self,
        api: openai.AsyncOpenAI,
        header_session: str | None,
        session: str,
        messages: list[dict[str, Any]],
        rng: random.Random,
    ) -> tuple[str, int] | None:
        """The reply and how many attempts failed before it; None when it did not come within the bound."""
        max_tokens = rng.randint(*self.o.max_tokens)
        stream = rng.random() < self.o.stream_rate
        failures = 0
        while time.monotonic() < self.deadline:
            began = time.monotonic()
            try:
                content, finish, versions = await create_turn(api, header_session, messages, max_tokens, stream)
            except openai.APIStatusError as exc:
                if exc.status_code not in (502, 503, 504):
                    self.report.violations.append(f"{session}: HTTP {exc.status_code}: {exc.message}")
                    return None
                failures += self._failed(f"HTTP {exc.status_code}", began)
                await asyncio.sleep(0.1)  # back off before retrying, not synchronisation
                continue
            except (openai.APIConnectionError, openai.APITimeoutError, httpx.TransportError) as exc:
                failures += self._failed(type(exc).__name__, began)
                continue
            if finish not in ("stop", "length"):
                self.report.violations.append(f"{session}: agent-visible finish_reason {finish!r}")
            spans, violations = check_wait_span(session, versions, began, self.kill_times, self.update_modes)
            self.report.turns_spanning_updates += spans
            self.report.violations += violations
            r = self.report
            r.turns += 1
            r.retried_turns += failures > 0
            r.most_failures_in_a_turn = max(r.most_failures_in_a_turn, failures)
            return content, failures
        self.report.violations.append(f"{session}: turn not done within the run's bound")
        return None

    def _failed(self, kind: str, began: float) -> int:
        self.report.failed_attempts[kind] += 1
        if self.kill_times:
            killed = self.kill_times[0]
            self.report.failures.append(f"{kind} {began - killed:+.2f}s..{time.monotonic() - killed:+.2f}s")
        else:
            self.report.failures.append(f"{kind} before the kill")
        self.report.failed_attempts_after_kill += any(began > at for at in self.kill_times)
        return 1

    async def _finish(self, http: httpx.AsyncClient, url: str, session: str, reward: float) -> bool:
        while time.monotonic() < self.deadline:
            try:
                response = await http.post(url, json={"reward": reward})
            except httpx.TransportError as exc:
                self.report.retries[f"finish {type(exc).__name__}"] += 1
                continue
            if response.status_code == 200:
                return True
            if response.status_code not in (502, 503, 504):
                self.report.violations.append(f"{session}: finish answered {response.status_code}: {response.text}")
                return False
            self.report.retries[f"finish {response.status_code}"] += 1
            await asyncio.sleep(0.1)  # back off before retrying, not synchronisation
        self.report.violations.append(f"{session}: finish not acknowledged within the run's bound")
        return False

    def _chaos_pending(self) -> bool:
        done = (
            self.back_in_rotation.is_set()
            and (not self.kill_a_master or self.report.redis_restarts >= 1)
            and self.updates_after_return >= self.o.min_updates_after_return
            and self.report.updates >= self.o.min_updates
        )
        return not done and time.monotonic() < self.deadline - self.o.duration_s / 5

    # -- the trainer's updates and the kill ----------------------------------------------------

    async def _pause(self, bounds: tuple[float, float]) -> bool:
        """Wait a random time in `bounds`; False once the agents are done."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.agents_done.wait(), self.rng.uniform(*bounds))
        return not self.agents_done.is_set()

    async def _updates(self, http: httpx.AsyncClient) -> None:
        """`POST /admin/weights` through HAProxy: whichever gateway it reaches coordinates the update."""
        version = 0
        while await self._pause(self.o.update_every_s):
            mode = self.rng.choice(("abort", "keep", "wait"))
            body = {"version": version + 1, "path": f"ckpt-{version + 1}", "mode": mode}
            async with self.kill_lock:
                self.update_modes.setdefault(version + 1, set()).add(mode)  # before: replies may end under it first
                began = time.monotonic()
                response = await http.post("/admin/weights", json=body, headers=ADMIN)
                took = time.monotonic() - began
            if response.status_code == 503:  # Redis (the coordination lock) is failing over: the trainer retries
                self.report.retries["update 503"] += 1
                continue
            if response.status_code != 200:
                self.report.violations.append(f"weight update answered {response.status_code}: {response.text}")
                continue
            version += 1
            r = self.report
            r.updates += 1
            r.update_modes[mode] += 1
            r.updates_by_gateway[response.headers.get("x-gateway", "?")] += 1
            r.longest_update_s = max(r.longest_update_s, took)
            since_kill = f"{began - self.kill_times[0]:+.1f}s from the kill" if self.kill_times else "before the kill"
            r.update_times.append(f"{mode} {took:.2f}s {since_kill}")
            self.updates_after_return += self.back_in_rotation.is_set()

    async def _gateway_kill(self, victim: int) -> None:
        if not await self._pause(self.o.kill_at_s):
            return
        child = self.children[victim]
        async with self.kill_lock:
            await asyncio.to_thread(child.kill)  # SIGKILL: its agents' connections drop mid-turn
            killed = time.monotonic()  # once it is dead (reaped): an attempt sent later must not fail
            self.kill_times.append(killed)
        self.report.gateway_kills += 1
        await asyncio.to_thread(child.start)  # the same port, the same Redis
        self.report.restart_s = time.monotonic() - killed

    async def _master_kill(self) -> None:
        """On a cluster: SIGKILL one master (inside an update or not), its replica takes over. Turns wait it out.
        The killed node is started again and rejoins as the new master's replica: finishes and weight records on
        that shard wait for one (`redis.durable_replicas`)."""
        if self.cluster is None or not self.kill_a_master or not await self._pause(self.o.master_kill_at_s):
            return
        victim = await asyncio.to_thread(self.cluster.kill_master, self.rng.randrange(3))
        await asyncio.to_thread(self.cluster.wait_for_failover)
        await asyncio.to_thread(self.cluster.revive, victim)
        self.report.redis_restarts += 1

    async def _watch_rotation(self, haproxy: HAProxy, victim: int) -> None:
        """Follow HAProxy's view of the victim: when it leaves the rotation after the kill, and when it returns."""
        key = ("gateways", f"gateway-{victim + 1}")
        async with httpx.AsyncClient(timeout=2) as http:
            while not self.agents_done.is_set():
                await asyncio.sleep(0.05)  # a poll's period, not synchronisation
                if not self.kill_times or self.back_in_rotation.is_set():
                    continue
                with contextlib.suppress(httpx.TransportError):
                    status = parse_stats((await http.get(haproxy.stats_url)).text)[key]["status"]
                    since = time.monotonic() - self.kill_times[0]
                    if status.startswith("DOWN") and self.report.out_of_rotation_s is None:
                        self.report.out_of_rotation_s = since
                    # Back: UP after it was seen DOWN, or UP once restarted if it was never seen DOWN (a restart
                    # faster than the checks that take it out).
                    elif status == "UP" and (self.report.out_of_rotation_s is not None or self.report.restart_s):
                        self.report.back_in_rotation_s = since
                        self.back_in_rotation.set()
