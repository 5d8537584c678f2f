"""A turn of a session from beginning to end in this process, step by step (docs/architecture.md §7):

1. **lock**: the session's `turn` lock (`SessionLocks.turn`): the turns of one session never interleave here;
2. **load**: `SessionManager.open` records activity and checks this process's copy of the session's samples
   against the stored revision, reading them back if another process (or a lost write) moved it;
3. **turn**: `SessionManager.begin_*_turn` finds the sample the turn extends and `TurnRunner` generates (partial
   samples are saved at segment boundaries); once the request is validated, a new session is created in Redis
   (`create`): a refused request stores nothing and releases the lock (`refused`);
4. **save**: `close` records every choice in its sample and saves it, shielded (a second cancellation must not
   half-write the turn);
5. **finish**: a one-turn session (the request named none) is finished with its turn; then the locks are released.

`begin` does 1 and 2 (`begin_group` for the member sessions of a group), `create` and `refused` end 3, `close` does
4 and 5. Shutdown waits for the turns still open, and their final writes (`drain`).

Write order: the sample writes of a session go through the store's write buffer, which takes the session's
`writes` lock (`SessionLocks.writes`, of the same map) for each, direct or flushed: a turn's writes of a sample are
awaited one after the other, and a write never waits for a turn (the flusher runs outside every turn).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from gateway.errors import Conflict, SessionNotFound, StoreError
from gateway.routing import ReplicaPool
from gateway.session.quotas import ANONYMOUS
from gateway.session.samples import SessionManager
from gateway.store import metadata_additions
from gateway.store.open_sessions import OpenSessions
from gateway.trajectory import SessionMeta

if TYPE_CHECKING:
    from gateway.turns.runner import PreparedTurn

__all__ = ["SessionLifecycle", "check_owner"]


def check_owner(meta: SessionMeta | None, owner: str | None) -> None:
    """A session another API key created is a 404 to this one, as if there were none: a key reads, extends and
    finishes only its own sessions. Sessions made without API keys (no owner) are open to all."""
    if meta is not None and meta.owner is not None and meta.owner != owner:
        raise SessionNotFound(f"no session {meta.id!r}", param="session_id")


class SessionLifecycle:
    """Begins and closes the turns of sessions (see the module docstring). `store`: the `TrajectoryStore`;
    `pool`: where a session placed by an earlier turn is remembered."""

    def __init__(
        self, sessions: SessionManager, store: Any, pool: ReplicaPool, open_sessions: OpenSessions | None = None
    ) -> None:
        """`open_sessions`: the per-key bound on open sessions (none if None)."""
        self.sessions = sessions
        self.store = store
        self.pool = pool
        self.open_sessions = open_sessions
        self._open = 0  # turns begun and not yet closed
        self._recording: set[asyncio.Task[None]] = set()  # hard references to shielded final writes
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lock, load ------------------------------------------------------------------------------------------

    async def lock(self, session_id: str) -> asyncio.Lock:
        """Take the session's turn lock; the turn is open until `release`."""
        lock = self.sessions.lock(session_id)
        await lock.acquire()
        self._open += 1
        self._idle.clear()
        return lock

    def release(self, lock: asyncio.Lock) -> None:
        lock.release()
        self._open -= 1
        self._check_idle()

    async def begin(
        self, session_id: str, *, new: bool = False, owner: str | None = None
    ) -> tuple[asyncio.Lock, SessionMeta | None]:
        """Lock the session and load it: the lock the turn holds, and the session's stored meta (None: none yet).
        `new`: the id was just made up for a one-turn session (nothing to read). `owner`: the caller's key id; a
        session another key created is a 404, as if there were none (`check_owner`). Failing, the lock is
        released."""
        lock = await self.lock(session_id)
        try:
            meta = await self.sessions.open(session_id, new=new)
            check_owner(meta, owner)
            return lock, meta
        except BaseException:
            self.refused(session_id, new, lock)
            raise

    async def begin_group(self, base: str, members: list[str]) -> list[asyncio.Lock]:
        """Lock and load the member sessions of a group, all new (an existing one is a `Conflict`): the locks the
        turn holds. Failing, every lock taken is released."""
        locks: list[asyncio.Lock] = []
        try:
            for member in members:  # in one order: two requests of one group cannot each hold a lock the other needs
                locks.append(await self.lock(member))
            for member in members:
                if await self.sessions.open(member) is not None:
                    raise Conflict(
                        f"session {member} exists: the {len(members)} sessions of a group are new ({base}-0 ... "
                        f"{base}-{len(members) - 1}); name another session for this group",
                        param="session_id",
                    )
            return locks
        except BaseException:
            for lock in locks:
                self.release(lock)
            raise

    # -- create, or refuse -----------------------------------------------------------------------------------

    async def create(
        self,
        session_id: str,
        one_turn: bool,
        meta: SessionMeta | None,
        metadata: dict[str, str] | None = None,
        owner: str | None = None,
    ) -> None:
        """Record the session in Redis unless `meta` says it is there, after the request was validated (a refused
        request stores nothing), with the request's `metadata` (`gateway.turns.runner`). A new session is refused with
        429 while the trainer lags (backpressure)."""
        if one_turn:
            # 128 random bits we just made: nobody else can know the id.
            await self.store.create_session({**(metadata or {}), "one_turn": True}, session_id, fresh=True, owner=owner)
            return
        if meta is None:
            await self._claim(owner, session_id)
            try:
                meta = await self.store.create_session(dict(metadata or {}), session_id, absent=True, owner=owner)
            except BaseException:
                await self._release(owner, session_id)
                raise
            check_owner(meta, owner)  # another key created it meanwhile
        elif self.open_sessions is not None:
            await self.open_sessions.touch(owner or ANONYMOUS, session_id)
        if metadata and metadata_additions(meta.metadata, metadata, session_id):
            await self.store.add_metadata(session_id, metadata)  # checks again against what is stored then
        if meta.replica:  # placed by an earlier turn, maybe in another gateway process: follow it
            self.pool.remember(session_id, meta.replica)

    async def create_group(self, members: list[str], metadata: dict[str, Any], owner: str | None = None) -> None:
        """Record the member sessions of a group in Redis, member i with `group_index` i; each one counts as an open
        session of the key (none is made if they do not all fit)."""
        claimed: list[str] = []
        try:
            for member in members:
                await self._claim(owner, member)
                claimed.append(member)
            for index, member in enumerate(members):
                await self.store.create_session(metadata | {"group_index": index}, member, absent=True, owner=owner)
        except BaseException:
            for member in claimed:
                await self._release(owner, member)
            raise

    async def _claim(self, owner: str | None, session_id: str) -> None:
        if self.open_sessions is not None:
            await self.open_sessions.claim(owner or ANONYMOUS, session_id)

    async def _release(self, owner: str | None, session_id: str) -> None:
        """Give back the slot of a session that was not made. Shielded, and quiet if Redis fails: the caller is
        raising its own error, and a slot left behind frees itself once it expires idle."""
        if self.open_sessions is not None:
            with contextlib.suppress(StoreError):
                await asyncio.shield(self.open_sessions.release(owner or ANONYMOUS, session_id))

    def refused(self, session_id: str, one_turn: bool, lock: asyncio.Lock) -> None:
        """The turn ends before it generated: nothing of it is stored; the lock is released."""
        if one_turn:
            self.sessions.forget(session_id)  # nothing of it was stored, and nobody will send its id again
        self.release(lock)

    # -- save, finish ----------------------------------------------------------------------------------------

    async def close(self, prepared: PreparedTurn) -> None:
        """Record every choice in its sample, store it, finish a one-turn session; release the session locks."""
        if prepared.closed:
            return
        prepared.closed = True
        try:
            # Shielded: a second cancellation (client gone, shutdown past its bound) must not half-write the turn.
            record = asyncio.ensure_future(self._record(prepared))
            self._recording.add(record)
            record.add_done_callback(self._recorded)
            await asyncio.shield(record)
        finally:
            for lock in prepared.locks:
                self.release(lock)
            for lease in prepared.leases:
                lease.release()

    async def _record(self, prepared: PreparedTurn) -> None:
        try:
            for turn, state, assistant in prepared.replies():
                sample = self.sessions.record(turn, state, assistant)
                replicas = state.replica_ids
                await self.sessions.save(turn, sample, replica=replicas[-1] if replicas else None)
        finally:
            if prepared.one_turn:
                self.sessions.forget(prepared.session_id)  # it ends with this turn
        cancelled = any(c.state.cancelled or c.state.finish_reason is None for c in prepared.choices)
        if prepared.one_turn and not cancelled:
            await self.store.finish(prepared.session_id, None, None)

    # -- shutdown --------------------------------------------------------------------------------------------

    def _recorded(self, task: asyncio.Task[None]) -> None:
        self._recording.discard(task)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._open and not self._recording:
            self._idle.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every open turn is closed and its final write done. Shutdown runs this before
        the store closes: the server cancels requests past its grace period without waiting for them, and a
        cancelled turn still records its tokens so far (a checkpoint the next process continues from)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
