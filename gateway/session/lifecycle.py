"""A turn of a session from beginning to end in this process, step by step (docs/architecture.md §7):

1. **lock**: the session's `turn` lock (`SessionLocks.turn`): the turns of one session never interleave here;
2. **load**: `SessionManager.open` records activity and checks this process's copy of the session's samples
   against the stored revision, reading them back if another process (or a lost write) moved it;
3. **turn**: `SessionManager.begin_*_turn` finds the sample the turn extends and `TurnRunner` generates (partial
   samples are saved at segment boundaries); once the request is validated, a new session is created in Redis
   (`create`): a refused request stores nothing and releases the lock (`refused`);
4. **save**: `record` records every choice in its sample and saves it, shielded (a second cancellation must not
   half-write the turn);
5. **finish**: a one-turn session (the request named none) is finished with its turn; then the locks are released.

`begin` does 1 and 2 (`begin_group` for the member sessions of a group) and returns the turn's `OpenTurn`, which
holds the locks and the caller's session slot; `create` ends 3. Closing the `OpenTurn` (one `async with`, in
`gateway.api.turn_http`) does 4 and 5 (`record`), or for a turn refused before it was handed over, stores nothing
(`refused`), and releases what it holds, exactly once. Shutdown waits for the turns still open, and their final
writes (`drain`).

Write order: the sample writes of a session go through the store's write buffer, which takes the session's
`writes` lock (`SessionLocks.writes`, of the same map) for each, direct or flushed: a turn's writes of a sample are
awaited one after the other, and a write never waits for a turn (the flusher runs outside every turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from gateway.errors import Conflict, SampleStale, SessionNotFound
from gateway.generation import StalenessCheck
from gateway.routing import ReplicaPool
from gateway.session.open_turn import OpenTurn, RecordedTurn
from gateway.session.quotas import ANONYMOUS, SessionQuota
from gateway.session.samples import SessionManager, Turn
from gateway.store import metadata_additions
from gateway.store.open_sessions import OpenSessions
from gateway.trajectory import SessionMeta

__all__ = ["SessionLifecycle", "check_owner", "owner_of"]


def check_owner(meta: SessionMeta | None, owner: str | None) -> None:
    """A session another API key created is a 404 to this one, as if there were none: a key reads, extends and
    finishes only its own sessions. Sessions made without API keys (no owner) are open to all."""
    if meta is not None and meta.owner is not None and meta.owner != owner:
        raise SessionNotFound(f"no session {meta.id!r}", param="session_id")


def owner_of(key: str) -> str | None:
    """The owner of the sessions a caller creates, and the only one that may use them (`SessionMeta.owner`): its key
    id (`gateway.session.quotas.key_id`); None on a gateway without API keys."""
    return None if key == ANONYMOUS else key


class SessionLifecycle:
    """Begins and closes the turns of sessions (see the module docstring). `store`: the `TrajectoryStore`;
    `pool`: where a session placed by an earlier turn is remembered; `quota`: the per-key bound on sessions with a
    request in flight; `open_sessions`: the per-key bound on open sessions (none if None)."""

    def __init__(
        self,
        sessions: SessionManager,
        store: Any,
        pool: ReplicaPool,
        open_sessions: OpenSessions | None = None,
        quota: SessionQuota | None = None,
    ) -> None:
        self.sessions = sessions
        self.store = store
        self.pool = pool
        self.open_sessions = open_sessions
        self.quota = quota if quota is not None else SessionQuota(0)
        self.staleness: StalenessCheck | None = None  # the staleness budget (none: no turn is refused as stale)
        self._open = 0  # turns begun and not yet closed
        self._recording: set[asyncio.Task[None]] = set()  # hard references to shielded final writes
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lock, load ------------------------------------------------------------------------------------------

    async def _lock(self, turn: OpenTurn, session_id: str) -> None:
        """Take the session's turn lock for `turn`, which releases it when it closes."""
        lock = self.sessions.lock(session_id)
        await lock.acquire()
        self._open += 1
        self._idle.clear()
        turn.hold(lambda: self._release(lock))

    def _release(self, lock: asyncio.Lock) -> None:
        lock.release()
        self._open -= 1
        self._check_idle()

    async def begin(self, session_id: str | None, key: str, *, kind: str = "chat") -> OpenTurn:
        """Take the caller's session slot (`key`: its key id; 429 past `server.max_sessions_per_key`), lock the
        session and load it. `session_id` None: a one-turn session, its id made up here as `<kind>-<random>`
        (nothing to read). A session another key created is a 404, as if there were none (`check_owner`). Failing,
        the turn is closed: nothing stored, everything released."""
        one_turn = session_id is None
        sid = session_id or new_session_id(kind)
        turn = OpenTurn(self, sid, one_turn=one_turn, owner=owner_of(key))
        async with turn.closed_on_error():
            turn.hold(self.quota.acquire(key, session_id).release)
            await self._lock(turn, sid)
            turn.meta = await self.sessions.open(sid, new=one_turn)
            check_owner(turn.meta, turn.owner)
        return turn

    async def begin_group(self, base: str, key: str, size: int, *, named: bool = True) -> OpenTurn:
        """Take the caller's session slot (for the session `base` if the request `named` it, else one of its own),
        then lock and load the `size` member sessions of a group, `<base>-<i>`, all new (an existing one is a
        `Conflict`). Failing, the turn is closed: everything released."""
        turn = OpenTurn(self, base, owner=owner_of(key))
        # The choices are placed as `base`, which no later turn names: its placement goes with the turn.
        turn.hold(lambda: self.pool.forget(base))
        async with turn.closed_on_error():
            turn.hold(self.quota.acquire(key, base if named else None).release)
            members = group_members(base, size)
            for member in members:  # in one order: two requests of one group cannot each hold a lock the other needs
                await self._lock(turn, member)
            for member in members:
                if await self.sessions.open(member) is not None:
                    raise Conflict(
                        f"session {member} exists: the {size} sessions of a group are new ({base}-0 ... "
                        f"{base}-{size - 1}); name another session for this group",
                        param="session_id",
                    )
        return turn

    async def check_fresh(self, turn: Turn) -> None:
        """`SampleStale` (410) for a turn that would extend a sample the staleness budget cut, or one whose first
        token has fallen behind it since (marked stale now, its tokens kept): that sample is never continued."""
        sample = turn.sample
        if turn.new_sample or self.staleness is None:
            return
        if not sample.stale:
            oldest = await self.staleness.stale_before()
            if oldest is None:
                return  # the budget is off
            first = sample.first_version
            if first is None or first >= oldest:
                return
            sample.stale = True
            await self.store.mark_stale(turn.session_id, turn.stored_index)
            self.staleness.count_cut()
        raise SampleStale(
            f"session {turn.session_id}: its sample {turn.stored_index} fell behind the staleness budget (first token "
            "sampled under a version older than the one served minus weights.max_staleness); it is kept, marked "
            "stale, and not continued: finish the session, or start a new one",
            param="session_id",
        )

    # -- create, or refuse -----------------------------------------------------------------------------------

    async def create(self, turn: OpenTurn, metadata: dict[str, str] | None = None) -> None:
        """Record the turn's session in Redis unless its meta says it is there, after the request was validated (a
        refused request stores nothing), with the request's `metadata` (see `gateway.turns.runner`). A new session
        is refused with 429 while the trainer lags (backpressure)."""
        session_id, owner, meta = turn.session_id, turn.owner, turn.meta
        if turn.one_turn:
            # 128 random bits we just made: nobody else can know the id.
            await self.store.create_session({**(metadata or {}), "one_turn": True}, session_id, fresh=True, owner=owner)
            return
        if meta is None:
            async with self._claimed(owner, [session_id]):
                meta = await self.store.create_session(dict(metadata or {}), session_id, absent=True, owner=owner)
            check_owner(meta, owner)  # another key created it meanwhile
        elif self.open_sessions is not None:
            await self.open_sessions.touch(owner or ANONYMOUS, session_id)
        if metadata and metadata_additions(meta.metadata, metadata, session_id):
            await self.store.add_metadata(session_id, metadata)  # checks again against what is stored then
        if meta.replica:  # placed by an earlier turn, maybe in another gateway process: follow it
            self.pool.remember(session_id, meta.replica)

    async def join_group(self, turn: OpenTurn, group: str, metadata: dict[str, str] | None) -> None:
        """The turn is a member of GRPO group `group`: if its session is not placed yet (a new member), agree on the
        group's replica with every gateway process before it is placed (`ReplicaPool.agree_group`)."""
        if (turn.meta is not None and turn.meta.replica) or turn.session_id in self.pool.placements:
            return
        size = (metadata or {}).get("group_size") or (turn.meta.metadata.get("group_size") if turn.meta else None)
        await self.pool.agree_group(group, _group_size(size))

    async def create_group(self, turn: OpenTurn, members: list[str], metadata: dict[str, Any]) -> None:
        """Record the member sessions of a group in Redis, member i with `group_index` i; each one counts as an open
        session of the key (none is made if they do not all fit)."""
        await self.store.admit(len(members))  # backpressure, and the staleness budget for the group as one
        async with self._claimed(turn.owner, members):
            for index, member in enumerate(members):
                await self.store.create_session(
                    metadata | {"group_index": index}, member, absent=True, owner=turn.owner, admitted=True
                )

    def _claimed(self, owner: str | None, session_ids: list[str]) -> contextlib.AbstractAsyncContextManager[None]:
        """An open-session slot of `owner` for each of `session_ids` while the block makes them (`OpenSessions.claimed`:
        given back if it fails)."""
        if self.open_sessions is None:
            return contextlib.nullcontext()
        return self.open_sessions.claimed(owner or ANONYMOUS, session_ids)

    def refused(self, turn: OpenTurn) -> None:
        """The turn ends before it generated: nothing of it is stored (`OpenTurn.aclose` then releases its locks)."""
        if turn.one_turn:
            self.sessions.forget(turn.session_id)  # nothing of it was stored, and nobody will send its id again

    # -- save, finish ----------------------------------------------------------------------------------------

    async def record(self, turn: OpenTurn, recorded: RecordedTurn) -> None:
        """Record every choice in its sample, store it, finish a one-turn session (`OpenTurn.aclose` then releases
        its locks). Shielded: a second cancellation (client gone, shutdown past its bound) must not half-write the
        turn."""
        record = asyncio.ensure_future(self._record(turn, recorded))
        self._recording.add(record)
        record.add_done_callback(self._recorded)
        await asyncio.shield(record)

    async def _record(self, turn: OpenTurn, recorded: RecordedTurn) -> None:
        cancelled = False
        try:
            for sample_turn, state, assistant in recorded.replies():
                cancelled = cancelled or state.cancelled or state.finish_reason is None
                sample = self.sessions.record(sample_turn, state, assistant)
                replicas = state.replica_ids
                await self.sessions.save(sample_turn, sample, replica=replicas[-1] if replicas else None)
        finally:
            if turn.one_turn:
                self.sessions.forget(turn.session_id)  # it ends with this turn
                self.pool.forget(turn.session_id)
        if turn.one_turn and not cancelled:
            await self.store.finish(turn.session_id, None, None)

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


def _group_size(value: object) -> int | None:
    """A group's size as its metadata gives it (a string from a session name, an int from a `group: true` request),
    or None where it says none."""
    try:
        size = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
    return size if size > 0 else None


def new_session_id(kind: str) -> str:
    """A made-up session id, `<kind>-<128 random bits>`: nobody else can know it."""
    return f"{kind}-{secrets.token_hex(16)}"


def group_members(base: str, size: int) -> list[str]:
    """The sessions of a group of `size` named `base`: `<base>-0` ... `<base>-<size - 1>`."""
    return [f"{base}-{i}" for i in range(size)]
