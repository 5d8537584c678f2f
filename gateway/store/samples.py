"""Sample writes and reads: one atomic script per write on the session's slot (`scripts.SAVE_SAMPLE`), never per
token; a write extending what is stored sends only what is new; turns of one session on two processes never
replace each other's sample (the later one moves to the first free index)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from redis.asyncio.client import Pipeline

from gateway.errors import StoreError
from gateway.store.core import Fields, StoreCore
from gateway.store.keys import REDIS_ERRORS, call, text
from gateway.store.scripts import queue, rerun_unknown
from gateway.trajectory import Sample, SampleSaved, StoredChunks

__all__ = ["SampleWrite", "SampleWriter", "read_samples"]

logger = logging.getLogger(__name__)

_MAX_SAMPLE_MOVES = 16  # a sample write finding its index taken moves to the first free one, and again if raced
_MOVES_KEPT = 10_000  # the moved samples remembered, so the later writes of their turns follow them


def _as_stored(fields: dict[str, bytes | int | str]) -> Fields:
    return {name: v if isinstance(v, bytes) else str(v).encode() for name, v in fields.items()}


@dataclass(slots=True)
class SampleWrite:
    """One sample write, kept until it reached Redis: the sample, and what its hash holds of it already (None: the
    write replaces the whole sample; so does every buffered write); the turn writing it and the writer of what it
    extends ("": not arbitrated, and a new sample, see `TrajectoryStore.save_sample`)."""

    session_id: str
    index: int
    sample: Sample
    replica: str
    at: float
    stored: StoredChunks | None = None
    writer: str = ""
    base: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.session_id, self.index

    @property
    def moves_key(self) -> tuple[str, int, str]:
        """What names this turn's sample in `SampleWriter`'s moves."""
        return self.session_id, self.index, self.writer

    def encode(self) -> tuple[int, str, Fields, StoredChunks]:
        """(chunks kept, where they end, the fields to set, what the hash holds after)."""
        if self.stored is not None:
            extending = self.sample.to_redis_extending(self.stored)
            if extending is not None:
                fields, after = extending
                kept, ends = len(self.stored.ends), self.stored.ends_field
                return kept, ends, self._with_writer(_as_stored(fields)), after
        whole, after = self.whole()
        return 0, "", whole, after

    def whole(self) -> tuple[Fields, StoredChunks]:
        """The fields of the whole sample exactly as Redis stores and returns them (so a buffered copy decodes
        alike), and what the hash holds after."""
        fields, after = self.sample.to_redis_whole()
        return self._with_writer(_as_stored(fields)), after

    def _with_writer(self, fields: Fields) -> Fields:
        if self.writer:
            fields["writer"] = self.writer.encode()
        return fields


@dataclass(frozen=True, slots=True)
class _Taken:
    """The script's answer where another turn wrote the sample meanwhile: the session's first free index."""

    free: int


class SampleWriter:
    """Writes samples where their turn's writes go, remembering the samples that moved."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        # Samples whose index another process's turn took first: (session, index, writer) -> where they went.
        self._moved: OrderedDict[tuple[str, int, str], int] = OrderedDict()

    def index_of(self, write: SampleWrite) -> int:
        """Where the write's sample is stored: its own index, unless its turn's sample moved."""
        return self._moved.get(write.moves_key, write.index)

    async def write(self, write: SampleWrite) -> SampleSaved | str:
        """Write the sample where its turn's writes go; what the write made, or the status that refused it
        ('missing' for an unknown session). A sample another turn took meanwhile moves to the first free index,
        whole."""
        for _ in range(_MAX_SAMPLE_MOVES):
            index = self.index_of(write)
            if index != write.index:  # what the turn extends is not stored there: the sample goes whole
                write.stored = None
            # At the index it moved to, the turn's own write is the only one it may replace.
            verdict = await self._write_at(write, index, write.base if index == write.index else "")
            if not isinstance(verdict, _Taken):
                return verdict
            logger.warning(
                "session=%s sample=%d: written meanwhile by another turn (another process); this turn's sample "
                "goes to index %d, whole, and both are kept",
                write.session_id,
                index,
                verdict.free,
            )
            self._core.stats.samples_moved += 1
            self._moved[write.moves_key] = verdict.free
            self._moved.move_to_end(write.moves_key)
            while len(self._moved) > _MOVES_KEPT:
                self._moved.popitem(last=False)
        raise StoreError(
            f"session {write.session_id}: sample {write.index} found its index taken {_MAX_SAMPLE_MOVES} times"
        )

    async def _write_at(self, write: SampleWrite, index: int, base: str) -> SampleSaved | _Taken | str:
        """The sample script and the activity score, pipelined in one round trip. A write that extends what the
        hash no longer holds is sent again, whole."""
        keys, save = self._core.keys, self._core.scripts.save_sample
        script_keys = [keys.meta(write.session_id), keys.sample(write.session_id, index)]
        kept, ends, fields, after = write.encode()
        args: list[bytes | str | int | float] = [
            index + 1,
            write.at,
            write.replica,
            self._core.active_ttl_s,
            kept,
            ends,
            write.writer,
            base,
        ]
        for name, value in fields.items():
            args += [name, value]
        try:

            def build(pipe: Pipeline) -> None:
                queue(pipe, save, script_keys, args)
                # XX: only sessions still indexed as active; GT: a late write never moves the score back.
                pipe.zadd(keys.active_sessions, {write.session_id: write.at}, xx=True, gt=True)

            reply, _ = await self._core.batcher.execute(build)
            reply = await rerun_unknown(reply, save, script_keys, args)
            if isinstance(reply, Exception):
                raise reply
        except REDIS_ERRORS as exc:
            raise StoreError(f"redis: save sample failed: {exc}") from exc
        outcome = text(reply[0])
        if outcome == "saved":
            return SampleSaved(int(reply[1]), after, index)
        if outcome == "taken":
            return _Taken(int(reply[1]))
        if outcome == "rewrite":
            logger.info(
                "session=%s sample=%d: not stored as the writer believed; writing it whole", write.session_id, index
            )
            write.stored = None
            return await self._write_at(write, index, base)
        return text(reply[1])  # refused: the session's status


async def read_samples(core: StoreCore, session_id: str, count: int) -> dict[int, Fields]:
    """The stored hashes of the session's first `count` samples, by index (missing ones left out)."""
    if not count:
        return {}

    async def read() -> list[Fields]:
        async with core.client.pipeline(transaction=False) as pipe:  # a cluster's may fail on entry already
            for index in range(count):
                pipe.hgetall(core.keys.sample(session_id, index))
            return list(await pipe.execute())

    rows = await call(read(), "read samples")
    return {index: row for index, row in enumerate(rows) if row}
