"""`TrajectoryConsumer`: reads finished trajectories from `rg:trajectories` through a Redis consumer group, and
acknowledges them. A partitioned stream (`store.stream_partitions`) is read whole: every partition, the count
found in Redis before each batch (docs/architecture.md §17); ids of partitions p ≥ 1 are handed out as `<id>@<p>`.

Delivery. Several trainer processes share one stream and each entry goes to one of them. An entry stays in the
group's pending list until `ack`; `next_batch` first reclaims (XAUTOCLAIM) entries that another consumer left idle
for `claim_idle_s` (it died, or lost its connection), then reads new ones. Delivery is therefore at-least-once
until acknowledged: acknowledge every batch, and pick `claim_idle_s` longer than a training step (entries this
consumer holds or has handed out un-acked are refreshed at every `next_batch` call, so a consumer that keeps
calling keeps its entries). What each entry becomes: gateway/trainer/entries.py.

Acknowledging XACKs the entry and deletes it from the stream (XDEL: the store leaves trimming
`rg:trajectories` to the trainer, and an acknowledged entry is finished business — one consumer group per
stream is the model, since acknowledging also lets the session's data go). For a real entry, and only if the
XACK removed it (two consumers acking the same entry count once), it also SREMs the session from
`rg:pending:sessions` and sets a short TTL (`ack_ttl_s`, default 60 s) on the session's meta and sample hashes
instead of deleting them: a duplicate entry read shortly after still finds the meta and is recognised as a
duplicate (rather than as expired data), and an operator can still inspect what was trained on.
`ack_ttl_s=0` deletes them at once.

The staleness budget (docs/architecture.md §5). The consumer publishes the batch size it takes per step in
`rg:{budget}:batch` (field `<group>/<consumer>`): `batch_size` when it starts, else the `n` of its first
`next_batch`, and again at every `ack`; `aclose` deletes it. The gateway
admits new sessions by the sum over the consumers (several ranks: the global batch) and the weight version the
trainer publishes (`POST /admin/weights`); with no consumer published the budget is off.

Redis errors become `gateway.errors.StoreError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from gateway.config.pools import pool_prefix
from gateway.errors import StoreError
from gateway.store.keys import Keys, connect
from gateway.trainer.acks import resolve, settle
from gateway.trainer.batch import Batch, StalePolicy
from gateway.trainer.entries import (
    Entry,
    Item,
    classify,
    fetch_sessions,
    parse_entry,
    qualify,
    split_id,
    store_errors,
    stream_entries,
    text,
)
from gateway.trainer.groups import Groups
from gateway.trajectory import Trajectory

__all__ = ["TrajectoryConsumer"]

logger = logging.getLogger(__name__)

# Refresh (or, with a non-zero IDLE, hand back) the entries this consumer still owns, and say which those are.
# Checking ownership first matters: XCLAIM alone would take back an entry another consumer already reclaimed,
# and both would then train on it. One script, so nothing can be reclaimed between the check and the claim.
# Answers the ids it found owned here (a table, read as a list). The one key is the stream (its own slot).
# KEYS: the stream. ARGV: group, consumer, IDLE in ms, entry id, ...
_TOUCH = """
local owned = {}
for i = 4, #ARGV do
  local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #mine == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""

_RECHECK_S = 0.05  # how soon an entry without `stream_id` is looked at again
_PARTITION_WAIT_S = 0.1  # a blocking read's wait on one partition while the others take turns

# On close, entries read but never handed out are marked idle this long, so any consumer reclaims them at once.
_HAND_BACK_IDLE_MS = 30 * 24 * 3600 * 1000


