"""Stream entries and what each becomes (the trainer's side of the schema in gateway/store/keys.py):

- the *real* entry of a session (its id equals the meta's `stream_id`) becomes a `Trajectory` in a batch;
- a *duplicate* (another entry for the same session, left by a crashed finish) is acknowledged and skipped
  (`Batch.dropped_duplicate`); it never touches `rg:pending:sessions` or the session's keys;
- an entry whose session data has expired or does not decode is logged, acknowledged as if real (pending is
  decremented; the meta is gone, so which entry was real cannot be told, and a real one is by far the more
  likely) and counted in `Batch.dropped_unreadable`;
- an entry whose meta has no `stream_id` yet (its writer is between XADD and the `stream_id` claim, or
  crashed there) is not arbitrated yet: it stays pending here and is judged again at every read (every 50 ms
  while `next_batch` waits) until the store's finish or its repair sweeper settles it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.errors import StoreError
from gateway.sample_tree import joined
from gateway.store.keys import REDIS_ERRORS, Keys
from gateway.trajectory import Sample, SessionMeta, Trajectory, TrajectoryFormatError

__all__ = [
    "Entry",
    "Item",
    "classify",
    "fetch_sessions",
    "is_real",
    "parse_entry",
    "qualify",
    "sample_count",
    "split_id",
    "store_errors",
    "stream_entries",
    "text",
]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """A redis error inside becomes `StoreError` naming `what` failed."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise StoreError(f"redis: {what} failed: {exc}") from exc


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def qualify(raw_id: str, partition: int) -> str:
    """The id a consumer hands out for entry `raw_id` of stream partition `partition`: the stream's own id in
    partition 0, `<id>@<partition>` in the others (ids are per stream: two partitions may hold the same one)."""
    return raw_id if partition == 0 else f"{raw_id}@{partition}"


def split_id(entry_id: str) -> tuple[str, int]:
    """`qualify` undone: (the stream's id, the partition)."""
    raw, _, partition = entry_id.partition("@")
    return raw, int(partition) if partition.isdigit() else 0


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry: enough to acknowledge it and expire its session's keys. `entry_id` is qualified
    (`qualify`): unique across the stream's partitions."""

    entry_id: str
    session_id: str
    samples: int

    @property
    def raw_id(self) -> str:
        return split_id(self.entry_id)[0]

    @property
    def partition(self) -> int:
        return split_id(self.entry_id)[1]


@dataclass(slots=True)
class Item:
    """A trajectory read here, and the entry it came from."""

    trajectory: Trajectory
    entry: Entry


def parse_entry(entry_id: str, fields: Mapping[bytes | str, bytes | str]) -> Entry | None:
    raw = {text(k): text(v) for k, v in fields.items()}
    session_id = raw.get("session_id")
    if not session_id:
        return None
    try:
        samples = int(raw.get("samples", ""))
    except ValueError:
        samples = -1  # unknown: taken from the meta's sample_count
    return Entry(entry_id, session_id, samples)


def stream_entries(response: Any) -> list[tuple[str, Mapping[bytes | str, bytes | str]]]:
    """XREADGROUP's reply, as RESP2 (`[[stream, entries]]`) or RESP3 (`{stream: [entries]}`) gives it."""
    if not response:
        return []
    streams = response.values() if isinstance(response, dict) else (entries for _, entries in response)
    out: list[tuple[str, Mapping[bytes | str, bytes | str]]] = []
    for entries in streams:
        # RESP3 wraps a stream's entries in one more list.
        flat = entries[0] if entries and isinstance(entries[0], list) else entries
        out.extend((text(entry_id), fields) for entry_id, fields in flat if entry_id is not None)
    return out


def sample_count(entry: Entry, raw_meta: Mapping[bytes | str, bytes | str]) -> int:
    try:
        return SessionMeta.from_redis(entry.session_id, raw_meta).sample_count
    except TrajectoryFormatError:
        return 0  # the meta itself is unreadable: classify says so


def is_real(stream_id: bytes | str | None, entry: Entry) -> bool:
    return stream_id is not None and text(stream_id) == entry.raw_id


def classify(entry: Entry, raw_meta: dict[Any, Any], raw_samples: list[dict[Any, Any]]) -> Item | str:
    """An entry's fate: a trajectory, or "duplicate", "unreadable" or "unconfirmed"."""
    if not raw_meta:
        logger.warning("session %s: meta expired or deleted; acknowledging entry %s", entry.session_id, entry.entry_id)
        return "unreadable"
    try:
        meta = SessionMeta.from_redis(entry.session_id, raw_meta)
        if meta.stream_id is None:
            return "unconfirmed"
        if meta.stream_id != entry.raw_id:
            return "duplicate"
        if any(not raw for raw in raw_samples):
            raise TrajectoryFormatError("a sample hash is missing (expired or never written)")
        samples = joined({index: Sample.from_redis(raw) for index, raw in enumerate(raw_samples)})
    except TrajectoryFormatError as exc:
        logger.warning("session %s: unreadable (%s); acknowledging entry %s", entry.session_id, exc, entry.entry_id)
        return "unreadable"
    return Item(
        Trajectory(meta=meta, samples=samples, entry_id=entry.entry_id),
        Entry(entry.entry_id, entry.session_id, len(samples)),
    )


async def fetch_sessions(
    client: aioredis.Redis, keys: Keys, entries: Sequence[Entry]
) -> list[tuple[dict[Any, Any], list[dict[Any, Any]]]]:
    """Each entry's meta and sample hashes; sample counts the entry does not carry come from the meta."""
    pipe = client.pipeline(transaction=False)
    for entry in entries:
        pipe.hgetall(keys.meta(entry.session_id))
        for index in range(max(entry.samples, 0)):
            pipe.hgetall(keys.sample(entry.session_id, index))
    with store_errors("load sessions"):
        replies = iter(await pipe.execute())
    out = [(next(replies), [next(replies) for _ in range(max(e.samples, 0))]) for e in entries]
    unknown = [i for i, e in enumerate(entries) if e.samples < 0 and out[i][0]]
    if unknown:
        pipe = client.pipeline(transaction=False)
        counts = {i: sample_count(entries[i], out[i][0]) for i in unknown}
        for i in unknown:
            for index in range(counts[i]):
                pipe.hgetall(keys.sample(entries[i].session_id, index))
        with store_errors("load sessions"):
            more = iter(await pipe.execute())
        for i in unknown:
            out[i] = (out[i][0], [next(more) for _ in range(counts[i])])
    return out
