"""A policy's teacher (on-policy distillation, docs/architecture.md §5 "Teachers"): each finished session with
samples waits at the delivery gate (`gateway.store.delivery`) until a teacher pool scored every sample's response,
then it is delivered. The agent never waits for it: its finish answers at once (`scoring`).

The scorer runs in every gateway process of the policy. A finish queues the session (`ScoringQueue`) and wakes this
process's scorer; each round takes the waiting sessions, several at once, each under a lease, scores each sample with
one prefill on a replica of its teacher pool (`backends.scoring`; the next replica on a failure), writes the scores
beside the sample, marks the meta `scored` and delivers. A teacher that fails is tried again each round until the
session's deadline (`teacher.deadline_s`), and a hung one is waited for only until then; then the session is
delivered marked `unscored`. A session whose metadata names a
teacher (`teacher.by_metadata`, `teacher.models`) goes to that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.errors import BackendError, BackendUnavailable
from backends.lora import adapter_name
from backends.scoring import PromptScores
from gateway.background import background, stop
from gateway.config.pools import TeacherConfig
from gateway.errors import SessionNotFound, StoreError
from gateway.routing import ReplicaPool
from gateway.store import TrajectoryStore
from gateway.store.core import Fields
from gateway.store.delivery import AWAITING_SCORES
from gateway.teacher.queue import ScoringQueue
from gateway.trajectory import Sample, SessionMeta, TrajectoryFormatError
from gateway.weights import WeightCoordinator

__all__ = ["TeacherPool", "TeacherScoring", "teacher_fields"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TeacherPool:
    """What scoring needs of a teacher pool: its replicas, its weight version, and its adapter where the teacher is
    a LoRA adapter of what its engines serve (each version's engine adapter named per call)."""

    name: str
    pool: ReplicaPool
    weights: WeightCoordinator
    adapter: str | None = None

    @property
    def label(self) -> str:
        """What a scored session's meta names: `model@version`."""
        return f"{self.name}@{self.weights.version}"

    def served_adapter(self) -> str | None:
        return None if self.adapter is None else adapter_name(self.adapter, self.weights.version)


def teacher_fields(scores: PromptScores) -> Fields:
    """A sample's teacher fields in its hash (`Sample.teacher_logprobs`)."""
    return {
        "teacher_logprobs": scores.logprobs.tobytes(),
        "teacher_top_k": str(scores.top_ids.shape[1]).encode(),
        "teacher_top_ids": scores.top_ids.tobytes(),
        "teacher_top_logprobs": scores.top_logprobs.tobytes(),
    }


class TeacherScoring:
    """One policy pool's scorer (see the module docstring); the gate its store holds finished sessions at."""

    def __init__(
        self,
        store: TrajectoryStore,
        queue: ScoringQueue,
        config: TeacherConfig,
        teachers: Mapping[str, TeacherPool],
        *,
        poll_s: float = 1.0,
        batch: int = 64,
        concurrency: int = 8,
    ) -> None:
        self.store, self.queue, self.config, self.teachers = store, queue, config, teachers
        self.poll_s, self.batch, self.concurrency = poll_s, batch, concurrency
        self.owner = uuid.uuid4().hex
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.scored_total = self.unscored_total = self.failures_total = 0

    async def enqueue(self, session_id: str) -> None:
        await self.queue.enqueue(session_id)
        self._wake.set()

    def start(self) -> None:
        self._task = background(self._run(), "teacher-scoring")

    async def aclose(self) -> None:
        await stop(self._task)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.round()
            except StoreError as exc:
                logger.warning("teacher scoring: redis unavailable (%s); trying again", exc)
            except Exception:  # the scorer outlives whatever one round met: the next round tries again
                logger.exception("teacher scoring: a round failed; trying again")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()

    async def round(self) -> int:
        """Score and deliver each waiting session no other process holds (or deliver it unscored past its
        deadline), `concurrency` at a time (a hung teacher holds up only its own sessions); how many were
        delivered."""
        limit = asyncio.Semaphore(self.concurrency)

        async def take(session_id: str, deadline: float) -> int:
            async with limit:
                if not await self.queue.claim(session_id, self.owner):
                    return 0
                try:
                    return await self._take(session_id, deadline)
                finally:
                    await self.queue.release(session_id)

        waiting = await self.queue.waiting(self.batch)
        outcomes = await asyncio.gather(*(take(*entry) for entry in waiting), return_exceptions=True)
        for (session_id, _), outcome in zip(waiting, outcomes, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # a cancellation: the scorer is stopping
            if isinstance(outcome, Exception):
                logger.error("session=%s: scoring failed; trying again", session_id, exc_info=outcome)
        return sum(outcome for outcome in outcomes if isinstance(outcome, int))

    async def _take(self, session_id: str, deadline: float) -> int:
        meta = await self.store.get_session(session_id)
        if meta is None or meta.stream_id is not None:  # expired, or delivered before
            await self.queue.done(session_id)
            return 0
        if meta.scoring is None:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.time())):  # a hung teacher: only until then
                    await self.score(meta, final=True)
                self.scored_total += 1
            except (BackendError, TrajectoryFormatError, TimeoutError) as exc:  # the teacher failed, or a sample is bad
                self.failures_total += 1
                if time.time() < deadline:
                    logger.warning("session=%s: the teacher could not score it (%s); trying again", session_id, exc)
                    return 0
                logger.error("session=%s: not scored by its deadline (%s); delivered unscored", session_id, exc)
                teacher = self.teacher_for(meta)
                await self.store.save_teacher_scores(session_id, {}, scoring="unscored", teacher=teacher.label)
                self.unscored_total += 1
        if await self.store.deliver_finished(session_id) == AWAITING_SCORES:
            return 0
        await self.queue.done(session_id)
        return 1

    def teacher_for(self, meta: SessionMeta) -> TeacherPool:
        """The session's teacher: the one its metadata names (`teacher.by_metadata`), else the default."""
        config = self.config
        chosen = config.model
        if config.by_metadata is not None and config.by_metadata in meta.metadata:
            chosen = config.models.get(str(meta.metadata[config.by_metadata]), config.model)
        return self.teachers[chosen]

    async def score(self, meta: SessionMeta, *, final: bool) -> dict[int, PromptScores]:
        """Score each sample of the session now and store the scores; `final`: the meta says `scored` too."""
        teacher = self.teacher_for(meta)
        scores: dict[int, PromptScores] = {}
        for index, sample in (await self.store.indexed_samples(meta.id)).items():
            if sample.response_ids.size:
                scores[index] = await self._score_sample(teacher, sample)
        fields = {index: teacher_fields(found) for index, found in scores.items()}
        await self.store.save_teacher_scores(
            meta.id, fields, scoring="scored" if final else None, teacher=teacher.label
        )
        return scores

    async def _score_sample(self, teacher: TeacherPool, sample: Sample) -> PromptScores:
        ids, start = sample.input_ids.tolist(), int(sample.prompt_ids.size)
        tried: list[str] = []
        while True:
            replica = teacher.pool.pick(None, tried)
            if replica is None:
                raise BackendUnavailable(f"no replica of the teacher {teacher.name!r} can score (tried {tried})")
            try:
                with teacher.pool.lease(replica):
                    scores = await replica.backend.scorer.score(ids, start, self.config.top_k, teacher.served_adapter())
            except BackendError as exc:
                logger.warning("teacher %s: replica %s failed to score: %s", teacher.name, replica.id, exc)
                teacher.pool.report_failure(replica)
                tried.append(replica.id)
                continue
            teacher.pool.report_success(replica)
            return scores

    async def score_now(self, session_id: str) -> dict[str, Any]:
        """`POST /v1/sessions/{id}/score`: score the session's samples now; a finished session waiting for its
        teacher is delivered."""
        meta = await self.store.get_session(session_id)
        if meta is None:
            raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
        finished = meta.status == "finished"
        scores = await self.score(meta, final=finished)
        stream_id = await self.store.deliver_finished(session_id) if finished else ""
        if stream_id and stream_id != AWAITING_SCORES:
            await self.queue.done(session_id)
        return {
            "id": session_id,
            "object": "session.scores",
            "teacher": self.teacher_for(meta).label,
            "samples": [{"index": index, "tokens": len(found)} for index, found in scores.items()],
            "delivered": bool(stream_id) and stream_id != AWAITING_SCORES,
            "stream_id": stream_id if stream_id and stream_id != AWAITING_SCORES else None,
        }
