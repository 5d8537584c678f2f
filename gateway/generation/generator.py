"""Generation with transparent resume: the one loop every API route uses (docs/architecture.md §4).

A request is served as one or more *segments*, each one engine request under one placement. When a segment
ends in `abort` (a weight update paused the engines) or its replica fails, every token is kept, the partial
state is persisted, the loop waits for the weight coordinator to serve again, and the prompt plus all tokens
so far are re-issued with the remaining budget. The caller sees one completion.

Invariants (each has a test): no token is lost or duplicated and the output is the concatenation of the
segments; every token carries the version that sampled it and versions never decrease; routed experts of
positions already generated are kept (splice); stop strings and max_tokens apply to the whole completion;
a cancelled caller aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from backends.base import Chunk
from backends.errors import BackendError, BackendTimeout, BackendUnavailable
from backends.lora import adapter_name
from backends.routed_experts import ExpertArray
from gateway.errors import CutForStaleness, DeadlinePassed, EngineAhead, ReplicaStalled, ReplicaWentDown
from gateway.generation.request import (
    STALE,
    Delta,
    GenerationRequest,
    GenerationSettings,
    GenerationState,
)
from gateway.generation.segment_run import SegmentRun, close_segment
from gateway.generation.stale_cut import first_version, log_cut
from gateway.routing import Replica, ReplicaPool
from gateway.routing.segment_watch import SegmentWatch
from gateway.token_versions import newer_first_version, stale_version
from gateway.weights.labels import cache_salt

logger = logging.getLogger(__name__)


class ServingWeights(Protocol):
    """What generation needs of the weights: whether requests may dispatch, a wait until they may, the version the
    pool serves (and the one an update under way loads, where known), and when held requests were last released
    (`gateway.weights.WeightCoordinator` is one)."""

    @property
    def serving(self) -> bool: ...

    @property
    def version(self) -> int: ...

    @property
    def released_at(self) -> float: ...

    @property
    def upcoming_version(self) -> int | None: ...

    async def until_serving(self, timeout: float | None = None) -> None: ...


class StalenessCheck(Protocol):
    """The staleness budget as generation sees it (`gateway.weights.budget.StalenessBudget` is one): the oldest
    version a sample's first token may have now (None: the budget is off), and a count of the turns cut by it."""

    async def stale_before(self) -> int | None: ...

    def count_cut(self) -> None: ...


@dataclass(slots=True)
class _EngineCall:
    """One engine request, built (its body encoded) but not yet sent: the first iteration of `chunks` sends it."""

    replica: Replica
    request_id: str
    chunks: AsyncGenerator[Chunk, None]  # a stream's chunks, or a whole answer's one
    streamed: bool  # the engine streams its tokens (a whole answer has no first token of its own)
    salt: str | None  # the prefix-cache salt it was built with
    version: int  # the version it names (salt, LoRA adapter): the replica's when it was built, or the update's


@dataclass(slots=True)
class _Resume:
    """What the resume loop carries from one segment to the next."""

    deadline: float  # monotonic
    loop_deadline: float  # the same, in loop time: the engine answer's own timer enforces it
    avoid: tuple[str, ...] = ()  # the replica that just failed
    interrupted_at: float | None = None
    preempted_at: float | None = None
    ahead: _EngineCall | None = None  # a continuation built while the weight update runs