class TrajectoryConsumer:
    """Reads finished trajectories from `rg:trajectories` as consumer `consumer` of the Redis group `group`.

    Use it as an async context manager (or `start()` / `aclose()`). The constructor does no I/O; `start`
    connects and creates the consumer group if it is missing (at the start of the stream, so a new group sees
    every trajectory still there). Not safe for concurrent `next_batch` calls on one instance: give each task
    its own consumer name.
    """

    def __init__(
        self,
        redis_url: str,
        group: str,
        consumer: str,
        *,
        prefix: str = "rg:",
        pool: str | None = None,
        claim_idle_s: float = 60.0,
        group_by: str | None = None,
        group_size: int | None = None,
        max_group_wait_s: float | None = 3600.0,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "mask",
        ack_ttl_s: float = 60.0,
        socket_timeout_s: float = 10.0,
        stream_partitions: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        if claim_idle_s < 0 or ack_ttl_s < 0 or socket_timeout_s <= 0:
            raise ValueError("claim_idle_s and ack_ttl_s must be >= 0, socket_timeout_s > 0")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if stream_partitions is not None and stream_partitions < 1:
            raise ValueError(f"stream_partitions must be >= 1, got {stream_partitions}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if stale_policy not in ("drop", "mask"):
            raise ValueError(f"stale_policy must be 'drop' or 'mask', got {stale_policy!r}")
        self.redis_url = redis_url
        self.group = group
        self.consumer = consumer
        self.keys = Keys(prefix if pool is None else pool_prefix(prefix, pool))
        self.claim_idle_s = claim_idle_s
        self.group_by = group_by
        self.group_size = group_size
        self.max_group_wait_s = max_group_wait_s
        self.max_staleness = max_staleness
        self.stale_policy: StalePolicy = stale_policy
        self.ack_ttl_s = ack_ttl_s
        self.socket_timeout_s = socket_timeout_s
        self.batch_size = batch_size  # published for the gateway's staleness budget (see the module docstring)
        self._published: int | None = None  # the batch size last published
        self._client: aioredis.Redis | None = None
        self._holding = Groups(group_by, group_size)  # read here, not yet handed out
        self._touch_held: AsyncScript | None = None  # `_TOUCH`, registered on the client
        self._delivered: dict[str, Entry] = {}  # handed out, not yet acknowledged
        self._unconfirmed: dict[str, Entry] = {}  # read, its meta has no stream_id yet: judged again later
        self._touched_at = 0.0
        # The stream's partitions: as given, else as the gateway recorded them (read again before every batch).
        self._fixed_partitions = stream_partitions
        self._grouped = 0  # partitions 0..n-1 have the consumer group
        self._next_read = 0  # the partition a blocking read waits on next (they take turns)

    # ----------------------------------------------------------------------------------------------------------
    # lifecycle

    async def __aenter__(self) -> TrajectoryConsumer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._client is not None:
            return
        client = connect(self.redis_url, socket_timeout_s=self.socket_timeout_s)
        self._client = client
        try:
            await self._read_layout()
        except StoreError:
            self._client = None
            await client.aclose()
            raise
        self._touch_held = client.register_script(_TOUCH)
        if self.batch_size is not None:
            await self._publish_batch_size(self.batch_size)

    @property
    def budget_field(self) -> str:
        """This consumer's field in `rg:{budget}:batch`."""
        return f"{self.group}/{self.consumer}"

    async def _publish_batch_size(self, size: int) -> None:
        with store_errors("publish the batch size"):
            await self.client.hset(self.keys.budget_batch, self.budget_field, size)
        self._published = size

    async def aclose(self) -> None:
        """Hand back the entries read but never handed out (others reclaim them at once), then disconnect.

        Entries handed out and not acknowledged stay with this consumer's name; they are reclaimed after
        `claim_idle_s`, as they would be after a crash.
        """
        client, self._client = self._client, None
        if client is None:
            return
        held = [*self._holding.held, *self._unconfirmed]
        self._holding.clear()
        self._unconfirmed.clear()
        try:
            if self._published is not None:  # its batches no longer count in the gateway's staleness budget
                self._published = None
                with store_errors("withdraw the batch size"):
                    await client.hdel(self.keys.budget_batch, self.budget_field)
            if held:
                await self._touch_script(client, held, _HAND_BACK_IDLE_MS)
        except StoreError as exc:
            logger.warning("consumer %s: could not hand back %d held entries: %s", self.consumer, len(held), exc)
        finally:
            await client.aclose()

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("TrajectoryConsumer is not started: use `async with` or `await start()`")
        return self._client

    # ----------------------------------------------------------------------------------------------------------
    # reading

    async def next_batch(self, n: int, timeout: float) -> Batch:
        """Up to `n` trajectories (whole groups with `group_by`), waiting at most `timeout` seconds.

        Returns as soon as the batch holds `n` trajectories or the next complete group does not fit in it;
        otherwise at the deadline with what it has (possibly nothing). `timeout <= 0` polls once.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.batch_size is None:
            self.batch_size = n
        if self._published is None:
            await self._publish_batch_size(self.batch_size)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        batch = Batch(current_version=await self._read_layout())
        if self.max_staleness is not None:
            batch.stale_before = batch.current_version - self.max_staleness
        await self._touch()
        entries = await self._reclaim(n)
        if len(entries) < n:
            entries += await self._read(n - len(entries), block_s=0.0)
        while True:
            await self._absorb(entries, batch)
            await self._drop_overdue(batch)
            await self._fill(batch, n)
            remaining = deadline - loop.time()
            if len(batch) >= n or self._holding.ready or remaining <= 0:
                break
            if time.monotonic() - self._touched_at > self.claim_idle_s / 2:
                await self._touch()
            # Blocking reads are cut below the socket timeout (a longer BLOCK would read as a dead connection),
            # below claim_idle_s / 2 (held entries are refreshed before anyone may reclaim them), and short while
            # an entry waits for its `stream_id` (the store sets it right after the XADD; nothing signals it).
            block_s = min(remaining, self.socket_timeout_s / 2, max(self.claim_idle_s / 2, _RECHECK_S))
            if self._unconfirmed:
                block_s = min(block_s, _RECHECK_S)
            entries = await self._read(max(1, n - len(batch)), block_s=block_s)
        for trajectory in batch.trajectories:
            entry = Entry(trajectory.entry_id, trajectory.session_id, len(trajectory.samples))
            self._delivered[entry.entry_id] = entry
        return batch

    async def _read_layout(self) -> int:
        """The current weight version; on the way, the stream's partitions if there are more now (and the group on
        each new one)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.keys.weights, "version")
        pipe.get(self.keys.stream_partitions)
        with store_errors("read weight version"):
            raw, recorded = await pipe.execute()
        found = self.keys.with_partitions(self._fixed_partitions or recorded)
        if found.partitions > self.keys.partitions:  # never fewer: older partitions may still hold entries
            self.keys = found
        for partition in range(self._grouped, self.keys.partitions):
            with store_errors("create consumer group"):
                try:
                    await self.client.xgroup_create(self.keys.stream(partition), self.group, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):  # BUSYGROUP: it exists already, which is all we need
                        raise
            self._grouped = partition + 1
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            logger.warning("%s has a version that is not an integer (%r); taking 0", self.keys.weights, raw)
            return 0

    async def _reclaim(self, count: int) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        """Take over entries idle for `claim_idle_s` (their consumer died); acknowledge deleted ones."""
        entries: list[tuple[str, Mapping[bytes | str, bytes | str]]] = []
        for partition in range(self.keys.partitions):
            if len(entries) >= count:
                break
            entries += await self._reclaim_from(partition, count - len(entries))
        return entries

    async def _reclaim_from(self, partition: int, count: int) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        stream = self.keys.stream(partition)
        with store_errors("reclaim idle entries"):
            claimed = await self.client.xautoclaim(
                stream,
                self.group,
                self.consumer,
                min_idle_time=int(self.claim_idle_s * 1000),
                start_id="0-0",
                count=count,
                justid=True,  # the ids of deleted entries too (Redis 6.2 returns those as nil in a full reply)
            )
        raws = [r for r in map(text, claimed) if not self._known(qualify(r, partition))]
        if not raws:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.incrby(self.keys.reclaimed, len(raws))  # counted for the operator (the dashboard's backlog)
        for raw in raws:
            pipe.xrange(stream, raw, raw)
        with store_errors("load reclaimed entries"):
            _, *found = await pipe.execute()
        entries = [(qualify(r, partition), hits[0][1]) for r, hits in zip(raws, found, strict=True) if hits]
        gone = [qualify(r, partition) for r, hits in zip(raws, found, strict=True) if not hits]
        if gone:
            logger.warning("consumer %s: %d reclaimed entries were trimmed from the stream", self.consumer, len(gone))
            await self._settle([], gone)
        logger.info("consumer %s: reclaimed %d entries idle for %.1fs", self.consumer, len(entries), self.claim_idle_s)
        return entries

    async def _read(self, count: int, block_s: float) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        """New entries, at most `count`, waiting at most `block_s` for one. With several partitions: every
        partition without waiting, then, if none had any, one partition (they take turns) for a short wait."""
        if self.keys.partitions == 1:
            return await self._read_from(0, count, block_s)
        entries: list[tuple[str, Mapping[bytes | str, bytes | str]]] = []
        for partition in range(self.keys.partitions):
            entries += await self._read_from(partition, count - len(entries), 0.0)
            if len(entries) >= count:
                return entries
        if entries or block_s <= 0:
            return entries
        self._next_read = (self._next_read + 1) % self.keys.partitions
        return await self._read_from(self._next_read, count, min(block_s, _PARTITION_WAIT_S))

    async def _read_from(
        self, partition: int, count: int, block_s: float
    ) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        block = max(1, int(block_s * 1000)) if block_s > 0 else None  # BLOCK 0 would wait forever
        with store_errors("read trajectories"):
            response = await self.client.xreadgroup(
                self.group, self.consumer, {self.keys.stream(partition): ">"}, count=count, block=block
            )
        return [(qualify(raw, partition), fields) for raw, fields in stream_entries(response)]

    def _known(self, entry_id: str) -> bool:
        return entry_id in self._holding or entry_id in self._delivered or entry_id in self._unconfirmed

    async def _absorb(self, entries: list[tuple[str, Mapping[bytes | str, bytes | str]]], batch: Batch) -> None:
        """Judge the entries that waited for their `stream_id` again, then the new ones, in stream order."""
        parsed = list(self._unconfirmed.values())
        self._unconfirmed.clear()
        malformed: list[str] = []
        for entry_id, fields in entries:
            if self._known(entry_id):
                continue  # ours already (re-claimed after sitting idle here)
            entry = parse_entry(entry_id, fields)
            if entry is None:
                logger.error("stream entry %s has no session_id; acknowledging it", entry_id)
                malformed.append(entry_id)
            else:
                parsed.append(entry)
        if malformed:
            await self._settle([], malformed)
            batch.dropped_unreadable += len(malformed)
        for item in await self._load(parsed, batch):
            self._holding.hold(item)

    async def _load(self, parsed: list[Entry], batch: Batch) -> list[Item]:
        """Entries → trajectories, with two pipelined round trips at most; skipped entries are acknowledged."""
        if not parsed:
            return []
        loaded = await fetch_sessions(self.client, self.keys, parsed)
        items: list[Item] = []
        duplicates: list[str] = []
        unreadable: list[Entry] = []
        for entry, (raw_meta, raw_samples) in zip(parsed, loaded, strict=True):
            verdict = classify(entry, raw_meta, raw_samples)
            if isinstance(verdict, Item):
                items.append(verdict)
            elif verdict == "duplicate":
                duplicates.append(entry.entry_id)
            elif verdict == "unreadable":
                unreadable.append(entry)
            else:  # not arbitrated yet: kept (pending, owned here) and judged again on the next read
                logger.debug("session %s: entry %s has no stream_id yet", entry.session_id, entry.entry_id)
                self._unconfirmed[entry.entry_id] = entry
        await self._settle(unreadable, duplicates)
        batch.dropped_duplicate += len(duplicates)
        batch.dropped_unreadable += len(unreadable)
        return items

    async def _drop_overdue(self, batch: Batch) -> None:
        if self.max_group_wait_s is None:
            return
        dropped = self._holding.take_overdue(self.max_group_wait_s)
        if dropped:
            await self._settle([item.entry for item in dropped], [])
            batch.dropped_incomplete += len(dropped)

    async def _fill(self, batch: Batch, n: int) -> None:
        """Move complete groups into the batch while they fit; acknowledge stale ones under `stale_policy="drop"`."""
        drop_before = batch.stale_before if self.stale_policy == "drop" else None
        stale = self._holding.fill(batch, n, drop_before)
        if stale:
            await self._settle([item.entry for item in stale], [])
            batch.dropped_stale += len(stale)

    # ----------------------------------------------------------------------------------------------------------
    # keeping entries and acknowledging them

    async def _touch(self) -> None:
        """Reset the idle time of every entry this consumer holds or has handed out, so none is reclaimed while
        it is alive; forget those another consumer has taken over (it delivers them now)."""
        self._touched_at = time.monotonic()
        ids = [*self._holding.held, *self._delivered, *self._unconfirmed]
        if not ids:
            return
        owned = set(await self._touch_script(self.client, ids, 0))
        lost = [i for i in ids if i not in owned]
        if lost:
            logger.warning("consumer %s: %d entries were reclaimed by another consumer", self.consumer, len(lost))
            self._forget(set(lost))

    async def _touch_script(self, client: aioredis.Redis, ids: Sequence[str], idle_ms: int) -> list[str]:
        script = self._touch_held if self._touch_held is not None else client.register_script(_TOUCH)
        by_partition: dict[int, list[str]] = {}
        for entry_id in ids:
            raw, partition = split_id(entry_id)
            by_partition.setdefault(partition, []).append(raw)
        owned: list[str] = []
        for partition, raws in by_partition.items():  # one script per stream: each is its own slot
            with store_errors("refresh held entries"):
                found = await script(
                    keys=[self.keys.stream(partition)], args=[self.group, self.consumer, idle_ms, *raws], client=client
                )
            owned += [qualify(text(raw), partition) for raw in found]
        return owned

    def _forget(self, lost: set[str]) -> None:
        for entry_id in lost:
            self._delivered.pop(entry_id, None)
            self._unconfirmed.pop(entry_id, None)
        self._holding.forget(lost)

    async def ack(self, items: Batch | Iterable[Trajectory | str]) -> int:
        """Acknowledge a batch, trajectories or entry ids; returns how many entries this call removed from the
        group's pending list (0 for ones already acknowledged). See the module docstring for what happens to
        `rg:pending:sessions` and the session's keys. Ids this consumer did not hand out are looked up in the stream."""
        real: list[Entry] = []
        unknown: list[str] = []
        for item in items.trajectories if isinstance(items, Batch) else items:
            if isinstance(item, Trajectory):
                real.append(Entry(item.entry_id, item.session_id, len(item.samples)))
            elif item in self._delivered:
                real.append(self._delivered[item])
            else:
                unknown.append(item)
        resolved, others = await resolve(self.client, self.keys, unknown)
        acked = await self._settle(real + resolved, others)
        if self.batch_size is not None:  # again at every ack: a restarted gateway's Redis, a field deleted meanwhile
            await self._publish_batch_size(self.batch_size)
        for entry in real + resolved:
            self._delivered.pop(entry.entry_id, None)
        return acked

    async def _settle(self, real: Sequence[Entry], others: Sequence[str]) -> int:
        return await settle(self.client, self.keys, self.group, self.ack_ttl_s, real, others)
