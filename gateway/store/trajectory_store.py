"""`TrajectoryStore`: the session lifecycle on the store's keys (docs/architecture.md §3, §5, §8, §10), one object
for the gateway to hold, composed of the parts that do the work: `Sessions` (records), `WriteBuffer` over
`SampleWriter` (samples), `Finisher` and `Delivery` (finish, the stream, the repair sweeper), `IdleSweeper`
(abandoned sessions) and `Backpressure` (`rg:pending:sessions`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis

from gateway.background import background, stop
from gateway.errors import Conflict, InvalidRequest, SessionNotFound, StoreError
from gateway.sample_tree import joined
from gateway.store.backpressure import Backpressure, StartedSamples
from gateway.store.buffer import WriteBuffer
from gateway.store.core import Fields, StoreCore, backoff_s
from gateway.store.delivery import Delivery, ScoringGate
from gateway.store.finish import Finisher
from gateway.store.keys import REDIS_ERRORS, Keys, call
from gateway.store.locks import SessionLocks
from gateway.store.pipelines import Pipelines
from gateway.store.records import Admission, GroupRecords, Sessions
from gateway.store.responses import ResponseKeys
from gateway.store.samples import SampleWrite, SampleWriter, read_samples
from gateway.store.slot_clients import Durability
from gateway.store.sweepers import IdleSweeper, sweep_forever
from gateway.trajectory import Sample, SampleSaved, SessionMeta, StoredChunks

if TYPE_CHECKING:
    from gateway.config import RedisConfig, StoreConfig

__all__ = ["TrajectoryStore"]

_PROBE_ERRORS: tuple[type[Exception], ...] = (TimeoutError, OSError, *REDIS_ERRORS)

T = TypeVar("T")

logger = logging.getLogger(__name__)


class TrajectoryStore:
    """Sessions, samples and finished trajectories in Redis, with the invariants of docs/architecture.md §8 and §10.

    Invariants:

    - A session's keys share the hash tag `{id}`; multi-key writes of a session are one atomic script or one
      WATCHed MULTI on that slot. Every cross-slot step is idempotent and ordered so that a crash between any
      two steps leaves a state the sweepers (`repair_undelivered`, `abandon_idle`) complete.
    - A finished or abandoned session never changes again: sample writes to it are refused.
    - `finish` returns an entry id only once that entry is in `rg:trajectories` and recorded as the session's
      `stream_id`; however often and however concurrently it runs, exactly one entry is real and `rg:pending:sessions`
      counts it at most once (a crash or a lost connection at that INCR undercounts; see
      gateway/store/backpressure.py).
    - No sample write is dropped in silence: while Redis is down it is buffered (latest version per sample),
      and when the buffer is full `save_sample` raises `StoreError`.

    The store does not own `client` (the caller closes it); the client must return bytes (the default
    `decode_responses=False`), since sample fields are binary. `start()` runs the flusher and the sweeper;
    `aclose()` stops them.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        ttl_s: int = 86_400,
        max_pending: int = 10_000,
        session_idle_ttl_s: int = 1_800,
        retry_budget_s: float = 30.0,
        max_buffered_writes: int = 10_000,
        sweep_interval_s: float | None = 30.0,
        repair_grace_s: float = 10.0,
        retry_after_s: float = 5.0,
        pipelines: Pipelines | None = None,
        locks: SessionLocks | None = None,
        max_session_metadata_bytes: int = 64 * 1024,
        durable_replicas: int | None = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        """`repair_grace_s`: the periodic sweeper leaves sessions finished more recently than this to their own
        finish; `retry_after_s`: the Retry-After of a backpressure 429; `sweep_interval_s`: the repair sweep's
        period, and the idle sweep's unless half `session_idle_ttl_s` is shorter (`sweep_period_s`); None: no sweeper;
        `pipelines`: how the per-turn round trips are sent (default: a pipeline each, `OwnPipelines`); `locks`: the
        process's session locks (`locks`, shared with the session lifecycle), new ones if None;
        `max_session_metadata_bytes`: the most a session's metadata may take as JSON (a 400 past it);
        `durable_replicas`, `wait_timeout_ms`: the replicas a finish's writes must reach before it is acknowledged,
        and how long one WAIT waits for them (`redis.durable_replicas`; None: auto, gateway/store/slot_clients.py)."""
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.session_idle_ttl_s = session_idle_ttl_s
        self.retry_budget_s = retry_budget_s
        self.max_buffered_writes = max_buffered_writes
        self.sweep_interval_s = sweep_interval_s
        self.repair_grace_s = repair_grace_s
        self.retry_after_s = retry_after_s
        self.locks = locks if locks is not None else SessionLocks()
        core = StoreCore(
            client,
            keys,
            ttl_s=ttl_s,
            session_idle_ttl_s=session_idle_ttl_s,
            pipelines=pipelines,
            max_metadata_bytes=max_session_metadata_bytes,
            durability=Durability(client, durable_replicas, wait_timeout_ms),
        )
        self.stats = core.stats
        self.batcher = core.batcher
        self._core = core
        self._backpressure = Backpressure(core, max_pending=max_pending, retry_after_s=retry_after_s)
        self._sessions = Sessions(core, self._backpressure)
        self.started = StartedSamples(core)  # the staleness budget's count (`gateway.weights.budget`)
        self._writer = SampleWriter(core)
        self._buffer = WriteBuffer(self._writer, core.stats, self.locks, max_buffered_writes=max_buffered_writes)
        # The finishes running in this process, by session; the sweepers leave those sessions alone.
        self._finishing: dict[str, asyncio.Task[str]] = {}
        self._delivery = Delivery(core, self._backpressure, self._finishing, self.started)
        self.on_delivered = self._delivery.on_delivered  # called with each session this process delivers
        self._finisher = Finisher(core, self._buffer, self._delivery, self._finishing, retry_budget_s=retry_budget_s)
        self._idle = IdleSweeper(core, self._finishing, self.started)
        self.responses = ResponseKeys(core)  # the Responses API's stored responses
        self.groups = GroupRecords(core)  # each GRPO group's replica, as the first process to place it chose
        self._sweeper: asyncio.Task[None] | None = None  # a hard reference: the event loop keeps only weak ones
        # The steps of a finish and of a buffered write, reachable here as before the store was split in parts
        # (tests drive them one by one).
        self._buffer_write = self._buffer.buffer_write
        self._mark_finished = self._finisher.mark_finished
        self._append_entry = self._delivery.append_entry
        self._claim_entry = self._delivery.claim_entry
        self._count_pending = self._backpressure.count_delivery

    @classmethod
    def from_settings(
        cls, client: aioredis.Redis, store: StoreConfig, redis: RedisConfig, **options: Any
    ) -> TrajectoryStore:
        return cls(
            client,
            Keys(store.prefix, store.stream_partitions),
            ttl_s=store.ttl_s,
            max_pending=store.max_pending,
            session_idle_ttl_s=store.session_idle_ttl_s,
            retry_budget_s=redis.retry_budget_s,
            max_session_metadata_bytes=store.max_session_metadata_bytes,
            durable_replicas=redis.durable_replicas,
            wait_timeout_ms=redis.wait_timeout_ms,
            **options,
        )

    @property
    def buffered(self) -> int:
        """Sample writes waiting in memory for Redis."""
        return len(self._buffer)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the buffered-write flusher and, unless `sweep_interval_s` is None, the periodic sweeper."""
        self._buffer.start()
        if self._sweeper is None and self.sweep_interval_s is not None:
            sweep = sweep_forever(self._delivery, self._idle, self.sweep_interval_s, self.repair_grace_s)
            self._sweeper = background(sweep, "trajectory-store-sweeper")

    async def aclose(self, drain_timeout_s: float = 5.0) -> None:
        """Staged stop: the sweeper; in-flight finishes get `drain_timeout_s`; buffered writes get one last flush
        bounded by `drain_timeout_s`. Writes that still could not be written are logged as lost, by count."""
        await stop(self._sweeper)
        self._sweeper = None
        if self._finishing:
            _, late = await asyncio.wait(list(self._finishing.values()), timeout=drain_timeout_s)
            for task in late:
                task.cancel()
        await self._buffer.aclose(drain_timeout_s)
        await self.batcher.aclose()
        await self._core.slots.aclose()
        await self._core.durability.aclose()

    # -- sessions -------------------------------------------------------------------------------------------

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
        """A new active session; see `Sessions.create_session`. A turn's first step: retried through a Redis outage
        (`_retried`; every step of a creation is idempotent, and a retry finds the session a lost reply created)."""
        return await self._retried(
            lambda: self._sessions.create_session(
                metadata, session_id, fresh=fresh, absent=absent, owner=owner, admitted=admitted
            ),
            "create session",
        )

    async def mark_stale(self, session_id: str, index: int) -> None:
        """Mark a stored sample `stale` (cut for staleness; `Sample.stale`), after the session's buffered writes."""
        await self._buffer.flush(session_id)
        await self._retried(
            lambda: call(self.client.hset(self.keys.sample(session_id, index), "stale", 1), "mark sample stale"),
            "mark sample stale",
        )

    @property
    def drop_stale(self) -> bool:
        """`weights.stale_samples: drop`: a finished session holding a stale sample is recorded, not delivered."""
        return self._delivery.drop_stale

    @drop_stale.setter
    def drop_stale(self, drop: bool) -> None:
        self._delivery.drop_stale = drop

    @property
    def admission(self) -> Admission | None:
        """What admits new sessions after backpressure (the staleness budget; None: backpressure alone)."""
        return self._sessions.admission

    @admission.setter
    def admission(self, admission: Admission | None) -> None:
        self._sessions.admission = admission
        self.started.counting = admission is not None

    async def admit(self, samples: int) -> None:
        """Backpressure, then `admission` for `samples` new sessions at once (a group's members, created with
        `admitted=True`)."""
        await self._backpressure.check()
        if self._sessions.admission is not None:
            await self._sessions.admission.admit(samples)

    async def ensure_session(self, session_id: str, metadata: dict[str, Any] | None = None) -> SessionMeta:
        """The session named by a client (header or body), created on first use; see `create_session`."""
        return await self.create_session(metadata, session_id)

    async def touch_session(self, session_id: str) -> SessionMeta | None:
        """An active session's meta, with activity recorded; None if there is no such session. A finished or
        abandoned one is a `Conflict`. A turn reads it: retried through a Redis outage (`_retried`)."""
        return await self._retried(lambda: self._sessions.touch_session(session_id), "read session")

    async def add_metadata(self, session_id: str, metadata: Mapping[str, str]) -> SessionMeta:
        """Add to an active session's metadata the keys it does not hold; see `Sessions.add_metadata`. Retried
        through a Redis outage (`_retried`; adding what is already there writes nothing)."""
        return await self._retried(lambda: self._sessions.add_metadata(session_id, metadata), "add session metadata")

    async def get_session(self, session_id: str) -> SessionMeta | None:
        return await self._core.get_session(session_id)

    async def reachable(self, timeout_s: float = 1.0) -> bool:
        """Redis answers a PING within `timeout_s` (readiness: a turn needs the store). Any failure is a no, a
        cluster's too (`REDIS_ERRORS`: with no node reachable it raises `RedisClusterException`, no `RedisError`)."""
        try:
            return bool(await asyncio.wait_for(self.client.ping(), timeout_s))
        except _PROBE_ERRORS:
            return False

    async def pending(self) -> int:
        """Finished sessions delivered to the stream and not yet acknowledged by a trainer."""
        return await self._backpressure.pending()

    # -- samples --------------------------------------------------------------------------------------------

    async def save_sample(
        self,
        session_id: str,
        index: int,
        sample: Sample,
        *,
        replica: str | None = None,
        stored: StoredChunks | None = None,
        writer: str | None = None,
        base: str | None = None,
    ) -> SampleSaved | None:
        """Write (replace) sample `index` of an active session; `sample_count` becomes at least `index + 1`.
        Returns what the write made (`SampleSaved`), or None when the write waits in the buffer.

        `stored`: what the sample's hash holds of this sample already (what the last write of it answered), so
        only what came after it is sent; should the hash hold anything else, the whole sample is written instead.

        `writer` (the id of the turn writing; every write of one turn names the same) and `base` (the writer of
        the sample this turn extends, as last read or written; None for a new sample) arbitrate between processes
        serving one session at once (docs/architecture.md §13): the write replaces what `writer` or `base` wrote
        last, and nothing else. If another turn wrote the sample meanwhile, both are kept: this turn's sample
        moves, whole, to the session's first free index, where the turn's later writes follow it
        (`SampleSaved.index`). A write without `writer` replaces whatever is stored.

        If Redis is unreachable (after the client's own retries) the write is buffered and this returns: the
        flusher, and `finish` of the session, write it later; a newer version of the same sample replaces the
        buffered one. With `max_buffered_writes` writes already waiting, a write of another sample raises
        `StoreError` (the request fails loudly; nothing is dropped). A finished or abandoned session is a
        `Conflict`, an unknown one `SessionNotFound`.
        """
        if index < 0:
            raise InvalidRequest(f"sample index must be >= 0, got {index}", param="index")
        write = SampleWrite(session_id, index, sample, replica or "", time.time(), stored, writer or "", base or "")
        verdict = await self._buffer.save(write)
        if verdict is None or isinstance(verdict, SampleSaved):
            return verdict
        if verdict == "missing":
            raise SessionNotFound(f"session {session_id} does not exist (or expired)", param="session_id")
        raise Conflict(f"session {session_id} is {verdict}; its samples can no longer change", param="session_id")

    async def load_samples(self, session_id: str) -> list[Sample]:
        """The session's samples in index order (gaps skipped), including writes still buffered here, each branch's
        prompt whole (`gateway.sample_tree.joined`); retried through a Redis outage (`_read`)."""
        return list((await self.indexed_samples(session_id)).values())

    async def indexed_samples(self, session_id: str) -> dict[int, Sample]:
        """`load_samples` by their index."""

        async def read() -> dict[int, Any]:
            meta = await self._core.get_session(session_id)
            return await read_samples(self._core, session_id, meta.sample_count if meta is not None else 0)

        found = await self._retried(read, "read samples")
        found |= self._buffer.waiting(session_id)
        stored = {index: Sample.from_redis(raw) for index, raw in found.items()}
        return dict(zip(sorted(stored), joined(stored), strict=True))

    # -- a teacher's scores (gateway.teacher) -----------------------------------------------------------------

    def hold_for_scores(self, gate: ScoringGate) -> None:
        """Hold each finished session with samples until its teacher scored it (`Delivery`'s gate)."""
        self._delivery.gate = gate

    async def save_teacher_scores(
        self, session_id: str, scores: Mapping[int, Fields], *, scoring: str | None, teacher: str
    ) -> None:
        """Write each sample's teacher fields (`scores`, by sample index) and, with `scoring` (scored | unscored),
        the meta's verdict, in one transaction on the session's slot; retried through a Redis outage."""
        keys = self.keys

        async def write() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                for index, fields in scores.items():
                    pipe.hset(keys.sample(session_id, index), mapping=fields)  # type: ignore[arg-type]
                if scoring is not None:
                    pipe.hset(keys.meta(session_id), mapping={"scoring": scoring, "teacher": teacher})
                await pipe.execute()

        await self._retried(lambda: call(write(), "save teacher scores"), "save teacher scores")

    async def deliver_finished(self, session_id: str) -> str:
        """Deliver a finished session (steps (3)-(5)); its entry id, `AWAITING_SCORES` while it waits for its
        teacher, "" where it is gone or has nothing to deliver."""
        meta = await self._core.get_session(session_id)
        if meta is None or meta.status != "finished":
            return ""
        if meta.stream_id is not None:
            return meta.stream_id
        return await self._delivery.deliver(meta)

    async def _retried(self, read: Callable[[], Awaitable[T]], what: str) -> T:
        """`read()` (a read, or an idempotent write), tried again with backoff while Redis is unreachable, for up to
        `retry_budget_s` (a Redis restart or a cluster master's failover costs a turn a wait, not a 503); then its
        `StoreError`."""
        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            try:
                return await read()
            except StoreError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
                attempt += 1
                delay = min(remaining, backoff_s(attempt))
                logger.warning("%s failed (%s); retry %d in %.2fs", what, exc, attempt, delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    # -- finish and the sweepers ----------------------------------------------------------------------------

    async def finish(
        self,
        session_id: str,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        rewards: list[float] | None = None,
    ) -> str:
        """Finish the session and return its entry id in `rg:trajectories` (steps: gateway/store/finish.py).
        `reward` is the session's; `rewards`, if given, one per sample (`SessionMeta.rewards`): a count other than
        the session's samples is `InvalidRequest`, and the session stays active.

        Idempotent: a finished session returns its existing entry id; concurrent calls in this process share
        one run (a call naming other rewards is a `Conflict`), and across processes the WATCHed transaction and
        the `stream_id` claim keep exactly one real entry. A session with no sample and no group is finished but
        not delivered: "" (`Delivery.deliver`). The run is shielded: a cancelled caller does not stop
        it. Redis failures are retried with backoff for `retry_budget_s`, then `StoreError`; a returned id is
        durable. Unknown session: `SessionNotFound`; abandoned: `Conflict`.
        """
        return await self._finisher.finish(session_id, reward, metadata, rewards)

    async def repair_undelivered(self, older_than_s: float = 0.0) -> int:
        """Deliver sessions finished but not confirmed in the stream; see `Delivery.repair_undelivered`."""
        return await self._delivery.repair_undelivered(older_than_s)

    async def abandon_idle(self, now: float | None = None) -> list[str]:
        """Close every idle active session as `abandoned`; see `IdleSweeper.abandon_idle`."""
        return await self._idle.abandon_idle(now)
