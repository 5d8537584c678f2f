"""Session records: creating a session's meta, reading it, recording activity on it, adding to its metadata; and
the record of a GRPO group's replica, shared by every gateway process (`GroupRecords`, `gateway.routing.groups`).

A session is indexed in `rg:sessions:active` before its meta is written (a crash in between leaves an id without
meta, which the idle sweeper drops), and every turn's activity raises its score there, never lowers it.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import orjson
from redis.asyncio.client import Pipeline

from gateway.errors import Conflict, InvalidRequest, SessionNotFound, StoreError
from gateway.store.backpressure import Backpressure
from gateway.store.core import StoreCore, Writes, meta_of
from gateway.store.keys import REDIS_ERRORS, call, text
from gateway.store.scripts import queue, rerun_unknown
from gateway.trajectory import SessionMeta

__all__ = ["Admission", "GroupRecords", "Sessions", "check_session_id", "metadata_additions"]

_SESSION_ID_MAX_LEN = 256


def metadata_additions(stored: Mapping[str, Any], metadata: Mapping[str, str], session_id: str) -> dict[str, str]:
    """The keys of a request's `metadata` (OpenAI's, str → str) that a session holding `stored` does not have yet.
    A key it holds with another value is `InvalidRequest`: a session's metadata (its task, its GRPO group) never
    changes under a trainer's feet. A stored non-string value (`POST /v1/sessions` takes any JSON) equals the string
    of its JSON (4 and "4")."""
    added: dict[str, str] = {}
    for key, value in metadata.items():
        if key not in stored:
            added[key] = value
        elif (old := stored[key]) != value and (isinstance(old, str) or orjson.dumps(old).decode() != value):
            raise InvalidRequest(
                f"metadata.{key} = {value!r} conflicts with session {session_id}'s {key} = {old!r}; a session's "
                "metadata keys are set once",
                param="metadata",
            )
    return added


def check_session_id(session_id: str) -> str:
    # Braces would change the Redis Cluster hash tag `{id}` and split a session's keys across slots.
    if not 0 < len(session_id) <= _SESSION_ID_MAX_LEN or "{" in session_id or "}" in session_id:
        raise InvalidRequest(
            f"session id must be 1-{_SESSION_ID_MAX_LEN} characters without braces", param="session_id"
        )
    return session_id


class Admission(Protocol):
    """What admits new sessions after backpressure: the staleness budget (`gateway.weights.budget`). Returns once
    `samples` new sessions are admitted (and counted); raises `Overloaded` where they are not."""

    async def admit(self, samples: int) -> None: ...


class Sessions:
    """Sessions' metas: creation (subject to backpressure, then `admission`), reads, activity, metadata."""

    def __init__(self, core: StoreCore, backpressure: Backpressure) -> None:
        self._core = core
        self._backpressure = backpressure
        self.admission: Admission | None = None  # the staleness budget, set where the gateway is assembled

    async def _admit(self, admitted: bool) -> None:
        """Backpressure, then the staleness budget (unless the caller `admitted` the session already: a group's)."""
        await self._backpressure.check()
        if self.admission is not None and not admitted:
            await self.admission.admit(1)

    async def create_session(
        self,
        metadata: dict[str, Any] | None = None,
        session_id: str | None = None,
        *,
        fresh: bool = False,
        absent: bool = False,
        owner: str | None = None,
        admitted: bool = False,
    ) -> SessionMeta:
        """A new active session (a fresh uuid unless `session_id` is given), of `owner` (`SessionMeta.owner`).

        An existing active session of that id is returned as is (and counts as activity); a finished or
        abandoned one is a `Conflict`. Only a new session is subject to backpressure: `Overloaded` while
        `rg:pending:sessions` ≥ `max_pending`; and then to `admission` (the staleness budget: it may hold the call,
        or refuse it), unless `admitted` (a group's members, admitted together). Concurrent creations of one id
        yield one session.

        `fresh`: the caller has just made `session_id` up from random bits, so no one else can know it; the session is
        written without looking for an existing one (two round trips instead of six). A generated id is fresh.
        `absent`: the caller has just found no session `session_id` (`touch_session`), so that read is not
        repeated; a creation of the same id meanwhile is still caught, as for any other.
        """
        if session_id is None or fresh:
            new_id = uuid.uuid4().hex if session_id is None else session_id
            if metadata:
                self._core.check_metadata(new_id, metadata)
            return await self._create_fresh(metadata, new_id, owner, admitted)
        session_id = check_session_id(session_id)
        if metadata:
            self._core.check_metadata(session_id, metadata)
        if not absent:
            existing = await self.touch_session(session_id)
            if existing is not None:
                return existing
        await self._admit(admitted)
        now = time.time()
        meta = SessionMeta(id=session_id, metadata=dict(metadata or {}), created_at=now, updated_at=now, owner=owner)
        before = await self._create_absent(meta)
        return meta if before is None else await self._reuse(before)

    async def _create_fresh(
        self, metadata: dict[str, Any] | None, session_id: str, owner: str | None, admitted: bool
    ) -> SessionMeta:
        """Write a session whose id nobody else knows: backpressure and budget, then index and meta in one round
        trip."""
        await self._admit(admitted)
        now = time.time()
        meta = SessionMeta(id=session_id, metadata=dict(metadata or {}), created_at=now, updated_at=now, owner=owner)
        keys = self._core.keys
        key = keys.meta(session_id)
        meta_fields = meta.to_redis()
        ttl_s = self._core.active_ttl_s

        def build(pipe: Pipeline) -> None:
            # In order on one connection, not a transaction (the index and the meta live in different slots of a
            # cluster): index first, data second, as `create_session` does.
            pipe.zadd(keys.active_sessions, {session_id: now}, nx=True)
            pipe.hset(key, mapping=meta_fields)  # type: ignore[arg-type]
            pipe.expire(key, ttl_s)

        await self._core.batched(build, "create session")
        return meta

    async def touch_session(self, session_id: str) -> SessionMeta | None:
        """An active session's meta, with activity recorded (one round trip: every turn of a session starts here);
        None if there is no such session. A finished or abandoned one is a `Conflict`."""
        meta = await self._read_and_touch(check_session_id(session_id))
        if meta is not None and meta.status != "active":
            raise Conflict(f"session {meta.id} is {meta.status}", param="session_id")
        return meta

    async def add_metadata(self, session_id: str, metadata: Mapping[str, str]) -> SessionMeta:
        """Add to an active session's metadata the keys of `metadata` it does not hold (`metadata_additions`: a key
        it holds with another value is `InvalidRequest`, and so is the whole past `StoreCore.check_metadata`; nothing
        is written then). Returns the meta as it is then.
        Unknown session: `SessionNotFound`; finished or abandoned: `Conflict`."""
        result: list[SessionMeta] = []

        def plan(before: SessionMeta | None) -> Writes | None:
            if before is None:
                raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
            if before.status != "active":
                raise Conflict(f"session {session_id} is {before.status}", param="session_id")
            added = metadata_additions(before.metadata, metadata, session_id)
            after = dataclasses.replace(before, metadata=before.metadata | added)
            if added:
                self._core.check_metadata(session_id, after.metadata)
            result.append(after)
            if not added:
                return None
            key, value = self._core.keys.meta(session_id), orjson.dumps(after.metadata)

            def writes(pipe: Pipeline) -> None:
                pipe.hset(key, "metadata", value)

            return writes

        await self._core.transact(check_session_id(session_id), plan, "add session metadata")
        return result[-1]

    async def _read_and_touch(self, session_id: str) -> SessionMeta | None:
        """The session's meta as it was, and activity recorded if it is active, in one round trip (every turn of a
        session starts here). The activity score is raised only for ids still indexed as active (XX) and never
        lowered (GT), as `save_sample` does."""
        keys, touch = self._core.keys, self._core.scripts.touch
        key, now = keys.meta(session_id), time.time()
        touch_args = (now, self._core.active_ttl_s)
        try:

            def build(pipe: Pipeline) -> None:
                pipe.hgetall(key)
                queue(pipe, touch, [key], touch_args)
                pipe.zadd(keys.active_sessions, {session_id: now}, xx=True, gt=True)

            raw, touched, indexed = await self._core.batcher.execute(build)
            touched = await rerun_unknown(touched, touch, [key], touch_args)
            for result in (raw, touched, indexed):
                if isinstance(result, Exception):
                    raise result
        except REDIS_ERRORS as exc:
            raise StoreError(f"redis: read session failed: {exc}") from exc
        return SessionMeta.from_redis(session_id, raw) if raw else None

    async def _reuse(self, meta: SessionMeta) -> SessionMeta:
        if meta.status != "active":
            raise Conflict(f"session {meta.id} is {meta.status}", param="session_id")
        now, keys = time.time(), self._core.keys
        touch = self._core.scripts.touch(keys=[keys.meta(meta.id)], args=[now, self._core.active_ttl_s])
        if await call(touch, "touch session"):
            await call(self._core.client.zadd(keys.active_sessions, {meta.id: now}, xx=True, gt=True), "touch")
        return meta

    async def _create_absent(self, meta: SessionMeta) -> SessionMeta | None:
        """Index the session, then write its meta unless one exists, in one batched pipeline (in that order: a crash
        in between leaves an id without meta, which the idle sweeper drops). The meta that existed, or None where
        this call created it; concurrent creations of one id create it once."""
        keys, create = self._core.keys, self._core.scripts.create_absent
        script_keys = [keys.meta(meta.id)]
        args = [self._core.active_ttl_s, *(part for name_value in meta.to_redis().items() for part in name_value)]

        def build(pipe: Pipeline) -> None:
            pipe.zadd(keys.active_sessions, {meta.id: meta.created_at}, nx=True)
            queue(pipe, create, script_keys, args)

        indexed, outcome = await call(self._core.batcher.execute(build), "create session")
        outcome = await call(rerun_unknown(outcome, create, script_keys, args), "create session")
        for reply in (indexed, outcome):
            if isinstance(reply, Exception):
                raise StoreError(f"redis: create session failed: {reply}") from reply
        return meta_of(meta.id, outcome[1]) if text(outcome[0]) == "exists" else None


class GroupRecords:
    """Records the replica of each GRPO group once: the first process to place a member of it decides."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    async def claim(self, group_id: str, replica_id: str, ttl_s: int) -> str:
        """Record `replica_id` as `group_id`'s replica for `ttl_s` unless one is recorded; the recorded one."""
        client, key = self._core.client, self._core.keys.group(group_id)
        for _ in range(2):  # the record may expire between the two commands: then ours is set on the second try
            if await call(client.set(key, replica_id, nx=True, ex=ttl_s), "record group placement"):
                return replica_id
            found = await call(client.get(key), "read group placement")
            if found is not None:
                return text(found)
        return replica_id
