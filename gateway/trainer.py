"""The trainer's side of the trajectory stream: pull finished sessions from Redis, acknowledge them, tensorize.

A trainer installs this package (`pip install 'rollout-gateway[trainer]'`) and talks only to Redis; no gateway
process is involved. This module reads the schema that `gateway/store.py` documents (keys from `Keys`):

```python
async with TrajectoryConsumer(url, group="grpo", consumer=f"rank{rank}", group_by="group_id") as source:
    while training:
        batch = await source.next_batch(256, timeout=30.0)
        step(batch.to_tensors(pad_token_id=tok.pad_token_id, device="cuda"))
        await source.ack(batch)
```

Delivery. Entries of `rg:trajectories` are read through a Redis consumer group, so several trainer processes
share one stream and each entry goes to one of them. An entry stays in the group's pending list until `ack`;
`next_batch` first reclaims (XAUTOCLAIM) entries that another consumer left idle for `claim_idle_s` (it died, or
lost its connection), then reads new ones. Delivery is therefore at-least-once until acknowledged: acknowledge
every batch, and pick `claim_idle_s` longer than a training step (entries this consumer holds or has handed out
un-acked are refreshed at every `next_batch` call, so a consumer that keeps calling keeps its entries).

What an entry becomes:

- the *real* entry of a session (its id equals the meta's `stream_id`) becomes a `Trajectory` in a batch;
- a *duplicate* (another entry for the same session, left by a crashed finish) is acknowledged and skipped
  (`Batch.dropped_duplicate`); it never touches `rg:pending` or the session's keys;
- an entry whose session data has expired or does not decode is logged, acknowledged as if real (pending is
  decremented; the meta is gone, so which entry was real cannot be told, and a real one is by far the more
  likely) and counted in `Batch.dropped_unreadable`;
- an entry whose meta has no `stream_id` yet (its writer is between XADD and the `stream_id` claim, or
  crashed there) is not arbitrated yet: it stays pending here and is judged again at every read (every 50 ms
  while `next_batch` waits) until the store's finish or its repair sweeper settles it.

Acknowledging XACKs the entry and deletes it from the stream (XDEL: the store leaves trimming
`rg:trajectories` to the trainer, and an acknowledged entry is finished business — one consumer group per
stream is the model, since acknowledging also lets the session's data go). For a real entry, and only if the
XACK removed it (two consumers acking the same entry count once), it also DECRs `rg:pending` and sets a short
TTL (`ack_ttl_s`, default 60 s) on the session's meta and sample hashes instead of deleting them: a duplicate
entry read shortly after still finds the meta and is recognised as a duplicate (rather than as expired data,
which would decrement `rg:pending` a second time), and an operator can still inspect what was trained on.
`ack_ttl_s=0` deletes them at once.

GRPO groups (`group_by`). A trajectory joins the group `metadata[group_by]`; the group is complete when it
has `group_size` members (the constructor's, else the first member's `metadata["group_size"]`); a gateway request
with `group: true` and `n=K` makes K sessions with `group_id` and `group_size` K (`gateway.turns`). Members wait
in memory, un-acked, so a crash of this consumer hands them to another. A batch holds whole complete groups
only: `n` counts trajectories, a group is never split, and a group that does not fit the room left in a batch
waits for the next call (a group larger than `n` comes alone). A group still incomplete `max_group_wait_s`
after its first member arrived here (a member was abandoned, or the trainer that would have sent it crashed)
is dropped: its entries are acknowledged like delivered ones and counted in `Batch.dropped_incomplete`.
Dropping, not releasing, keeps the promise that a batch holds complete groups only (a partial group would
skew the group-relative advantage). A trajectory with no `metadata[group_by]` or no known group size is
delivered on its own, with a warning.

Staleness (DESIGN §5). With `max_staleness`, the version current when `next_batch` is called is read from
`rg:weights` (0 when absent); a model token is off-policy when its version is below `current - max_staleness`,
and a trajectory is stale when any of its samples has `min_version` below that bound. `stale_policy="drop"`
acknowledges and skips stale trajectories (with `group_by`, the whole group: a group is trained whole or not
at all) and counts them in `Batch.dropped_stale`; `"mask"` keeps them but zeroes their off-policy tokens in
`Batch.off_policy_mask`, and so in the `loss_mask` tensor.

Redis errors become `gateway.errors.StoreError`; torch is imported only by `Batch.to_tensors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.errors import StoreError
from gateway.store import Keys, connect
from gateway.trajectory import ENV_VERSION, Sample, SessionMeta, Trajectory, TrajectoryFormatError

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "StalePolicy", "TrajectoryConsumer"]

logger = logging.getLogger(__name__)

StalePolicy = Literal["drop", "mask"]

# Refresh (or, with a non-zero IDLE, hand back) the entries this consumer still owns, and say which those are.
# Checking ownership first matters: XCLAIM alone would take back an entry another consumer already reclaimed,
# and both would then train on it. One script, so nothing can be reclaimed between the check and the claim.
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

# On close, entries read but never handed out are marked idle this long, so any consumer reclaims them at once.
_HAND_BACK_IDLE_MS = 30 * 24 * 3600 * 1000


@contextlib.contextmanager
def _store_errors(what: str) -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise StoreError(f"redis: {what} failed: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class _Entry:
    """One stream entry: enough to acknowledge it and expire its session's keys."""

    entry_id: str
    session_id: str
    samples: int


