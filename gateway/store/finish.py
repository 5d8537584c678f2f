"""Finishing a session: idempotent, shielded from cancellation, retried for `retry_budget_s`, and returning only
once the session is in `rg:trajectories` (what it returns is acknowledged and durable per the server's AOF policy).

Its steps, each idempotent, so a crash between any two is repaired by re-running them (`repair_undelivered`):
(1) flush the session's buffered writes; SADD `rg:sessions:undelivered`; (2) one WATCHed transaction on the
session slot: status finished, reward, metadata, finished_at, EXPIRE ttl_s on meta and samples; ZREM
`rg:sessions:active` (a finish with no metadata to merge, every one-turn session's, sends the SADD, a script
doing (2) on an active session, and the ZREM as one pipeline; a session that is not active goes the way just
described); (3)-(5) deliver it to the stream (gateway/store/delivery.py). Where `redis.durable_replicas` asks for
replicas, the finish is answered only once they hold it (gateway/store/slot_clients.py); until then it is retried, as
a finish Redis did not take is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any

from redis.asyncio.client import Pipeline

from gateway.errors import Conflict, GatewayError, InvalidRequest, SessionNotFound, StoreError
from gateway.store.buffer import WriteBuffer
from gateway.store.core import StoreCore, Writes, backoff_s, meta_of
from gateway.store.delivery import Delivery
from gateway.store.keys import call, text
from gateway.store.scripts import FINISH_ACTIVE
from gateway.trajectory import SessionMeta

__all__ = ["Finisher", "check_rewards"]

logger = logging.getLogger(__name__)


def check_rewards(meta: SessionMeta, rewards: list[float] | None) -> None:
    if rewards is not None and len(rewards) != meta.sample_count:
        raise InvalidRequest(
            f"rewards has {len(rewards)} entries; session {meta.id} has {meta.sample_count} samples (one reward per "
            "sample, in index order)",
            param="rewards",
        )


def _check_same_rewards(meta: SessionMeta, reward: float | None, rewards: list[float] | None) -> None:
    """A finish of a finished session answers its entry again, unless it names other rewards: that is a 409, never
    a silent 200 that drops them."""
    if (reward is not None and reward != meta.reward) or (rewards is not None and rewards != meta.rewards):
        raise _other_rewards(meta.id, meta.reward, meta.rewards)


def _other_rewards(session_id: str, reward: float | None, rewards: list[float] | None) -> Conflict:
    given = f"reward {reward}" if rewards is None else f"rewards {rewards}"
    message = f"session {session_id} is finished with {given}; a finish with other rewards is refused"
    return Conflict(message, param="reward")


class Finisher:
    """Runs finishes (see the module docstring); `finishing` holds the runs in flight in this process, by session
    (hard references: the event loop keeps only weak ones)."""

    def __init__(
        self,
        core: StoreCore,
        buffer: WriteBuffer,
        delivery: Delivery,
        finishing: dict[str, asyncio.Task[str]],
        *,
        retry_budget_s: float,
    ) -> None:
        self._core = core
        self._buffer = buffer
        self._delivery = delivery
        self.finishing = finishing
        self.retry_budget_s = retry_budget_s
        self._asked: dict[str, tuple[float | None, list[float] | None]] = {}  # the rewards of each finish in flight

    async def finish(
        self,
        session_id: str,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        rewards: list[float] | None = None,
    ) -> str:
        """Finish the session and return its entry id in `rg:trajectories`; see `TrajectoryStore.finish`."""
        task = self.finishing.get(session_id)
        if task is None:
            task = asyncio.ensure_future(self._finish_with_retries(session_id, reward, metadata, rewards))
            task.set_name(f"finish-{session_id}")
            self.finishing[session_id] = task
            self._asked[session_id] = (reward, rewards)
            task.add_done_callback(functools.partial(self._finish_done, session_id))
        elif self._asked.get(session_id) != (reward, rewards) and (reward is not None or rewards is not None):
            first = self._asked.get(session_id, (None, None))
            raise _other_rewards(session_id, first[0], first[1])
        return await asyncio.shield(task)

    def _finish_done(self, session_id: str, task: asyncio.Task[str]) -> None:
        if self.finishing.get(session_id) is task:
            del self.finishing[session_id]
            self._asked.pop(session_id, None)
        # Retrieved here because every caller may have left; errors of ours reached whoever still waited.
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not isinstance(exc, GatewayError):
            logger.error("session=%s: finish crashed", session_id, exc_info=exc)

    async def _finish_with_retries(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None
    ) -> str:
        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            try:
                return await self._finish_once(session_id, reward, metadata, rewards)
            except StoreError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreError(
                        f"session {session_id}: not finished, redis unavailable for the whole retry budget "
                        f"({self.retry_budget_s:g}s): {exc}"
                    ) from exc
                attempt += 1
                self._core.stats.finish_retries += 1
                delay = min(remaining, backoff_s(attempt))
                logger.warning("session=%s: finish failed (%s); retry %d in %.2fs", session_id, exc, attempt, delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    async def _finish_once(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None
    ) -> str:
        client, keys = self._core.client, self._core.keys
        await self._buffer.flush(session_id)  # (1) what the trainer gets includes every buffered write
        if not metadata and rewards is None:  # nothing to merge: (1) and (2) in one round trip, shared with others
            finished = await self._finish_active(session_id, reward)
            if finished is not None:
                return await self._delivery.deliver(finished)
        meta = await self._core.get_session(session_id)
        if meta is None:
            raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
        if meta.status == "abandoned":
            raise Conflict(f"session {session_id} was abandoned (idle); it cannot be finished", param="session_id")
        if meta.stream_id is not None:  # delivered before: make sure the repair set forgets it, answer the same id
            await call(client.srem(keys.undelivered, session_id), "confirm delivery")
            _check_same_rewards(meta, reward, rewards)
            await self._delivery.confirm_durable(meta)
            return meta.stream_id
        if meta.status == "finished":  # not delivered yet: it stays in the repair set, which delivers it
            _check_same_rewards(meta, reward, rewards)
        if meta.status == "active":
            check_rewards(meta, rewards)  # before the session is registered for repair: a refusal leaves no trace
        # Registered for repair BEFORE the status changes, so no crash can leave a finished, undelivered session
        # that nothing will deliver.
        await call(client.sadd(keys.undelivered, session_id), "register finish")
        try:
            meta = await self.mark_finished(session_id, reward, metadata, rewards)  # (2)
        except InvalidRequest:  # rewards that a sample written meanwhile made too few: still active, not finished
            await call(client.srem(keys.undelivered, session_id), "forget undelivered")
            raise
        await call(client.zrem(keys.active_sessions, session_id), "unindex session")
        return await self._delivery.deliver(meta)  # (3)-(5)

    async def _finish_active(self, session_id: str, reward: float | None) -> SessionMeta | None:
        """Steps (1) and (2) and the unindexing of an active session, in one batched pipeline, in the order of the
        general path (SADD before the status changes, ZREM after): the meta as finished, or None where the session
        was not active, which the general path then answers (not found, abandoned, finished before). Such an id
        is taken out of the repair set again unless it is finished and undelivered, as the general path leaves it."""
        keys = self._core.keys
        now = time.time()
        args = (now, self._core.ttl_s, "" if reward is None else repr(reward), keys.sample(session_id, 0)[:-1])

        def build(pipe: Pipeline) -> None:
            pipe.sadd(keys.undelivered, session_id)
            # The source, not a script object's SHA: a NOSCRIPT reply (a restarted server forgot the script) would
            # not stop the ZREM queued after it, leaving the session unindexed but still active.
            pipe.eval(FINISH_ACTIVE, 1, keys.meta(session_id), *args)
            pipe.zrem(keys.active_sessions, session_id)

        _, answer, _ = await self._core.batched(build, "finish session")
        if text(answer[0]) == "finished":
            return meta_of(session_id, answer[1])
        if text(answer[1]) != "finished":
            await call(self._core.client.srem(keys.undelivered, session_id), "forget undelivered")
        return None

    async def mark_finished(
        self, session_id: str, reward: float | None, metadata: dict[str, Any] | None, rewards: list[float] | None = None
    ) -> SessionMeta:
        """Step (2): the session-slot transaction. Returns the meta as finished (the first finish's, if any)."""
        now = time.time()
        result: list[SessionMeta] = []

        def plan(before: SessionMeta | None) -> Writes | None:
            if before is None:
                raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
            if before.status == "abandoned":
                raise Conflict(f"session {session_id} was abandoned (idle); it cannot be finished", param="session_id")
            if before.status == "finished":
                _check_same_rewards(before, reward, rewards)  # finished by another process since the check above
                result.append(before)
                return None
            merged = before.metadata | (metadata or {})
            if metadata:
                self._core.check_metadata(session_id, merged)
            if rewards is not None:
                check_rewards(before, rewards)  # a sample written since the check above (another turn)
            after = dataclasses.replace(
                before,
                status="finished",
                reward=reward,
                rewards=rewards,
                metadata=merged,
                finished_at=now,
                updated_at=now,
            )
            result.append(after)
            return self._core.writes_closing(after, after.to_redis())

        await self._core.transact(session_id, plan, "finish session")
        return result[-1]
