"""The sessions that wait for a teacher's scores before delivery (`rg:scoring`, a sorted set scored by each one's
deadline), and the lease a process holds while it scores one (`rg:{id}:scoring`, in the session's slot).

Every step is idempotent, as delivery's are: a finish that reaches the gate again (a retry, the repair sweeper) adds
nothing (ZADD NX keeps the first deadline); a process that dies while scoring leaves its lease to expire, and the
session to the next process that finds it due; a session delivered twice over is delivered once (its `stream_id`).
"""

from __future__ import annotations

import time
from typing import cast

import redis.asyncio as aioredis

from gateway.store.keys import Keys, call, text

__all__ = ["ScoringQueue"]


class ScoringQueue:
    """One policy pool's sessions waiting for its teacher (`deadline_s` each, from when it reached the gate)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, deadline_s: float, lease_s: float = 60.0) -> None:
        self._client, self._keys, self.deadline_s, self.lease_ms = client, keys, deadline_s, int(lease_s * 1000)

    async def enqueue(self, session_id: str) -> None:
        deadline = time.time() + self.deadline_s
        await call(self._client.zadd(self._keys.scoring, {session_id: deadline}, nx=True), "queue scoring")

    async def waiting(self, limit: int) -> list[tuple[str, float]]:
        """The first `limit` waiting sessions, the earliest deadline first: (session id, deadline)."""
        rows = await call(self._client.zrange(self._keys.scoring, 0, limit - 1, withscores=True), "read scoring")
        return [(text(member), float(deadline)) for member, deadline in cast(list[tuple[bytes, float]], rows)]

    async def deadline(self, session_id: str) -> float | None:
        """When `session_id` is delivered unscored at the latest; None: it waits for no teacher."""
        score = await call(self._client.zscore(self._keys.scoring, session_id), "read scoring")
        return None if score is None else float(score)

    async def claim(self, session_id: str, owner: str) -> bool:
        """Take the session's lease (False: another process scores it now)."""
        lease = self._keys.scoring_lease(session_id)
        taken = await call(self._client.set(lease, owner, nx=True, px=self.lease_ms), "claim scoring")
        return bool(taken)

    async def release(self, session_id: str) -> None:
        await call(self._client.delete(self._keys.scoring_lease(session_id)), "release scoring")

    async def done(self, session_id: str) -> None:
        """The session is delivered (or gone): it waits no more."""
        await call(self._client.zrem(self._keys.scoring, session_id), "end scoring")

    async def size(self) -> int:
        return int(await call(self._client.zcard(self._keys.scoring), "count scoring"))