class Generator:
    """Runs completions over the pool, resuming across weight updates and replica failures.

    The counters are plain integers that metrics read at scrape time (nothing is pushed per token); `on_resume` gets the
    resume latency of each streamed continuation: seconds from the moment its predecessor segment broke off (abort or
    failure) to the continuation's first token, waiting for a weight update included (a whole answer brings its first
    token with its last, so it reports none). `on_dispatch` gets, once per continuation of a preempted segment, the
    seconds from the coordinator's release of waiters (or from the preemption, if that came later) to the continuation
    being sent to the engine. `on_finished` gets, per completion that finished (not cancelled, not failed), its seconds
    to the first token handed to the caller and its whole duration.
    """

    def __init__(
        self,
        pool: ReplicaPool,
        weights: ServingWeights,
        settings: GenerationSettings | None = None,
        on_resume: Callable[[float], None] | None = None,
        on_dispatch: Callable[[float], None] | None = None,
    ) -> None:
        self.pool = pool
        self.weights = weights
        self.settings = settings or GenerationSettings()
        self.on_resume = on_resume
        self.on_dispatch = on_dispatch
        self.on_finished: Callable[[GenerationRequest, float | None, float], None] | None = None
        self.staleness: StalenessCheck | None = None  # cuts a completion at a resume once its sample is too old
        self.resumes_total = 0
        self.preemptions_total = 0
        self.interrupted_total = 0  # segments cut because the pool took their replica out
        self.stalled_total = 0  # streamed segments cut by the stall timeout
        self.engine_ahead_total = 0  # segments whose engine ran newer weights than they were salted for
        self.prompt_tokens_total = 0  # per generation (n choices count n times); resumes do not recount
        self.completion_tokens_total = 0  # tokens handed to callers
        self._aborts: set[asyncio.Task[None]] = set()

    async def run(self, request: GenerationRequest) -> GenerationState:
        """Produce the whole completion."""
        state = GenerationState(request)
        await self.complete(request, state)
        return state

    async def complete(self, request: GenerationRequest, state: GenerationState) -> None:
        """Produce the whole completion into `state`, for a caller that takes it only once finished: `stream` consumed
        to the end (a request that needs no tokens on the way gets each segment's whole answer from its engine, see
        `GenerationRequest.stream`). If the caller is cancelled, the engine request is aborted and `state.cancelled`
        is set."""
        async for _ in self.stream(request, state):
            pass

    async def stream(self, request: GenerationRequest, state: GenerationState) -> AsyncGenerator[Delta, None]:
        """Yield new tokens as they arrive; `state` holds the rest (versions, experts, finish) at the end.
        If the caller stops early (disconnect), the engine request is aborted and `state.cancelled` is set.

        The resume loop: start a segment, absorb its chunks; when it breaks off (abort, replica failure, refused
        version) close it, prepare the resume and start the next on a replica the pool picks."""
        self.prompt_tokens_total += len(request.prompt_ids)
        timeout = self.settings.request_timeout_s
        started = time.monotonic()
        first: float | None = None
        resume = _Resume(started + timeout, asyncio.get_running_loop().time() + timeout)
        try:
            while not self._done(request, state):
                run, call = self._start(request, state, resume) or await self._start_after_wait(request, state, resume)
                failed = False
                try:
                    async for delta in self._segment(request, state, run, call, resume.loop_deadline):
                        if first is None and delta.token_ids:
                            first = time.monotonic()
                        yield delta
                except CutForStaleness:
                    state.finish_reason = STALE  # `cut_behind`: its sample fell behind while it ran on
                    self._count_cut(request, state)
                except EngineAhead:
                    pass  # nothing of it was handed out: resumed under the new salt, as after a preemption
                except BackendError as exc:
                    self._on_failure(run.replica, exc, state)  # re-raises what no other try can mend
                    failed = True
                finally:
                    # However the segment ended (cancelled caller, shutdown, a non-retryable error included), every
                    # token it produced gets its version: a cut turn is recorded with aligned arrays.
                    close_segment(state, run, self.settings.routed_experts)
                if run.newer is not None:
                    await self._engine_ahead(request, run)
                if state.finish_reason is None:
                    await self._between(request, state, run, resume, failed=failed)
                    if await self._beyond_budget(request, state, resume):
                        state.finish_reason = STALE
        except (GeneratorExit, asyncio.CancelledError):
            state.cancelled = True
            raise
        if self.on_finished is not None:
            self.on_finished(request, None if first is None else first - started, time.monotonic() - started)

    def _done(self, request: GenerationRequest, state: GenerationState) -> bool:
        """Whether the completion is finished (a spent budget finishes it as `length`)."""
        if state.finish_reason is not None:
            return True
        if len(state.output_ids) >= request.sampling.max_tokens:
            state.finish_reason = "length"
            return True
        return False

    def _start(
        self, request: GenerationRequest, state: GenerationState, resume: _Resume
    ) -> tuple[SegmentRun, _EngineCall] | None:
        """The next segment (its replica placed, its engine request built) if it can start at once, else None
        (`_start_after_wait`): a plain function, as most segments start without waiting for anything."""
        if not self.weights.serving or resume.avoid:
            return None
        replica = self.pool.pick(request.session_id, prompt=request.prompt_ids, group=request.group_id)
        return None if replica is None else self._start_on(replica, request, state, resume)

    async def _start_after_wait(
        self, request: GenerationRequest, state: GenerationState, resume: _Resume
    ) -> tuple[SegmentRun, _EngineCall]:
        """The next segment, once the weights serve and a replica (other than the one that just failed) is free."""
        if not self.weights.serving:
            await self._until_serving(resume.deadline)
        pool, prompt, group = self.pool, request.prompt_ids, request.group_id
        replica = None if resume.avoid else pool.pick(request.session_id, prompt=prompt, group=group)
        if replica is None:
            wait_until = min(resume.deadline, time.monotonic() + self.settings.max_wait_s)
            replica = await pool.acquire(request.session_id, wait_until, resume.avoid, prompt=prompt, group=group)
        return self._start_on(replica, request, state, resume)

    def _start_on(
        self, replica: Replica, request: GenerationRequest, state: GenerationState, resume: _Resume
    ) -> tuple[SegmentRun, _EngineCall]:
        """The next segment on `replica`: the continuation built ahead for it during a weight update, or a new call."""
        remaining = request.sampling.max_tokens - len(state.output_ids)
        ahead, resume.ahead = resume.ahead, None
        if ahead is not None and ahead.replica is replica and ahead.version == self._served(replica):
            call = ahead  # built for this replica, and its weights have not changed since
        else:
            call = self._engine_call(request, state, replica, remaining, resume.loop_deadline)
        self.pool.sent(replica, request.prompt_ids)  # what `cache_aware` expects the replica's prefix cache to hold
        dispatch_version = self._served(replica)
        run = SegmentRun(replica, len(state.output_ids), dispatch_version, call.salt is not None)
        run.interrupted_at, run.preempted_at = resume.interrupted_at, resume.preempted_at
        return run, call

    async def _between(
        self,
        request: GenerationRequest,
        state: GenerationState,
        run: SegmentRun,
        resume: _Resume,
        *,
        failed: bool,
    ) -> None:
        """A segment broke off before the completion finished: persist the partial state and set up the next one."""
        resume.avoid = (run.replica.id,) if failed else ()
        # A continuation that produced nothing keeps the first break: latency is what the caller waited.
        resume.interrupted_at = run.interrupted_at if run.interrupted_at is not None else time.monotonic()
        resume.preempted_at = None if failed else time.monotonic()
        await self._prepare_resume(state, failed)
        left = request.sampling.max_tokens - len(state.output_ids)
        if not failed and left > 0:
            # Preempted: the replica most likely serves the continuation too, once the update is done. Building it
            # now (prompt plus tokens so far, encoded) takes that work off the moment every held request is
            # released at once; another replica then gets a call of its own.
            # Salted for the version the update loads: the replica serves it when the continuation goes.
            upcoming = self.weights.upcoming_version
            resume.ahead = self._engine_call(request, state, run.replica, left, resume.loop_deadline, upcoming)

    async def _beyond_budget(self, request: GenerationRequest, state: GenerationState, resume: _Resume) -> bool:
        """Whether the completion, broken off, is not to be resumed: its sample's first token is older than the
        staleness budget allows under the version served once the update that broke it off is done. Its tokens
        so far are kept; the caller gets `finish_reason` "stale"."""
        if self.staleness is None:
            return False
        first = first_version(request, state)
        if first is None:
            return False
        if not self.weights.serving:
            await self._until_serving(resume.deadline)  # the version the continuation would run under
        oldest = await self.staleness.stale_before()
        if oldest is None or first >= oldest:
            return False
        resume.ahead = None  # built for a continuation that will not run (never started: nothing to close)
        self._count_cut(request, state)
        return True

    def _count_cut(self, request: GenerationRequest, state: GenerationState) -> None:
        if self.staleness is not None:
            self.staleness.count_cut()
        log_cut(request, state, self.weights.version)

    async def _until_serving(self, deadline: float) -> None:
        try:
            await self.weights.until_serving(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise BackendUnavailable("request deadline passed while waiting for a weight update") from None

    def _engine_call(
        self,
        request: GenerationRequest,
        state: GenerationState,
        replica: Replica,
        remaining: int,
        deadline: float,
        version: int | None = None,
    ) -> _EngineCall:
        """The next segment's engine request to `replica`: the prompt plus every token so far, `remaining` to go, by
        `deadline` (loop time), salted for `version` (default: the replica's). Its answer streams if the caller
        takes tokens on the way (or stop strings are watched), else comes whole: the adapter reads it either way
        (`EngineBackend.generate`)."""
        backend = replica.backend
        # The first segment sends the prompt as it is (the backend encodes it at once, nothing changes it meanwhile).
        prompt = request.prompt_ids + state.output_ids if state.output_ids else request.prompt_ids
        sampling = request.sampling
        if state.output_ids or remaining != sampling.max_tokens:  # a continuation (the first segment runs as asked)
            sampling = dataclasses.replace(
                sampling, max_tokens=remaining, min_tokens=max(0, sampling.min_tokens - len(state.output_ids))
            )
        continuing = bool(state.output_ids)
        splice = self.settings.routed_experts == "splice"
        experts_start = len(prompt) - 1 if continuing and splice else (request.experts_start if splice else 0)
        replay = self._replay(request, state) if backend.capabilities.routed_experts_in else None
        request_id = f"{request.request_id}-{len(state.segments)}"
        stream = request.stream or request.stop is not None  # stop strings are watched token by token
        version = self._served(replica) if version is None else version
        salt = cache_salt(version) if self.settings.cache_salt else None
        adapter = adapter_name(self.settings.adapter, version) if self.settings.adapter is not None else None
        chunks = backend.generate(
            prompt,
            sampling,
            request_id,
            replay,
            experts_start,
            stream=stream,
            deadline=deadline,
            cache_salt=salt,
            dp_rank=replica.rank,  # a target that is one data-parallel rank pins its requests to it
            adapter=adapter,
        )
        return _EngineCall(replica, request_id, chunks, backend.capabilities.streams(stream), salt, version)

    def _served(self, replica: Replica) -> int:
        """The version `replica` serves now: its requests are salted with that version's prefix-cache partition
        (`cache_salt`, so none reuses KV cached under other weights and no update flushes a cache) and, for a LoRA
        policy, name that version's adapter."""
        return replica.version if replica.version is not None else self.weights.version

    async def _segment(
        self, request: GenerationRequest, state: GenerationState, run: SegmentRun, call: _EngineCall, deadline: float
    ) -> AsyncIterator[Delta]:
        """One segment: the engine answer's chunks absorbed into `state`, the caller's new tokens yielded. The request's
        `deadline` (loop time) went with the answer: its transport's own timer enforces it, streamed or whole."""
        engine_done = False
        streamed, settings = call.streamed, self.settings
        first = first_version(request, state)
        first = run.dispatch_version if first is None else first  # a new sample's first token comes in this segment
        watch = SegmentWatch(
            run.replica,
            settings.stall_timeout_s if streamed else 0.0,
            self._quiet_since,
            first,
            settings.first_token_timeout_s if streamed else 0.0,
        )
        with self.pool.lease(run.replica, watch):
            try:
                if run.preempted_at is not None:
                    self._dispatched(run.preempted_at)
                async with contextlib.aclosing(call.chunks) as chunks:
                    watch.first_chunk()
                    async for chunk in chunks:
                        watch.reading = False
                        engine_done = chunk.finish_reason is not None
                        delta = self._absorb(state, run, chunk, request)
                        if delta is not None:
                            self._count(run, delta, observe=call.streamed)
                            yield delta
                        if run.finish is not None:
                            break
                        watch.next_chunk()  # raises if the replica was taken out meanwhile
                    watch.reading = False
            except asyncio.CancelledError:
                error = watch.withdraw()  # the replica was taken out, or stalled: not the caller's cancellation
                if error is None:
                    raise
                raise error from None
            except BackendTimeout:
                if asyncio.get_running_loop().time() >= deadline:
                    raise self._deadline_passed(run) from None
                raise
            finally:
                watch.close()
                if not engine_done:  # stop string, client gone, or a broken answer: stop the engine request
                    self._abort_in_background(run.replica, call.request_id)
        self.pool.report_success(run.replica)

    def _quiet_since(self) -> float | None:
        """Since when a silent stream counts as stalled (the last weight update's end); None while an update runs."""
        weights = self.weights
        return weights.released_at if weights.serving else None

    def _deadline_passed(self, run: SegmentRun) -> DeadlinePassed:
        return DeadlinePassed(
            f"request deadline of {self.settings.request_timeout_s:g}s passed (generation.request_timeout_s)",
            replica=run.replica.id,
        )

    def _count(self, run: SegmentRun, delta: Delta, *, observe: bool) -> None:
        """Tokens handed to the caller; the first of a continuation reports its resume latency."""
        if run.interrupted_at is not None:
            self._resumed(run, observe=observe)
        self.completion_tokens_total += len(delta.token_ids)
        replica = run.replica
        replica.tokens_total += len(delta.token_ids)
        replica.progressed_at = time.monotonic()

    def _dispatched(self, preempted_at: float) -> None:
        """A continuation of a preempted segment was handed to its engine's client: report how long after the
        release of waiters (the weight update's end; the preemption itself if that came later) it was sent."""
        if self.on_dispatch is None:
            return
        # The engine call's first iteration writes the request, in this pass of the event loop on a kept-alive
        # connection (`gateway.fastpath.engine_client`; a new one writes after its connect, which this leaves out). This
        # callback runs in the next pass: after the write of every request of a burst released together.
        asyncio.get_running_loop().call_soon(self._observe_dispatch, preempted_at)

    def _observe_dispatch(self, preempted_at: float) -> None:
        if self.on_dispatch is not None:
            self.on_dispatch(time.monotonic() - max(preempted_at, self.weights.released_at))

    def _resumed(self, run: SegmentRun, observe: bool) -> None:
        """The first token of a continuation arrived: report how long the caller waited for it (`observe`: the
        continuation streams, so this is its first token and not the whole answer)."""
        started, run.interrupted_at = run.interrupted_at, None
        if observe and started is not None and self.on_resume is not None:
            self.on_resume(time.monotonic() - started)

    def _replay(self, request: GenerationRequest, state: GenerationState) -> ExpertArray | None:
        """Experts of every position already run through the model: the earlier turns', then this request's."""
        ours = state.routed_experts if state.output_ids else None
        if ours is None or self.settings.routed_experts == "replace":
            return ours if ours is not None else request.routed_experts  # replace: the engine's whole view
        if request.routed_experts is None:
            return ours
        return np.concatenate([request.routed_experts, ours.astype(request.routed_experts.dtype)])

    def _check_engine_version(self, state: GenerationState, run: SegmentRun, chunk: Chunk) -> None:
        """Refuse tokens sampled under weights older than the replica is known to run (`stale_version`): that chunk
        is dropped, the replica taken out (the health loop re-admits it only once it runs the current version) and
        the request resumes elsewhere. Refuse a salted segment whose first token came from newer weights
        (`newer_first_version`, `EngineAhead`) where nothing of it was handed out yet; where it was (a vLLM stream
        labels only its last chunk) the segment stands, as a request kept through that update's pause would."""
        oldest = stale_version(chunk, run.dispatch_labels, run.dispatch_version)
        if oldest is not None:
            # Engines that label only their last chunk (vLLM) have streamed the segment's earlier tokens by then:
            # label those truthfully, with their (older) version.
            run.spans = list(chunk.version_spans) if chunk.version_spans is not None else run.spans
            run.weight_version = chunk.weight_version or run.weight_version
            raise BackendUnavailable(
                f"replica {run.replica.id} sampled under weight version {oldest}, but runs {run.dispatch_version} "
                "as far as the gateway knows (restarted?)",
                replica=run.replica.id,
                code="stale_weights",
            )
        self._check_newer(state, run, chunk)

    def _check_newer(self, state: GenerationState, run: SegmentRun, chunk: Chunk) -> None:
        if not run.salted or run.newer is not None:
            return
        first = len(state.output_ids) == run.start  # nothing of the segment was absorbed (nor handed out) yet
        newer = newer_first_version(chunk, run.dispatch_labels, run.dispatch_version, first=first)
        weights = self.weights
        if newer is None or not weights.serving or newer <= weights.version:
            # This process knows of that update: the request reached its engine before the update's pause and was
            # kept through it (a `keep` update keeps a request's KV, its salt's prefix included).
            return
        run.newer = newer
        if first:
            raise EngineAhead(
                f"replica {run.replica.id} sampled under weight version {newer}, newer than the {run.dispatch_version} "
                "this request was salted for",
                replica=run.replica.id,
                version=newer,
            )

    async def _engine_ahead(self, request: GenerationRequest, run: SegmentRun) -> None:
        """A replica began a segment under newer weights than this process dispatched it for (`EngineAhead`): it
        missed that update's result. Have the replica's weights checked now rather than at its next health probe
        (`ReplicaPool.check_weights`: the recorded version adopted, else the replica held out), so that no other
        request goes to it salted for the old version."""
        self.engine_ahead_total += 1
        replica = run.replica
        logger.warning(
            "request %s: replica %s began a segment under weight version %d; it was dispatched for %d (an update "
            "this process missed): checking the replica's weights",
            request.request_id,
            replica.id,
            run.newer,
            run.dispatch_version,
            extra={"session_id": request.session_id, "replica": replica.id, "version": run.newer},
        )
        await self.pool.check_weights(replica.engine)

    def _absorb(
        self, state: GenerationState, run: SegmentRun, chunk: Chunk, request: GenerationRequest
    ) -> Delta | None:
        self._check_engine_version(state, run, chunk)
        if chunk.weight_version is not None:
            run.weight_version = chunk.weight_version
        if chunk.version_spans is not None:
            run.spans = list(chunk.version_spans)
        if chunk.routed_experts is not None:
            run.experts = chunk.routed_experts
        # The chunk's lists are the adapter's fresh ones, handed over: the delta shares them, nothing is copied.
        ids, logprobs, tops = chunk.token_ids, chunk.logprobs, chunk.top_logprobs
        if ids and request.stop is not None:
            keep = request.stop(state.output_ids + ids)
            if keep is not None:
                cut = max(0, keep - len(state.output_ids))
                ids, logprobs, tops = ids[:cut], logprobs[:cut], tops[:cut] if tops else tops
                run.finish, run.stop_reason = "stop", "stop_string"
        if chunk.finish_reason is not None and run.finish is None:
            run.finish, run.stop_reason = chunk.finish_reason, chunk.stop_reason
        if not ids:
            return None
        state.output_ids.extend(ids)
        state.logprobs.extend(logprobs)
        if tops and not request.stream:
            state.top_logprobs.extend(tops)  # a streaming caller had them with their delta: not kept twice
        return Delta(ids, logprobs, tops)

    async def _prepare_resume(self, state: GenerationState, failed: bool) -> None:
        state.num_resumes += 1
        self.resumes_total += 1
        if not failed:
            self.preemptions_total += 1
        if state.num_resumes > self.settings.max_resumes:
            raise BackendUnavailable(
                f"gave up after {self.settings.max_resumes} resumes "
                f"({state.num_failures} replica failures); {len(state.output_ids)} tokens were generated"
            )
        if state.request.on_partial is not None:
            await state.request.on_partial(state)
        if failed:
            backoff = min(self.settings.failure_backoff_max_s, self.settings.failure_backoff_s * 2**state.num_failures)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))  # jittered backoff before the next try

    def _on_failure(self, replica: Replica, exc: BackendError, state: GenerationState) -> None:
        """A segment failed: re-raise what no other try can mend, else count the failure and blame the replica."""
        if not exc.retryable:
            raise exc
        state.num_failures += 1
        logger.warning(
            "request %s: replica %s failed after %d tokens: %s",
            state.request.request_id,
            replica.id,
            len(state.output_ids),
            exc,
            extra={"session_id": state.request.session_id, "replica": replica.id, "version": replica.version},
        )
        if isinstance(exc, ReplicaWentDown):
            self.interrupted_total += 1
            return  # the pool took the replica out itself
        if isinstance(exc, ReplicaStalled):
            self.stalled_total += 1
        if isinstance(exc, BackendUnavailable):
            self.pool.mark_unreachable(replica)
        else:
            self.pool.report_failure(replica)

    def _abort_in_background(self, replica: Replica, engine_request_id: str) -> None:
        """The caller left (or the segment broke): make sure the engine stops generating for nobody."""

        async def abort() -> None:
            try:
                await replica.backend.abort(engine_request_id)
            except BackendError as exc:
                logger.debug(
                    "abort of %s on %s failed: %s", engine_request_id, replica.id, exc, extra={"replica": replica.id}
                )

        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)  # hard reference until it ran
        task.add_done_callback(self._aborts.discard)

    async def aclose(self) -> None:
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=5)
