"""The simulator's engine core: requests, pause modes, aborts, weights, data-parallel ranks.

Each rank (`scheduler.Rank`) runs a step loop that produces one token for every request of its running batch per
step, like a real engine's decode batch, with a capacity model when one is configured (batch cap, KV blocks, step
time that grows with the batch and its prefill). HTTP dialects (`vllm_app`, `sglang_app`) drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from backends.routed_experts import ExpertArray
from backends.sim.adapters import Adapters
from backends.sim.model import PREFIX_HASH_START, ModelShape, TokenModel, extend_prefix_hash, weights_key
from backends.sim.scheduler import Rank
from common.hashing import string_key

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep", "retract", "in_place"]
KEEP_MODES: frozenset[str | None] = frozenset({"keep", "retract", "in_place"})
"""The pauses that keep the requests in flight (and so, salted, a request that arrives meanwhile keeps its KV)."""
FinishReason = Literal["stop", "length", "abort"]
NewRequestsWhilePaused = Literal["block", "reject"]
DpBalance = Literal["least_loaded", "round_robin"]

SAMPLING_LOG_SIZE = 256
"""The requests whose sampling fields `SimEngine.sampling_log` keeps (the latest)."""


SHUTDOWN_MESSAGE = "engine shutting down"
"""The abort message of the requests the engine's own stop ends."""


class EngineStopped(Exception):
    """The engine stopped under a request: a dialect cuts its stream (as a real engine's exit does) rather than
    finish it with an abort, which would read as a pause."""


class SimRequestError(ValueError):
    """A request the engine refuses (bad ids, too long, ...); dialects answer 400."""


class EnginePaused(RuntimeError):
    """A new request arrived while paused and the engine rejects rather than blocks; dialects answer 503."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Behaviour and speed of one simulated replica."""

    model_name: str = "tiny"
    weights: str = "init"
    version: str = "default"
    shape: ModelShape = field(default_factory=ModelShape)
    token_delay_s: float = 0.0
    prefill_delay_s_per_token: float = 0.0
    block_size: int = 16
    cache_blocks: int = 65536
    max_model_len: int = 4096
    new_requests_while_paused: NewRequestsWhilePaused = "block"
    routed_experts_output: bool = False
    routed_experts_input: bool = False
    # The capacity model (`scheduler`); any of the three set turns it on. 0: no cap, no KV limit, no per-request cost.
    max_num_seqs: int = 0  # requests decoded per step (vLLM --max-num-seqs, SGLang --max-running-requests)
    num_gpu_blocks: int = 0  # KV blocks of `block_size` tokens per rank, prefix cache included
    per_seq_delay_s: float = 0.0  # step time added per request in the batch
    data_parallel_size: int = 1  # independent schedulers behind one server
    dp_balance: DpBalance = "least_loaded"  # where an unpinned request goes (vLLM: least loaded; SGLang: round robin)
    max_loras: int = 0  # > 0: LoRA adapters loaded at run time (`backends.sim.adapters`; vLLM --max-loras); 0: off

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if min(self.max_num_seqs, self.num_gpu_blocks) < 0 or self.per_seq_delay_s < 0:
            raise ValueError("max_num_seqs, num_gpu_blocks and per_seq_delay_s must not be negative")
        if self.num_gpu_blocks and -(-(self.max_model_len + 1) // self.block_size) > self.num_gpu_blocks:
            # As vLLM refuses to start: one request of the longest length must fit in the KV cache alone.
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks} blocks of {self.block_size} tokens cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens"
            )

    @property
    def scheduled(self) -> bool:
        """Whether the capacity model is on: a waiting queue, and step times shared by the batch."""
        return bool(self.max_num_seqs or self.num_gpu_blocks or self.per_seq_delay_s)


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """What the engine needs of a request's sampling parameters."""

    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    num_logprobs: int | None = None

    @property
    def effective_seed(self) -> int:
        # Greedy ignores the seed; an absent seed means 0, so the simulator stays deterministic and a
        # continuation can be checked against an uninterrupted run.
        return 0 if self.temperature == 0 else (self.seed or 0)