@dataclass(slots=True)
class _Item:
    trajectory: Trajectory
    entry: _Entry


@dataclass(slots=True)
class _Group:
    size: int
    since: float  # monotonic time its first member arrived here
    members: list[_Item] = field(default_factory=list)


@dataclass
class Batch:
    """Trajectories handed to the trainer, plus what was skipped while collecting them.

    `off_policy_mask[i][j]` is a uint8 array over the response tokens of sample `j` of trajectory `i`: 0 for
    a model token older than the staleness bound (only with `stale_policy="mask"`), 1 everywhere else.
    `group_index[i]` numbers trajectory `i`'s group within the batch (each trajectory is its own group
    without `group_by`). `current_version` is the weight version staleness was judged against. The `dropped_*`
    counters say what the `next_batch` call that made this batch acknowledged without delivering. A batch
    built by hand from trajectories alone gets all-ones masks and one group per trajectory.
    """

    trajectories: list[Trajectory] = field(default_factory=list)
    off_policy_mask: list[list[npt.NDArray[np.uint8]]] = field(default_factory=list)
    group_index: list[int] = field(default_factory=list)
    current_version: int = 0
    stale_before: int | None = None  # versions below this are off-policy; None without max_staleness
    dropped_stale: int = 0
    dropped_duplicate: int = 0
    dropped_unreadable: int = 0
    dropped_incomplete: int = 0

    def __post_init__(self) -> None:
        if self.trajectories and not self.off_policy_mask:
            self.off_policy_mask = [[_on_policy(s, None) for s in t.samples] for t in self.trajectories]
        if self.trajectories and not self.group_index:
            self.group_index = list(range(len(self.trajectories)))

    def __len__(self) -> int:
        return len(self.trajectories)

    def __repr__(self) -> str:  # the default would print every token array
        return (
            f"Batch(trajectories={len(self)}, samples={self.num_samples}, groups={self.num_groups}, "
            f"current_version={self.current_version}, stale_before={self.stale_before}, "
            f"dropped_stale={self.dropped_stale}, dropped_duplicate={self.dropped_duplicate}, "
            f"dropped_unreadable={self.dropped_unreadable}, dropped_incomplete={self.dropped_incomplete})"
        )

    @property
    def entry_ids(self) -> list[str]:
        return [t.entry_id for t in self.trajectories]

    @property
    def num_groups(self) -> int:
        return self.group_index[-1] + 1 if self.group_index else 0

    @property
    def num_samples(self) -> int:
        return sum(len(t.samples) for t in self.trajectories)

    def _add_group(self, items: Sequence[_Item]) -> None:
        index = self.num_groups
        for item in items:
            samples = item.trajectory.samples
            self.trajectories.append(item.trajectory)
            self.off_policy_mask.append([_on_policy(s, self.stale_before) for s in samples])
            self.group_index.append(index)

    def to_tensors(self, pad_token_id: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """One row per sample of every trajectory (in order), right-padded to the longest sequence.

        Alignment: position `t` of `loss_mask`, `old_logprobs` and `versions` describes the token
        `input_ids[t]` — its log-probability when it was sampled given `input_ids[:t]`, and the weight version
        that sampled it. A trainer that scores `logits[:, :-1]` against `input_ids[:, 1:]` therefore uses
        `loss_mask[:, 1:]`, `old_logprobs[:, 1:]`, `versions[:, 1:]`. `routed_experts[t]` (present only when
        every sample has experts) is the routing of the forward pass at position `t`, the one that produced
        the distribution of token `t + 1`; it has `T - 1` positions, zero on padding.

        - `input_ids` (B, T) long, `pad_token_id` on padding; `attention_mask` (B, T) long, 1 on real tokens;
        - `loss_mask` (B, T) float32: 0 on the prompt, environment tokens, off-policy tokens and padding;
        - `old_logprobs` (B, T) float32, 0 where `loss_mask` of the stored sample is 0;
        - `versions` (B, T) long, -1 on prompt, environment tokens and padding;
        - `routed_experts` (B, T - 1, layers, top_k) long;
        - `rewards` (B,) float32: the row's sample's reward where the session was finished with one per sample
          (`finish {rewards}`), else the trajectory's reward; NaN when the session finished without one;
        - `trajectory_index`, `sample_index`, `group_index` (B,) long: which trajectory of the batch, which
          sample of it, and which group of the batch each row comes from.
        """
        import torch

        rows = [(t, s) for t, trajectory in enumerate(self.trajectories) for s in range(len(trajectory.samples))]
        width = max((_length(self._sample(t, s)) for t, s in rows), default=0)
        arrays: dict[str, npt.NDArray[Any]] = {
            "input_ids": np.full((len(rows), width), pad_token_id, np.int64),
            "attention_mask": np.zeros((len(rows), width), np.int64),
            "loss_mask": np.zeros((len(rows), width), np.float32),
            "old_logprobs": np.zeros((len(rows), width), np.float32),
            "versions": np.full((len(rows), width), ENV_VERSION, np.int64),
        }
        for row, (t, s) in enumerate(rows):
            self._fill_row(arrays, row, t, s)
        experts = self._experts(rows, width)
        if experts is not None:
            arrays["routed_experts"] = experts
        per_trajectory = [trajectory.rewards for trajectory in self.trajectories]
        rewards = [per_trajectory[t][s] for t, s in rows]
        arrays["rewards"] = np.array([np.nan if r is None else r for r in rewards], np.float32)
        arrays["trajectory_index"] = np.array([t for t, _ in rows], np.int64)
        arrays["sample_index"] = np.array([s for _, s in rows], np.int64)
        arrays["group_index"] = np.array([self.group_index[t] for t, _ in rows], np.int64)
        return {name: torch.from_numpy(array).to(device) for name, array in arrays.items()}

    def _sample(self, t: int, s: int) -> Sample:
        return self.trajectories[t].samples[s]

    def _fill_row(self, arrays: dict[str, npt.NDArray[Any]], row: int, t: int, s: int) -> None:
        sample = self._sample(t, s)
        start, end = sample.prompt_ids.size, _length(sample)
        model = sample.loss_mask.astype(bool)
        arrays["input_ids"][row, :start] = sample.prompt_ids
        arrays["input_ids"][row, start:end] = sample.response_ids
        arrays["attention_mask"][row, :end] = 1
        arrays["loss_mask"][row, start:end] = model * self.off_policy_mask[t][s]
        arrays["old_logprobs"][row, start:end] = np.where(model, sample.logprobs, 0.0)
        arrays["versions"][row, start:end] = np.where(model, sample.versions, ENV_VERSION)

    def _experts(self, rows: Sequence[tuple[int, int]], width: int) -> npt.NDArray[np.int64] | None:
        found = [self._sample(t, s).routed_experts for t, s in rows]
        present = [e for e in found if e is not None]
        if not rows or len(present) != len(rows):
            return None
        layers, top_k = present[0].shape[1:] if present[0].ndim == 3 else (0, 0)
        out = np.zeros((len(rows), max(width - 1, 0), layers, top_k), np.int64)
        for row, ((t, s), experts) in enumerate(zip(rows, present, strict=True)):
            expected = max(_length(self._sample(t, s)) - 1, 0)
            if experts.shape != (expected, layers, top_k):
                session = self.trajectories[t].session_id
                raise TrajectoryFormatError(
                    f"session {session} sample {s}: routed experts of shape {experts.shape}, "
                    f"expected ({expected}, {layers}, {top_k})"
                )
            out[row, :expected] = experts
        return out


def _length(sample: Sample) -> int:
    return int(sample.prompt_ids.size + sample.response_ids.size)


def _on_policy(sample: Sample, stale_before: int | None) -> npt.NDArray[np.uint8]:
    if stale_before is None:
        return np.ones(sample.response_ids.size, np.uint8)
    off = sample.loss_mask.astype(bool) & (sample.versions < stale_before)
    return (~off).astype(np.uint8)


def _is_stale(trajectory: Trajectory, stale_before: int) -> bool:
    versions = (sample.min_version for sample in trajectory.samples)
    return any(v is not None and v < stale_before for v in versions)


def _parse_entry(entry_id: str, fields: Mapping[bytes | str, bytes | str]) -> _Entry | None:
    raw = {_text(k): _text(v) for k, v in fields.items()}
    session_id = raw.get("session_id")
    if not session_id:
        return None
    try:
        samples = int(raw.get("samples", ""))
    except ValueError:
        samples = -1  # unknown: taken from the meta's sample_count
    return _Entry(entry_id, session_id, samples)


def _stream_entries(response: Any) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
    """XREADGROUP's reply, as RESP2 (`[[stream, entries]]`) or RESP3 (`{stream: [entries]}`) gives it."""
    if not response:
        return []
    streams = response.values() if isinstance(response, dict) else (entries for _, entries in response)
    out: list[tuple[str, Mapping[bytes | str, bytes | str]]] = []
    for entries in streams:
        # RESP3 wraps a stream's entries in one more list.
        flat = entries[0] if entries and isinstance(entries[0], list) else entries
        out.extend((_text(entry_id), fields) for entry_id, fields in flat if entry_id is not None)
    return out


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
        claim_idle_s: float = 60.0,
        group_by: str | None = None,
        group_size: int | None = None,
        max_group_wait_s: float | None = 3600.0,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "mask",
        ack_ttl_s: float = 60.0,
        socket_timeout_s: float = 10.0,
    ) -> None:
        if claim_idle_s < 0 or ack_ttl_s < 0 or socket_timeout_s <= 0:
            raise ValueError("claim_idle_s and ack_ttl_s must be >= 0, socket_timeout_s > 0")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if stale_policy not in ("drop", "mask"):
            raise ValueError(f"stale_policy must be 'drop' or 'mask', got {stale_policy!r}")
        self.redis_url = redis_url
        self.group = group
        self.consumer = consumer
        self.keys = Keys(prefix)
        self.claim_idle_s = claim_idle_s
        self.group_by = group_by
        self.group_size = group_size
        self.max_group_wait_s = max_group_wait_s
        self.max_staleness = max_staleness
        self.stale_policy: StalePolicy = stale_policy
        self.ack_ttl_s = ack_ttl_s
        self.socket_timeout_s = socket_timeout_s
        self._client: aioredis.Redis | None = None
        self._held: dict[str, _Item] = {}  # read here, not yet handed out (incomplete group, or no room yet)
        self._groups: dict[str, _Group] = {}  # incomplete groups by key
        self._ready: deque[list[_Item]] = deque()  # complete groups waiting for room in a batch
        self._delivered: dict[str, _Entry] = {}  # handed out, not yet acknowledged
        self._unconfirmed: dict[str, _Entry] = {}  # read, its meta has no stream_id yet: judged again later
        self._touched_at = 0.0

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
        try:
            with _store_errors("create consumer group"):
                try:
                    await client.xgroup_create(self.keys.trajectories, self.group, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):  # BUSYGROUP: it exists already, which is all we need
                        raise
        except StoreError:
            await client.aclose()
            raise
        self._client = client

    async def aclose(self) -> None:
        """Hand back the entries read but never handed out (others reclaim them at once), then disconnect.

        Entries handed out and not acknowledged stay with this consumer's name; they are reclaimed after
        `claim_idle_s`, as they would be after a crash.
        """
        client, self._client = self._client, None
        if client is None:
            return
        held = [*self._held, *self._unconfirmed]
        self._held.clear()
        self._unconfirmed.clear()
        self._groups.clear()
        self._ready.clear()
        try:
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        batch = Batch(current_version=await self._current_version())
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
            if len(batch) >= n or self._ready or remaining <= 0:
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
            entry = _Entry(trajectory.entry_id, trajectory.session_id, len(trajectory.samples))
            self._delivered[entry.entry_id] = entry
        return batch

    async def _current_version(self) -> int:
        with _store_errors("read weight version"):
            raw = await self.client.hget(self.keys.weights, "version")
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            logger.warning("%s has a version that is not an integer (%r); taking 0", self.keys.weights, raw)
            return 0

    async def _reclaim(self, count: int) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        """Take over entries idle for `claim_idle_s` (their consumer died); acknowledge deleted ones."""
        with _store_errors("reclaim idle entries"):
            claimed = await self.client.xautoclaim(
                self.keys.trajectories,
                self.group,
                self.consumer,
                min_idle_time=int(self.claim_idle_s * 1000),
                start_id="0-0",
                count=count,
                justid=True,  # the ids of deleted entries too (Redis 6.2 returns those as nil in a full reply)
            )
        ids = [i for i in map(_text, claimed) if not self._known(i)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.keys.trajectories, entry_id, entry_id)
        with _store_errors("load reclaimed entries"):
            found = await pipe.execute()
        entries = [(i, hits[0][1]) for i, hits in zip(ids, found, strict=True) if hits]
        gone = [i for i, hits in zip(ids, found, strict=True) if not hits]
        if gone:
            logger.warning("consumer %s: %d reclaimed entries were trimmed from the stream", self.consumer, len(gone))
            await self._settle([], gone)
        logger.info("consumer %s: reclaimed %d entries idle for %.1fs", self.consumer, len(entries), self.claim_idle_s)
        return entries

    async def _read(self, count: int, block_s: float) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
        block = max(1, int(block_s * 1000)) if block_s > 0 else None  # BLOCK 0 would wait forever
        with _store_errors("read trajectories"):
            response = await self.client.xreadgroup(
                self.group, self.consumer, {self.keys.trajectories: ">"}, count=count, block=block
            )
        return _stream_entries(response)

    def _known(self, entry_id: str) -> bool:
        return entry_id in self._held or entry_id in self._delivered or entry_id in self._unconfirmed

    async def _absorb(self, entries: list[tuple[str, Mapping[bytes | str, bytes | str]]], batch: Batch) -> None:
        """Judge the entries that waited for their `stream_id` again, then the new ones, in stream order."""
        parsed = list(self._unconfirmed.values())
        self._unconfirmed.clear()
        malformed: list[str] = []
        for entry_id, fields in entries:
            if self._known(entry_id):
                continue  # ours already (re-claimed after sitting idle here)
            entry = _parse_entry(entry_id, fields)
            if entry is None:
                logger.error("stream entry %s has no session_id; acknowledging it", entry_id)
                malformed.append(entry_id)
            else:
                parsed.append(entry)
        if malformed:
            await self._settle([], malformed)
            batch.dropped_unreadable += len(malformed)
        for item in await self._load(parsed, batch):
            self._hold(item)

    async def _load(self, parsed: list[_Entry], batch: Batch) -> list[_Item]:
        """Entries → trajectories, with two pipelined round trips at most; skipped entries are acknowledged."""
        if not parsed:
            return []
        loaded = await self._fetch(parsed)
        items: list[_Item] = []
        duplicates: list[str] = []
        unreadable: list[_Entry] = []
        for entry, (raw_meta, raw_samples) in zip(parsed, loaded, strict=True):
            verdict = _classify(entry, raw_meta, raw_samples)
            if isinstance(verdict, _Item):
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

    async def _fetch(self, entries: Sequence[_Entry]) -> list[tuple[dict[Any, Any], list[dict[Any, Any]]]]:
        """Each entry's meta and sample hashes; sample counts the entry does not carry come from the meta."""
        pipe = self.client.pipeline(transaction=False)
        for entry in entries:
            pipe.hgetall(self.keys.meta(entry.session_id))
            for index in range(max(entry.samples, 0)):
                pipe.hgetall(self.keys.sample(entry.session_id, index))
        with _store_errors("load sessions"):
            replies = iter(await pipe.execute())
        out = [(next(replies), [next(replies) for _ in range(max(e.samples, 0))]) for e in entries]
        unknown = [i for i, e in enumerate(entries) if e.samples < 0 and out[i][0]]
        if unknown:
            pipe = self.client.pipeline(transaction=False)
            counts = {i: _sample_count(entries[i], out[i][0]) for i in unknown}
            for i in unknown:
                for index in range(counts[i]):
                    pipe.hgetall(self.keys.sample(entries[i].session_id, index))
            with _store_errors("load sessions"):
                more = iter(await pipe.execute())
            for i in unknown:
                out[i] = (out[i][0], [next(more) for _ in range(counts[i])])
        return out

    def _hold(self, item: _Item) -> None:
        self._held[item.entry.entry_id] = item
        if self.group_by is None:
            self._ready.append([item])
            return
        key, size = self._group_of(item.trajectory)
        if key is None or size is None:
            logger.warning(
                "session %s: no %s or group size in its metadata; delivered as a group of its own",
                item.trajectory.session_id,
                self.group_by,
            )
            self._ready.append([item])
            return
        group = self._groups.setdefault(key, _Group(size=size, since=time.monotonic()))
        group.members.append(item)
        if len(group.members) >= group.size:
            del self._groups[key]
            self._ready.append(group.members)

    def _group_of(self, trajectory: Trajectory) -> tuple[str | None, int | None]:
        metadata = trajectory.meta.metadata
        key = metadata.get(self.group_by) if self.group_by is not None else None
        size = self.group_size
        if size is None:
            try:
                size = int(metadata["group_size"])
            except (KeyError, TypeError, ValueError):
                size = None
        if size is not None and size < 1:
            size = None
        return (None if key is None else str(key)), size

    async def _drop_overdue(self, batch: Batch) -> None:
        if self.max_group_wait_s is None or not self._groups:
            return
        now = time.monotonic()
        overdue = [key for key, group in self._groups.items() if now - group.since >= self.max_group_wait_s]
        dropped: list[_Item] = []
        for key in overdue:
            group = self._groups.pop(key)
            logger.warning(
                "group %s: %d of %d members after %.0fs; dropping the incomplete group",
                key,
                len(group.members),
                group.size,
                now - group.since,
            )
            dropped.extend(group.members)
        for item in dropped:
            del self._held[item.entry.entry_id]
        if dropped:
            await self._settle([item.entry for item in dropped], [])
            batch.dropped_incomplete += len(dropped)

    async def _fill(self, batch: Batch, n: int) -> None:
        """Move complete groups into the batch while they fit (the first one always does)."""
        stale: list[_Item] = []
        drop_before = batch.stale_before if self.stale_policy == "drop" else None
        while self._ready and (not batch.trajectories or len(batch) + len(self._ready[0]) <= n):
            group = self._ready.popleft()
            for item in group:
                del self._held[item.entry.entry_id]
            if drop_before is not None and any(_is_stale(item.trajectory, drop_before) for item in group):
                stale.extend(group)
            else:
                batch._add_group(group)
        if stale:
            await self._settle([item.entry for item in stale], [])
            batch.dropped_stale += len(stale)

    # ----------------------------------------------------------------------------------------------------------
    # keeping entries and acknowledging them

    async def _touch(self) -> None:
        """Reset the idle time of every entry this consumer holds or has handed out, so none is reclaimed while
        it is alive; forget those another consumer has taken over (it delivers them now)."""
        self._touched_at = time.monotonic()
        ids = [*self._held, *self._delivered, *self._unconfirmed]
        if not ids:
            return
        owned = set(await self._touch_script(self.client, ids, 0))
        lost = [i for i in ids if i not in owned]
        if lost:
            logger.warning("consumer %s: %d entries were reclaimed by another consumer", self.consumer, len(lost))
            self._forget(set(lost))

    async def _touch_script(self, client: aioredis.Redis, ids: Sequence[str], idle_ms: int) -> list[str]:
        with _store_errors("refresh held entries"):
            owned = await client.eval(_TOUCH, 1, self.keys.trajectories, self.group, self.consumer, idle_ms, *ids)
        return [_text(i) for i in owned]

    def _forget(self, lost: set[str]) -> None:
        for entry_id in lost:
            self._delivered.pop(entry_id, None)
            self._unconfirmed.pop(entry_id, None)
        # A group missing a member cannot be completed here: forget all of it. Its other members are no longer
        # refreshed, so they go idle and are reclaimed — by the consumer that has the missing member, or another.
        broken = [key for key, g in self._groups.items() if any(m.entry.entry_id in lost for m in g.members)]
        for key in broken:
            for item in self._groups.pop(key).members:
                self._held.pop(item.entry.entry_id, None)
        kept: deque[list[_Item]] = deque()
        for group in self._ready:
            if any(item.entry.entry_id in lost for item in group):
                for item in group:
                    self._held.pop(item.entry.entry_id, None)
            else:
                kept.append(group)
        self._ready = kept

    async def ack(self, items: Batch | Iterable[Trajectory | str]) -> int:
        """Acknowledge a batch, trajectories or entry ids; returns how many entries this call removed from the
        group's pending list (0 for ones already acknowledged). See the module docstring for what happens to
        `rg:pending` and the session's keys. Ids this consumer did not hand out are looked up in the stream."""
        real: list[_Entry] = []
        unknown: list[str] = []
        for item in items.trajectories if isinstance(items, Batch) else items:
            if isinstance(item, Trajectory):
                real.append(_Entry(item.entry_id, item.session_id, len(item.samples)))
            elif item in self._delivered:
                real.append(self._delivered[item])
            else:
                unknown.append(item)
        resolved, others = await self._resolve(unknown)
        acked = await self._settle(real + resolved, others)
        for entry in real + resolved:
            self._delivered.pop(entry.entry_id, None)
        return acked

    async def _resolve(self, ids: Sequence[str]) -> tuple[list[_Entry], list[str]]:
        """Split ids this consumer did not hand out into real entries and the rest (XACK only)."""
        if not ids:
            return [], []
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.keys.trajectories, entry_id, entry_id)
        with _store_errors("look up entries"):
            found = await pipe.execute()
        entries = [_parse_entry(i, hits[0][1]) if hits else None for i, hits in zip(ids, found, strict=True)]
        known = [e for e in entries if e is not None]
        pipe = self.client.pipeline(transaction=False)
        for entry in known:
            pipe.hget(self.keys.meta(entry.session_id), "stream_id")
            pipe.exists(self.keys.meta(entry.session_id))
        with _store_errors("look up sessions"):
            replies = await pipe.execute() if known else []
        real = [
            e for e, sid, exists in zip(known, replies[::2], replies[1::2], strict=True) if not exists or _is(sid, e)
        ]
        real_ids = {e.entry_id for e in real}
        return real, [i for i in ids if i not in real_ids]

    async def _settle(self, real: Sequence[_Entry], others: Sequence[str]) -> int:
        """XACK and XDEL every entry; for real ones the XACK removed, DECR `rg:pending` and expire the session's
        keys. Returns how many entries the XACK removed from the pending list."""
        if not real and not others:
            return 0
        ids = [*(e.entry_id for e in real), *others]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xack(self.keys.trajectories, self.group, entry_id)
        pipe.xdel(self.keys.trajectories, *ids)
        with _store_errors("acknowledge entries"):
            replies = await pipe.execute()
        acked: list[int] = replies[: len(ids)]
        removed = [e for e, count in zip(real, acked, strict=False) if count]
        if removed:
            pipe = self.client.pipeline(transaction=False)
            for entry in removed:
                pipe.decr(self.keys.pending)
                keys = [self.keys.meta(entry.session_id)]
                keys += [self.keys.sample(entry.session_id, i) for i in range(max(entry.samples, 0))]
                if self.ack_ttl_s > 0:
                    for key in keys:
                        pipe.pexpire(key, max(1, int(self.ack_ttl_s * 1000)))
                else:
                    pipe.delete(*keys)  # one hash tag: one slot
            with _store_errors("release acknowledged sessions"):
                await pipe.execute()
        return sum(acked)


