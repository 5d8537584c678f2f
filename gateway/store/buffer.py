"""The write buffer: sample writes wait in memory while Redis is unreachable, and a background flusher retries.

The buffer keeps the latest version of each sample (a newer one takes the older one's place), oldest first. It is
bounded: with `max_buffered_writes` writes waiting, a write of another sample raises `StoreError` (the request
fails loudly; nothing is dropped). A session's `writes` lock (`SessionLocks`, gateway/store/locks.py) serialises
its sample writes, direct and flushed, so an older version can never land after a newer one.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.background import background, stop
from gateway.errors import StoreError
from gateway.store.core import Fields, StoreStats, backoff_s
from gateway.store.locks import SessionLocks
from gateway.store.samples import SampleWrite, SampleWriter
from gateway.trajectory import SampleSaved

__all__ = ["WriteBuffer"]

logger = logging.getLogger(__name__)


class WriteBuffer:
    """Sample writes, sent at once while Redis answers, buffered while it does not (see the module docstring).

    `start()` runs the flusher; without it, writes are never buffered (a failure raises). `locks`: the process's
    session locks, whose `writes` locks this takes."""

    def __init__(
        self, writer: SampleWriter, stats: StoreStats, locks: SessionLocks, *, max_buffered_writes: int
    ) -> None:
        self._writer = writer
        self._stats = stats
        self._locks = locks
        self.max_buffered_writes = max_buffered_writes
        # Sample writes waiting for Redis, oldest first; a newer version of a sample replaces the older in place.
        self._buffer: dict[tuple[str, int], SampleWrite] = {}
        self._outage = False  # the last write failed: buffer new writes at once instead of waiting on retries
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None  # a hard reference: the event loop keeps only weak ones

    def __len__(self) -> int:
        return len(self._buffer)

    def start(self) -> None:
        if self._flusher is None:
            self._flusher = background(self._flush_forever(), "trajectory-store-flusher")

    async def aclose(self, drain_timeout_s: float) -> None:
        """Stop the flusher; the buffered writes get one last flush bounded by `drain_timeout_s`. Writes that still
        could not be written are logged as lost, by count."""
        await stop(self._flusher)
        self._flusher = None
        if self._buffer:
            try:
                await asyncio.wait_for(self.flush(), drain_timeout_s)
            except (StoreError, TimeoutError) as exc:
                logger.error("closing with %d sample writes Redis never took; they are lost: %s", len(self), exc)

    async def save(self, write: SampleWrite) -> SampleSaved | str | None:
        """Write now: what the write made, or the status that refused it; None where it waits in the buffer."""
        if self._replace_buffered(write):
            return None
        async with self._locks.writes(write.session_id):
            if self._replace_buffered(write):
                return None
            if self._outage and self._flusher is not None:  # Redis is known down: no need to wait on retries
                self.buffer_write(write)
                return None
            try:
                verdict = await self._writer.write(write)
            except StoreError as exc:
                logger.warning(
                    "session=%s sample=%d: buffering the write, redis unavailable: %s",
                    write.session_id,
                    write.index,
                    exc,
                )
                self._outage = True
                self.buffer_write(write)
                return None
            self._outage = False
        return verdict

    def waiting(self, session_id: str) -> dict[int, Fields]:
        """The session's buffered samples, whole, by the index they are written to."""
        return {
            self._writer.index_of(write): write.whole()[0]
            for write in self._buffer.values()
            if write.session_id == session_id
        }

    def buffer_write(self, write: SampleWrite) -> None:
        if len(self._buffer) >= self.max_buffered_writes:
            raise StoreError(
                f"redis unavailable and {len(self._buffer)} sample writes already buffered "
                f"(max_buffered_writes); refusing sample {write.index} of session {write.session_id} "
                "rather than dropping a write"
            )
        write.stored = None
        self._buffer[write.key] = write
        self._stats.writes_buffered += 1
        self._wake.set()

    def _replace_buffered(self, write: SampleWrite) -> bool:
        """While a version of this sample waits in the buffer, a newer one takes its place (keeps order)."""
        waiting = self._buffer.get(write.key)
        if waiting is None:
            return False
        write.stored = None  # a buffered write replaces the whole sample
        if write.base == waiting.writer and write.writer != waiting.writer:
            write.base = waiting.base  # it extends the waiting write, which never reached Redis: extend its base
        self._buffer[write.key] = write
        self._stats.writes_buffered += 1
        return True

    async def _flush_forever(self) -> None:
        attempt = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                try:
                    await self.flush()
                    attempt = 0
                except StoreError as exc:
                    attempt += 1
                    delay = backoff_s(attempt)
                    logger.warning(
                        "%d buffered sample writes; redis still down (%s); retry in %.2fs", len(self), exc, delay
                    )
                    await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    async def flush(self, session_id: str | None = None) -> None:
        """Write buffered samples (of one session, or all), oldest first. Raises `StoreError` at the first failure."""
        for key in [k for k in self._buffer if session_id is None or k[0] == session_id]:
            async with self._locks.writes(key[0]):
                write = self._buffer.get(key)
                if write is None:
                    continue
                verdict = await self._writer.write(write)
                self._outage = False
                if self._buffer.get(key) is write:  # else a newer version arrived meanwhile: it goes next round
                    del self._buffer[key]
            self._stats.writes_flushed += 1
            if not isinstance(verdict, SampleSaved):
                self._stats.writes_refused += 1
                logger.error(
                    "session=%s sample=%d: buffered write refused, session %s", write.session_id, write.index, verdict
                )