@dataclass(eq=False)
class SimRequest:
    """One generation. Lists grow as tokens are produced; readers wait on `updated`."""

    engine_id: str
    prompt: list[int]
    params: SamplingSpec
    hashes: list[int]
    forward_wkeys: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    abort_message: str = ""
    cached_tokens: int = 0
    num_retractions: int = 0
    stale_key: int = 0
    salt_key: int = 0  # the prefix-cache partition of its `cache_salt` / `extra_key` (0: none)
    adapter_key: int = 0  # its LoRA adapter's (`backends.sim.adapters`; 0: the base model)
    kept_through_pause: bool = False  # it reached the engine during a pause that keeps requests, and waited
    rank: int = 0  # the data-parallel rank that serves it
    preempted: bool = False  # queued again without its KV (scheduled mode): recomputed when admitted
    kv_blocks: int = 0  # KV blocks it holds (with `num_gpu_blocks`), `shared_blocks` included
    shared_blocks: list[int] = field(default_factory=list)  # the cached blocks it holds with others
    experts_input: ExpertArray | None = None
    script: tuple[int, ...] | None = None
    created: float = field(default_factory=time.monotonic)
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def weight_version_spans(self) -> list[dict[str, object]]:
        """Runs of equal version over output-token indexes: [{version, start, end}]."""
        spans: list[dict[str, object]] = []
        for i, version in enumerate(self.versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        return spans


class SimEngine:
    """A deterministic engine replica. Create inside a running event loop; call `start()` and `stop()`.

    `counters` are the engine's: with one rank they are also the rank's (steps, tokens, cache hits...); with
    several, each rank counts its own (`ranks[i].counters`) and `total_counters()` adds them up."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.model = TokenModel(settings.shape)
        self.weights = settings.weights
        self.version = settings.version
        self.wkey = weights_key(self.weights, self.version)
        self.adapters = Adapters(settings.max_loras)
        self.requests: dict[str, SimRequest] = {}
        self.paused = False
        self.pause_mode: PauseMode | None = None
        self.frozen = False
        self.stalled = False  # the "hang" fault: nothing decodes until it is cleared
        self.held = 0
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._admission_gates = 0
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.counters: Counter[str] = Counter()
        size = settings.data_parallel_size
        self.ranks = [Rank(self, i, self.counters if size == 1 else Counter()) for i in range(size)]
        self._next_rank = 0  # round-robin dispatch
        self.scripts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        # (first `prompt_log_head` prompt tokens, prompt length, time.monotonic()) of each submitted request,
        # only while `prompt_log_head` > 0 (benchmarks measure session affinity from the replicas' side with it;
        # the monotonic clock is system-wide, so the logs of several replicas on one host merge in order).
        self.prompt_log_head = 0
        self.prompt_log: list[tuple[tuple[int, ...], int, float]] = []
        # The sampling fields of the latest requests as each dialect received them (`GET /sim/sampling_log`): what
        # a client asked for, including the fields the simulated model ignores (top_p, top_k).
        self.sampling_log: deque[dict[str, Any]] = deque(maxlen=SAMPLING_LOG_SIZE)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    async def stop(self) -> None:
        self.abort_all(SHUTDOWN_MESSAGE)
        for rank in self.ranks:
            if rank.task is not None:
                rank.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.task
                rank.task = None

    # -- requests --------------------------------------------------------------------------------

    def validate(self, prompt: Sequence[int], params: SamplingSpec) -> None:
        """Raise SimRequestError for a request a real engine would refuse."""
        shape = self.settings.shape
        if not prompt:
            raise SimRequestError("prompt must contain at least one token")
        bad = next((t for t in prompt if not 0 <= t < shape.vocab_size), None)
        if bad is not None:
            raise SimRequestError(f"token id {bad} is out of vocabulary (vocab_size={shape.vocab_size})")
        if params.max_tokens < 1:
            raise SimRequestError(f"max_tokens must be at least 1, got {params.max_tokens}")
        limit = self.settings.max_model_len
        if len(prompt) + params.max_tokens > limit:
            raise SimRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the messages, "
                f"{params.max_tokens} in the completion)."
            )

    async def submit(
        self,
        engine_id: str,
        prompt: Sequence[int],
        params: SamplingSpec,
        experts_input: ExpertArray | None = None,
        cache_salt: str | None = None,
        dp_rank: int | None = None,
        adapter: str | None = None,
    ) -> SimRequest:
        """Admit a request: wait out (or reject during) a pause, then queue it on its rank (`dp_rank`, else the
        dispatch policy's choice) or, without the capacity model, prefill and join the decode batch. Its prefix is
        cached, and found, only among requests with the same `cache_salt`."""
        self.validate(prompt, params)
        lora = self.adapters.key(adapter)  # an adapter it does not hold is refused (`AdapterError`)
        if dp_rank is not None and not 0 <= dp_rank < len(self.ranks):
            raise SimRequestError(f"data parallel rank {dp_rank} is out of range [0, {len(self.ranks)})")
        if self.prompt_log_head:
            self.prompt_log.append((tuple(prompt[: self.prompt_log_head]), len(prompt), time.monotonic()))
        if engine_id in self.requests:
            raise SimRequestError(f"request id {engine_id!r} is already in flight")
        kept = await self._admit()
        if engine_id in self.requests:  # another request with this id was admitted while we waited
            raise SimRequestError(f"request id {engine_id!r} is already in flight")
        rank = self.ranks[self._dispatch() if dp_rank is None else dp_rank]
        request = SimRequest(
            engine_id=engine_id,
            prompt=list(prompt),
            params=params,
            hashes=self._prompt_hashes(prompt),
            salt_key=salt_key(cache_salt) ^ lora,
            adapter_key=lora,
            kept_through_pause=kept,
            experts_input=experts_input,
            script=self._script_for(prompt),
            rank=rank.index,
        )
        self.requests[engine_id] = request
        rank.inflight += 1
        self._idle.clear()
        rank.counters["prompt_tokens"] += len(prompt)
        if rank.scheduled:
            rank.waiting.append(request)
            rank.wake()
            return request
        await self._prefill(rank, request)
        return request

    async def _prefill(self, rank: Rank, request: SimRequest) -> None:
        """Unbounded mode: the request's own prefill delay, then the decode batch (other requests go on meanwhile)."""
        cached = rank.take_hits(request, rank.match(request))
        rank.counters["prefill_tokens"] += len(request.prompt) - cached
        delay = (len(request.prompt) - cached) * self.settings.prefill_delay_s_per_token
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:  # the client went away while we prefilled
                self.abort(request.engine_id, "client disconnected")
                rank.retire(request)
                raise
        if request.finished:  # aborted during prefill
            rank.retire(request)
            return
        request.forward_wkeys = rank.prefill_wkeys(request, cached)
        rank.running[request.engine_id] = request
        rank.wake()

    def _dispatch(self) -> int:
        """The rank of an unpinned request: the one with the fewest requests, lowest index first (vLLM's balancer),
        or the next in turn (SGLang's default round robin)."""
        ranks = self.ranks
        if len(ranks) == 1:
            return 0
        if self.settings.dp_balance == "round_robin":
            index = self._next_rank
            self._next_rank = (index + 1) % len(ranks)
            return index
        return min(ranks, key=lambda rank: rank.inflight).index

    async def _admit(self) -> bool:
        """Wait out a pause or a drain; True if the request waited through a pause that keeps requests."""
        kept = False
        while self.paused or self._admission_gates:
            if (
                self.paused
                and self.settings.new_requests_while_paused == "reject"
                and self.pause_mode
                in (
                    "abort",
                    "wait",
                )
            ):
                raise EnginePaused("engine_paused: the engine is paused; retry after it resumes")
            kept = kept or self.pause_mode in KEEP_MODES
            self.held += 1
            try:
                await self._unpaused.wait()
                await self._gate_open.wait()
            finally:
                self.held -= 1
        return kept

    def add_script(self, prompt_suffix: Sequence[int], output: Sequence[int]) -> None:
        """Make prompts ending in `prompt_suffix` produce `output` then stop (a scripted reply, e.g. a tool call).

        Still a function of the prefix: a continuation whose prompt ends in suffix + part of the output goes on
        with the rest of the output."""
        self.scripts.append((tuple(prompt_suffix), tuple(output)))

    def _script_for(self, prompt: Sequence[int]) -> tuple[int, ...] | None:
        tail = tuple(prompt)
        for suffix, output in reversed(self.scripts):
            for done in range(len(output) + 1):
                expected = suffix + output[:done]
                if len(tail) >= len(expected) and tail[len(tail) - len(expected) :] == expected:
                    return output[done:]
        return None

    def _prompt_hashes(self, prompt: Sequence[int]) -> list[int]:
        hashes: list[int] = []
        state = PREFIX_HASH_START
        for token in prompt:
            state = extend_prefix_hash(state, token)
            hashes.append(state)
        return hashes

    # -- decoding --------------------------------------------------------------------------------

    def _wake(self) -> None:
        for rank in self.ranks:
            rank.wake()

    def set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        self._wake()

    def decode_one(self, request: SimRequest, wkey: int, version: str, counters: Counter[str]) -> None:
        """One step of `request`: sample its next token (a pure function of weights, seed and prefix)."""
        params = request.params
        produced = len(request.output_ids)
        if produced:
            request.forward_wkeys.append(wkey)  # this step runs the previous token through the model
        key = self.model.sample_key(wkey ^ request.stale_key ^ request.adapter_key, params.effective_seed)
        allow_eos = not params.ignore_eos and produced >= params.min_tokens
        draw = self.model.draw(request.hashes[-1], key, allow_eos=allow_eos, num_top=params.num_logprobs or 0)
        token = draw.token
        if request.script is not None:
            token = request.script[produced] if produced < len(request.script) else self.settings.shape.eos_token_id
            allow_eos = True
        request.output_ids.append(token)
        request.logprobs.append(draw.logprob)
        if params.num_logprobs:
            request.top_logprobs.append(draw.top)
        request.versions.append(version)
        request.hashes.append(extend_prefix_hash(request.hashes[-1], token))
        counters["generation_tokens"] += 1
        if allow_eos and token == self.settings.shape.eos_token_id:
            request.finish_reason = "stop"
        elif token in params.stop_token_ids and produced + 1 >= params.min_tokens:
            request.finish_reason, request.stop_reason = "stop", token
        elif produced + 1 >= params.max_tokens or len(request.hashes) >= self.settings.max_model_len:
            request.finish_reason = "length"
        request.updated.set()

    def forget(self, request: SimRequest) -> None:
        """A rank retired the request: it is no longer in flight."""
        self.requests.pop(request.engine_id, None)
        request.updated.set()
        if not self.requests:
            self._idle.set()

    def routed_experts(self, request: SimRequest, start: int = 0) -> ExpertArray:
        """Experts for positions [start, prompt+output-1): every token that went through the model.

        Positions covered by a replayed input keep the given routing (routing replay)."""
        hashes = request.hashes[: len(request.forward_wkeys)]
        experts = self.model.routed_experts(hashes, request.forward_wkeys)
        given = request.experts_input
        if given is not None and len(given):
            n = min(len(given), len(experts))
            experts[:n] = given[:n].astype(experts.dtype)
        return np.ascontiguousarray(experts[start:])

    # -- control ---------------------------------------------------------------------------------

    def abort(self, engine_id: str, message: str = "Aborted", only: SimRequest | None = None) -> bool:
        """End a request with its partial output. With `only`, abort it only if the id still names that request."""
        request = self.requests.get(engine_id)
        if request is None or request.finished or (only is not None and request is not only):
            return False
        request.finish_reason = "abort"
        request.abort_message = message
        rank = self.ranks[request.rank]
        rank.counters["aborted"] += 1
        if engine_id in rank.running or rank.scheduled:
            rank.retire(request)
        else:
            request.updated.set()  # still prefilling: `_prefill` retires it
        return True

    def abort_all(self, message: str = "Aborted") -> int:
        return sum(self.abort(engine_id, message) for engine_id in list(self.requests))

    async def pause(self, mode: PauseMode) -> None:
        """Stop serving. abort: end in-flight requests with their partial output; wait: let them finish;
        keep/in_place: freeze them; retract: freeze and count a retraction (their KV is recomputed)."""
        self.paused = True
        self.pause_mode = mode
        self.counters["pauses"] += 1
        self._unpaused.clear()
        if mode == "abort":
            self.abort_all("Abort in waiting queue")
        elif mode == "wait":
            await self._idle.wait()
        else:
            self.frozen = True
            if mode == "retract":
                for rank in self.ranks:
                    self._retract_rank(rank)

    def _retract_rank(self, rank: Rank) -> None:
        if rank.scheduled:
            rank.preempt_all()  # back to the queue; recomputed when admitted after the resume
            return
        newly = [r for r in rank.running.values() if r.engine_id not in rank.retracted]
        for request in newly:
            request.num_retractions += 1
            rank.retracted.add(request.engine_id)
        rank.counters["retractions"] += len(newly)

    def resume(self) -> None:
        for rank in self.ranks:
            retracted = [rank.running[i] for i in rank.retracted if i in rank.running]
            rank.retracted.clear()
            for request in retracted:
                rank.recompute_tokens += self.forget_kv(request)
        self.paused = False
        self.pause_mode = None
        self.frozen = False
        self._unpaused.set()
        self._wake()

    @property
    def admission_closed(self) -> bool:
        """A `drain` holds new requests (an update waiting for the writer lock, or holding it)."""
        return self._admission_gates > 0

    async def drain(self) -> None:
        """Close admission and wait until nothing is in flight (an update that takes the writer lock)."""
        self._admission_gates += 1
        self._gate_open.clear()
        try:
            await self._idle.wait()
        except BaseException:
            self._release_gate()
            raise

    def release(self) -> None:
        """Reopen admission after `drain`."""
        self._release_gate()

    def _release_gate(self) -> None:
        self._admission_gates -= 1
        if not self._admission_gates:
            self._gate_open.set()

    def load_weights(self, weights: str) -> None:
        self.weights = weights
        self.wkey = weights_key(self.weights, self.version)
        self.counters["weight_loads"] += 1

    def set_version(self, version: str) -> None:
        self.version = version
        self.wkey = weights_key(self.weights, self.version)

    def active_blocking_flush(self) -> int:
        """Requests whose KV a cache flush would destroy (running, not retracted)."""
        return sum(rank.num_running for rank in self.ranks)

    def flush_cache(self, preempt_running: bool = False) -> bool:
        """Drop the prefix cache; refused (False) while requests hold KV, like the real engines, unless
        `preempt_running` (vLLM's `reset_running_requests`): running requests then give up their KV and
        recompute it under the weights loaded when they next run (at resume if the engine is frozen)."""
        if preempt_running:
            self._preempt_running()  # nothing holds KV after this
        elif self.active_blocking_flush():
            return False
        for rank in self.ranks:
            rank.clear_cache()
        return True

    def _preempt_running(self) -> None:
        for rank in self.ranks:
            if rank.scheduled:
                rank.preempt_all()  # counted as preemptions; recomputed when admitted again
                continue
            for request in list(rank.running.values()):
                if request.engine_id in rank.retracted:
                    continue
                if self.frozen:
                    rank.retracted.add(request.engine_id)  # back to the queue; `resume` recomputes its KV
                else:
                    rank.recompute_tokens += self.forget_kv(request)
                rank.counters["retractions"] += 1  # vLLM counts these as preemptions

    def forget_kv(self, request: SimRequest) -> int:
        """The request lost its KV: it is recomputed under the weights now loaded (no cache hit, so nothing stale),
        at the prefill rate. Returns the tokens to recompute."""
        tokens = len(request.forward_wkeys)
        request.forward_wkeys = [self.wkey] * tokens
        request.stale_key = 0
        self.ranks[request.rank].counters["recomputed_tokens"] += tokens  # what a flush cost (benchmarks.updates)
        return tokens

    def set_speed(self, token_delay_s: float | None, prefill_delay_s_per_token: float | None) -> None:
        """Change the per-token decode and prefill delays at run time (benchmarks reuse one set of replicas)."""
        changes: dict[str, float] = {}
        if token_delay_s is not None:
            changes["token_delay_s"] = token_delay_s
        if prefill_delay_s_per_token is not None:
            changes["prefill_delay_s_per_token"] = prefill_delay_s_per_token
        self.settings = dataclasses.replace(self.settings, **changes)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Back to the initial weights, unpaused, empty cache (test isolation; not in real engines)."""
        self.abort_all("reset")
        self.resume()
        self.weights = self.settings.weights
        self.set_version(self.settings.version)
        for rank in self.ranks:
            rank.clear_cache()
            rank.recompute_tokens = 0
        self.scripts.clear()

    def total_counters(self) -> Counter[str]:
        """The engine's counters with every rank's added (the same object with one rank)."""
        if len(self.ranks) == 1:
            return self.counters
        total = Counter(self.counters)
        for rank in self.ranks:
            total.update(rank.counters)
        return total

    @property
    def num_running(self) -> int:
        """Requests in the decode batches (frozen ones too: they keep their KV)."""
        return sum(rank.num_running for rank in self.ranks)

    @property
    def num_waiting(self) -> int:
        """Requests queued, prefilling or retracted back to the queue (not those held at admission by a pause)."""
        return len(self.requests) - self.num_running


def salt_key(cache_salt: str | None) -> int:
    """The cache partition of a request's salt: 0 without one, else a 64-bit key of the string."""
    if not cache_salt:
        return 0
    return string_key(cache_salt) or 1