def _sample_count(entry: _Entry, raw_meta: Mapping[bytes | str, bytes | str]) -> int:
    try:
        return SessionMeta.from_redis(entry.session_id, raw_meta).sample_count
    except TrajectoryFormatError:
        return 0  # the meta itself is unreadable: _classify says so


def _is(stream_id: bytes | str | None, entry: _Entry) -> bool:
    return stream_id is not None and _text(stream_id) == entry.entry_id


def _classify(entry: _Entry, raw_meta: dict[Any, Any], raw_samples: list[dict[Any, Any]]) -> _Item | str:
    """An entry's fate: a trajectory, or "duplicate", "unreadable" or "unconfirmed"."""
    if not raw_meta:
        logger.warning("session %s: meta expired or deleted; acknowledging entry %s", entry.session_id, entry.entry_id)
        return "unreadable"
    try:
        meta = SessionMeta.from_redis(entry.session_id, raw_meta)
        if meta.stream_id is None:
            return "unconfirmed"
        if meta.stream_id != entry.entry_id:
            return "duplicate"
        if any(not raw for raw in raw_samples):
            raise TrajectoryFormatError("a sample hash is missing (expired or never written)")
        samples = [Sample.from_redis(raw) for raw in raw_samples]
    except TrajectoryFormatError as exc:
        logger.warning("session %s: unreadable (%s); acknowledging entry %s", entry.session_id, exc, entry.entry_id)
        return "unreadable"
    return _Item(
        Trajectory(meta=meta, samples=samples, entry_id=entry.entry_id),
        _Entry(entry.entry_id, entry.session_id, len(samples)),
    )
