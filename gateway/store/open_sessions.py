"""Open sessions per API key, counted across gateway processes in Redis (`server.max_open_sessions_per_key`).
On a gateway without API keys every session is the one key `anonymous`'s: the bound is then the gateway's own, over
all its processes. On by default (above the capacity target), so an open gateway cannot be filled with sessions.

Distinct from `gateway.session.quotas.SessionQuota` (`server.max_sessions_per_key`), which counts the sessions of a
key with a request in flight, in one process: this counts the sessions a key has created and not yet finished, over
every process on the Redis, whether a request is running or not.

One sorted set per key (`Keys.open_sessions`): its open sessions, each scored by when it expires idle (the server's
time + `store.session_idle_ttl_s` and a margin, pushed on at its turns). A session leaves it when finished, and an
abandoned one (its agent gone without finishing) once its score passes: every claim first trims the expired, so an
abandoned session frees its slot by itself. A process pushes a session's expiry on at most once per margin (its
turns in between cost no round trip); the margin keeps the session counted until the idle sweeper abandons it.
One-turn sessions (a request without a session) are not counted: they end with their request, which
`max_sessions_per_key` bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable

import redis.asyncio as aioredis

from gateway.errors import Overloaded, StoreError
from gateway.session.quotas import ANONYMOUS
from gateway.store.keys import Keys, call

__all__ = ["OpenSessions"]

logger = logging.getLogger(__name__)

# The share of the idle TTL by which a session's expiry is pushed on beyond it, and between two pushes of a process.
_MARGIN = 1 / 8
_MAX_REMEMBERED = 1 << 16  # sessions whose last push this process remembers

# Atomic on the key's one set: trim the expired, then count the session in unless the key is at its limit.
# ARGV: session id, limit, idle TTL (s). Answers -1 when counted (or already counted: its expiry pushed on), else
# the number of open sessions that refused it. The server's clock: every gateway process agrees on it.
_CLAIM = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    local open = redis.call('ZCARD', KEYS[1])
    if open >= tonumber(ARGV[2]) then
        return open
    end
end
redis.call('ZADD', KEYS[1], t + ttl, ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 1)
return -1
"""

# A turn of a counted session pushes its expiry on (XX: a session not counted is left out).
_TOUCH = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
if redis.call('ZADD', KEYS[1], 'XX', 'CH', t + tonumber(ARGV[2]), ARGV[1]) == 1 then
    redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 1)
end
return 0
"""


class OpenSessions:
    """At most `limit` open sessions per API key across gateway processes (0: no limit, and no Redis call)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, limit: int, idle_ttl_s: float) -> None:
        self.limit = limit
        self.idle_ttl_s = idle_ttl_s
        self._margin_s = idle_ttl_s * _MARGIN
        self._expiry_s = idle_ttl_s + self._margin_s  # a score is its push's time + this
        self._pushed: dict[str, float] = {}  # session -> when this process last pushed its expiry on (monotonic)
        self._client = client
        self._keys = keys
        self._claim = client.register_script(_CLAIM)
        self._touch = client.register_script(_TOUCH)

    async def claim(self, key: str, session_id: str) -> None:
        """Count a new session of `key` in (a session already counted stays counted): 429
        `too_many_open_sessions` when the key has `limit` open sessions."""
        if not self.limit:
            return
        args: list[str | float] = [session_id, self.limit, self._expiry_s]
        open_now = await call(self._claim(keys=[self._keys.open_sessions(key)], args=args), "count an open session")
        if int(open_now) >= 0:
            held = (
                f"{open_now} sessions made without an API key are open (one count for them all)"
                if key == ANONYMOUS
                else f"this API key has {open_now} open sessions"
            )
            raise Overloaded(
                f"{held}, the most server.max_open_sessions_per_key ({self.limit}) allows: finish one "
                f"(POST /v1/sessions/{{id}}/finish), or retry once one has been idle {self.idle_ttl_s:g} s (abandoned)",
                code="too_many_open_sessions",
                retry_after_s=1.0,
            )
        self._remember(session_id, time.monotonic())

    def claimed(self, key: str, session_ids: Iterable[str]) -> contextlib.AbstractAsyncContextManager[None]:
        """Claim a slot of `key` for each of `session_ids` (429 past the bound) while the block makes the sessions;
        if it raises, the slots claimed are given back (`_give_back`). Without a bound, nothing to claim."""
        return self._claimed(key, session_ids) if self.limit else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def _claimed(self, key: str, session_ids: Iterable[str]) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as claimed:
            for session_id in session_ids:
                await self.claim(key, session_id)
                claimed.push_async_callback(self._give_back, key, session_id)
            yield
            claimed.pop_all()

    async def _give_back(self, key: str, session_id: str) -> None:
        """Give back the slot of a session that was not made. Shielded, and quiet if Redis fails: the caller is
        raising its own error, and a slot left behind frees itself once it expires idle."""
        with contextlib.suppress(StoreError):
            await asyncio.shield(self.release(key, session_id))

    async def touch(self, key: str, session_id: str) -> None:
        """A turn of the session: its expiry moves on, so a session in use never leaves the count; not again within
        the margin of this process's last push (the score is still more than the idle TTL ahead of the turn).
        Where Redis does not answer (a restart, a failover) the turn goes on without it: the session stays counted
        until the expiry its last push set, and its next turn pushes again."""
        if not self.limit:
            return
        now = time.monotonic()
        last = self._pushed.get(session_id)
        if last is not None and now - last < self._margin_s:
            return
        args: list[str | float] = [session_id, self._expiry_s]
        try:
            await call(self._touch(keys=[self._keys.open_sessions(key)], args=args), "touch an open session")
        except StoreError as exc:
            logger.warning("open-session expiry not pushed on: %s", exc, extra={"session_id": session_id})
            return
        self._remember(session_id, now)

    def _remember(self, session_id: str, now: float) -> None:
        if len(self._pushed) >= _MAX_REMEMBERED:
            self._pushed = {s: t for s, t in self._pushed.items() if now - t < self._margin_s}
            if len(self._pushed) >= _MAX_REMEMBERED:
                self._pushed.clear()  # each session's next turn pushes again
        self._pushed[session_id] = now

    async def release(self, key: str, session_id: str) -> None:
        """The session is finished (or was never made): its slot is free."""
        if self.limit:
            self._pushed.pop(session_id, None)
            await call(self._client.zrem(self._keys.open_sessions(key), session_id), "release an open session")

    async def count(self, key: str) -> int:
        """The open sessions of `key` now (expired ones left out)."""
        key_name = self._keys.open_sessions(key)
        now = await call(self._client.time(), "read the server's time")
        return int(await call(self._client.zcount(key_name, now[0] + now[1] / 1e6, "+inf"), "count open sessions"))
