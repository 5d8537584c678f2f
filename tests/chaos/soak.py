"""The chaos soak: hundreds of multi-turn agent sessions through the official `openai` client while weight
updates fire every 1-2 s (random modes), simulator replicas (real processes) are SIGKILLed and restarted, or hang
a few seconds (SIGSTOP, then SIGCONT), Redis restarts once and clients disconnect mid-turn. The verdict is read
from the trainer side.

Everything is on loopback, every loop is bounded in count and time, and one seed drives every random choice
(printed, so a failure can be replayed: `RG_CHAOS_SEED=<seed> python -m pytest tests/chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from backends.sim.model import PREFIX_HASH_START, ModelShape, TokenModel, extend_prefix_hash, weights_key
from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import StoreError
from gateway.server import RunningGateway, serve_gateway
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import ENV_VERSION, Sample, Trajectory

ADMIN_TOKEN = "chaos-admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
SHAPE = ModelShape()
DIALECTS = ("vllm", "sglang", "vllm")
EXPERTS_SHAPE = (2, 2)  # the simulator's default (layers, top_k)


@dataclass(frozen=True)
class SoakOptions:
    seed: int = 7
    sessions: int = 300
    turns: tuple[int, int] = (2, 3)
    max_tokens: tuple[int, int] = (4, 16)
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
    # The simulators' prefix cache, so that a request admitted after an update onto KV of older weights shows up as
    # tokens no version draws (see docs/reliability.md). RG_CHAOS_PREFIX_CACHE=0 turns it off.
    prefix_cache: bool = True


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
            f"client disconnects {self.disconnects}, "
            f"resumes {self.resumes} (segments cut {dict(self.segments_cut)}), delivered {self.delivered}, "
            f"lost {self.lost}, duplicated {self.duplicated}, "
            f"samples checked {self.samples_checked} ({self.tokens_checked} sampled tokens, "
            f"{self.samples_spanning_updates} spanning an update, {self.samples_without_experts} without routed "
            f"experts), documented 503s {self.documented_503}, "
            f"client retries {dict(self.retries)}, violations {len(self.violations)}, {self.elapsed_s:.0f}s"
        )


class Soak:
    def __init__(self, options: SoakOptions, data_dir: Path) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.report = SoakReport(seed=options.seed, sessions=options.sessions)
        self.redis = EmbeddedRedis(data_dir=data_dir)
        args = ["--token-delay", str(options.token_delay_s), "--enable-return-routed-experts"]
        if not options.prefix_cache:
            args += ["--cache-blocks", "0"]
        self.sims = [SimProcess(["--dialect", d, *args]) for d in DIALECTS]
        # A kill and a hang never act on one replica at once (a SIGCONT must reach the process it stopped).
        self.sim_locks = {id(sim): asyncio.Lock() for sim in self.sims}
        self.acked: set[str] = set()
        self.agents_done = asyncio.Event()
        self.deadline = 0.0

    # -- setup ---------------------------------------------------------------------------------

    def settings(self) -> Settings:
        replicas = [
            ReplicaConfig(
                url=s.url,
                backend="sim",
                dialect=d,  # type: ignore[arg-type]
                routed_experts=True,
                routed_experts_shape=EXPERTS_SHAPE if d == "sglang" else None,
            )
            for s, d in zip(self.sims, DIALECTS, strict=True)
        ]
        return Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            redis={"url": self.redis.url, "retry_budget_s": 60},
            replicas=replicas,
            routing={"health_interval_s": 0.2, "circuit_open_s": 1.0},
            generation={"max_wait_s": 60, "request_timeout_s": 120},
        )

    async def run(self) -> SoakReport:
        started = time.monotonic()
        await self.redis.astart()
        try:
            for sim in self.sims:
                await asyncio.to_thread(sim.start)
            async with serve_gateway(self.settings()) as gw:
                await self._run(gw)
        finally:
            for sim in self.sims:
                await asyncio.to_thread(sim.stop)
            await self.redis.astop()
        self.report.elapsed_s = time.monotonic() - started
        return self.report

    async def _run(self, gw: RunningGateway) -> None:
        self.deadline = time.monotonic() + self.o.duration_s
        limits = httpx.Limits(max_connections=2 * self.o.sessions, max_keepalive_connections=2 * self.o.sessions)
        http = httpx.AsyncClient(base_url=gw.url, timeout=120, limits=limits)
        api = openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120, http_client=http
        )
        # The trainer's calls go through a client of their own, as a trainer's would. Sent on the agents' shared
        # pool (hundreds of connections), `POST /admin/weights` reached the gateway 4-5 s later and returned after
        # 4-11 s, for updates the gateway did in 0.1-0.6 s; from a client of its own it arrives within 0.15 s.
        trainer_http = httpx.AsyncClient(base_url=gw.url, timeout=120)
        async with (
            http,
            trainer_http,
            TrajectoryConsumer(self.redis.url, "chaos", "trainer-0", claim_idle_s=5) as consumer,
        ):
            delivered: Counter[str] = Counter()
            trajectories: list[Trajectory] = []
            trainer = asyncio.create_task(self._trainer(consumer, delivered, trajectories))
            chaos = [
                asyncio.create_task(self._updates(trainer_http)),
                asyncio.create_task(self._kills()),
                asyncio.create_task(self._hangs()),
                asyncio.create_task(self._redis_restart()),
            ]
            seeds = [self.rng.getrandbits(32) for _ in range(self.o.sessions)]
            await asyncio.gather(*(self._session(api, http, i, seeds[i]) for i in range(self.o.sessions)))
            self.agents_done.set()
            for task in chaos:
                await task  # each ends at agents_done; an exception in one is a failure of the soak
            await asyncio.wait_for(trainer, timeout=120)
            generator = gw.services.generator
            self.report.resumes = generator.resumes_total
            self.report.segments_cut.update(replica_out=generator.interrupted_total, stalled=generator.stalled_total)
        self._verdict(delivered, trajectories)

    # -- the agents ----------------------------------------------------------------------------

    async def _session(self, api: openai.AsyncOpenAI, http: httpx.AsyncClient, index: int, seed: int) -> None:
        rng = random.Random(seed)
        session = f"chaos-{self.o.seed}-{index}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}: {rng.random():.6f}"}]
        planned, turn = rng.randint(*self.o.turns), 0
        while turn < planned or self._chaos_pending():
            reply = await self._turn(api, session, messages, rng)
            if reply is None:
                return  # gave up inside the bound: the session is simply never finished
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on {turn}"}]
            turn += 1
        if await self._finish(http, session, rng.random()):
            self.acked.add(session)
            self.report.sessions_acked += 1

    async def _turn(
        self, api: openai.AsyncOpenAI, session: str, messages: list[dict[str, Any]], rng: random.Random
    ) -> str | None:
        max_tokens = rng.randint(*self.o.max_tokens)
        stream = rng.random() < self.o.stream_rate
        while time.monotonic() < self.deadline:
            call = asyncio.ensure_future(self._create(api, session, messages, max_tokens, stream))
            if rng.random() < self.o.disconnect_rate:
                await asyncio.wait({call}, timeout=rng.uniform(0.0, 0.1))
                if not call.done():  # the client leaves mid-turn: the connection closes, the agent retries
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await call
                    self.report.disconnects += 1
                    continue
            try:
                content, finish = await call
            except openai.APIStatusError as exc:
                if not self._retryable_status(exc):
                    self.report.violations.append(f"{session}: HTTP {exc.status_code}: {exc.message}")
                    return None
                continue
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                self.report.retries[type(exc).__name__] += 1
                continue
            if finish not in ("stop", "length", "tool_calls"):
                self.report.violations.append(f"{session}: agent-visible finish_reason {finish!r}")
            self.report.turns += 1
            return content
        self.report.violations.append(f"{session}: turn not done within the soak's bound")
        return None

    def _chaos_pending(self) -> bool:
        """Whether the soak's least chaos (`min_updates`, `min_kills`, the Redis restart) is still to come while
        there is time for it: the agents keep the gateway busy until then."""
        r = self.report
        done = (
            r.updates >= self.o.min_updates
            and r.kills >= self.o.min_kills
            and r.hangs >= self.o.min_hangs
            and r.redis_restarts >= 1
        )
        return not done and time.monotonic() < self.deadline - self.o.duration_s / 5

    def _retryable_status(self, exc: openai.APIStatusError) -> bool:
        if exc.status_code == 503 and "no replica can serve" in exc.message:
            self.report.documented_503 += 1  # all replicas down past the wait budget (documented)
            return True
        if exc.status_code == 429:
            self.report.retries["429"] += 1
            return True
        return False

    async def _create(
        self, api: openai.AsyncOpenAI, session: str, messages: list[dict[str, Any]], max_tokens: int, stream: bool
    ) -> tuple[str, str | None]:
        kwargs: dict[str, Any] = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "extra_headers": {"X-Session-ID": session},
        }
        if not stream:
            chat = await api.chat.completions.create(**kwargs)
            return chat.choices[0].message.content or "", chat.choices[0].finish_reason
        text, finish = "", None
        async with await api.chat.completions.create(**kwargs, stream=True) as chunks:
            async for chunk in chunks:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        return text, finish

    async def _finish(self, http: httpx.AsyncClient, session: str, reward: float) -> bool:
        while time.monotonic() < self.deadline:
            try:
                response = await http.post(f"/v1/sessions/{session}/finish", json={"reward": reward})
            except httpx.TransportError as exc:
                self.report.retries[f"finish {type(exc).__name__}"] += 1
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
                os.kill(pid, signal.SIGSTOP)  # hung: its connections stay open, nothing more comes
                self.report.hangs += 1
                try:
                    # The hang's length, not synchronisation: the replica stays stopped this long whatever happens.
                    await asyncio.sleep(hang_s)
                finally:
                    os.kill(pid, signal.SIGCONT)

    async def _redis_restart(self) -> None:
        if await self._pause((3.0, 6.0)):
            await self.redis.arestart()
            self.report.redis_restarts += 1

    # -- the trainer ---------------------------------------------------------------------------

    async def _trainer(
        self, consumer: TrajectoryConsumer, delivered: Counter[str], trajectories: list[Trajectory]
    ) -> None:
        quiet_since: float | None = None
        hard_stop = self.deadline + 90
        while time.monotonic() < hard_stop:
            try:
                batch = await consumer.next_batch(64, timeout=0.5)
                if batch.trajectories:
                    await consumer.ack(batch)
            except StoreError:
                self.report.retries["trainer StoreError"] += 1  # Redis restarting: read again
                continue
            for trajectory in batch.trajectories:
                delivered[trajectory.session_id] += 1  # counted only once acknowledged
                trajectories.append(trajectory)
            if not self.agents_done.is_set() or batch.trajectories:
                quiet_since = None
                continue
            quiet_since = quiet_since or time.monotonic()
            if self.acked <= set(delivered) or time.monotonic() - quiet_since > 10:
                return

    # -- the verdict ---------------------------------------------------------------------------

    def _verdict(self, delivered: Counter[str], trajectories: list[Trajectory]) -> None:
        r = self.report
        r.delivered = len(delivered)
        r.lost = len(self.acked - set(delivered))
        r.duplicated = sum(count - 1 for count in delivered.values())
        for session in sorted(set(delivered) - self.acked):
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
