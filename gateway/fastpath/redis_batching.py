"""Auto-pipelining: the short non-transactional pipelines of concurrent callers, sent to Redis as one.

Every chat turn makes two short round trips to Redis (read the session's meta, write its sample). Under load many
turns make them at once, and each pipeline costs the gateway a connection checkout, a socket write and a read (on
the session routes, the socket write to Redis was the largest single item of a profile), and costs Redis a read
and a write per connection. `PipelineBatcher.execute` hands a caller the replies to its own commands, exactly as
`Pipeline.execute(raise_on_error=False)` would: a caller that finds no pipeline in flight sends its own at once (no
added latency at low load); callers that arrive while one is in flight wait, and are sent together, in arrival
order, as soon as it returns. The batch grows with the load, with no timer (Nagle's algorithm without the delay).

What Redis does is unchanged: the pipelines batched here were never transactions, and each caller's commands stay
contiguous and in order. A transport failure of a batch fails every caller in it with that error, as it would have
failed each of their own pipelines; a command error reaches only its caller, as an exception object in its replies.

Since one batch at a time is in flight, the batcher sends on one connection of its own (checked out of the client's
pool once and kept) instead of checking one out per pipeline, and times the whole round trip once:
redis-py's `Pipeline.execute` wraps each socket write in `asyncio.wait_for` (a task per write) and each reply's read
in a timeout of its own, besides the pool's checkout and its metrics hooks: a large share of the gateway's CPU on a
session turn at concurrency 1. Commands are queued, packed and parsed by redis-py as in its pipeline (the client's
reply callbacks included), and a connection error or timeout is retried by the connection's retry policy, as
`Pipeline.execute` retries it; a client whose pool cannot make such a connection keeps `Pipeline.execute`.

What it pays (`benchmarks.ab . . --together --set-b RG_FASTPATH__REDIS_BATCHING=false`, 4 rounds, 2-core host, 83d6584):
with it off the gateway spends 1.31× the CPU per `multiturn` chat request and 1.07× per streamed `rl` token.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.store.pipelines import Build

__all__ = ["PipelineBatcher"]


@dataclass(slots=True)
class _Call:
    build: Build
    replies: asyncio.Future[list[Any]]


class PipelineBatcher:
    """Runs callers' pipelines, batching those that arrive while one is in flight (see the module docstring).

    `max_batch` bounds the callers per pipeline. `pipelines` and `calls` count what was sent: their ratio is the
    mean batch size.
    """

    def __init__(self, client: aioredis.Redis, max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._client = client
        self._max_batch = max_batch
        self._queue: collections.deque[_Call] = collections.deque()
        self._busy = False  # a pipeline is in flight (a caller's own, or the flusher's)
        self._flusher: asyncio.Task[None] | None = None
        self.pipelines = 0
        self.calls = 0
        # The batcher's own connection (see the module docstring), checked out when first used, and the bound of a
        # round trip on it: the pool's socket timeout.
        self._connection: AbstractConnection | None = None
        self._timeout_s: float | None = None

    async def execute(self, build: Build) -> list[Any]:
        """The replies to the commands `build` queues, in order; a command's error is its reply (an exception
        object), a transport failure raises. Cancelling a caller that waits for a batch withdraws its commands if
        they were not sent yet."""
        if self._busy:
            call = _Call(build, asyncio.get_running_loop().create_future())
            self._queue.append(call)
            return await call.replies
        self._busy = True
        try:
            (replies,) = await self._send([build])
            return replies
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """The caller's own pipeline returned: the callers queued meanwhile go next, from a task of their own."""
        if self._queue:
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="redis-pipeline-batcher")
        else:
            self._busy = False

    async def _flush(self) -> None:
        batch: list[_Call] = []
        try:
            while self._queue:
                batch = []
                while self._queue and len(batch) < self._max_batch:
                    call = self._queue.popleft()
                    if not call.replies.done():  # a caller cancelled while queued: its commands are never sent
                        batch.append(call)
                if not batch:
                    continue
                try:
                    results = await self._send([call.build for call in batch])
                except Exception as exc:  # every caller of the batch gets the failure
                    for call in batch:
                        if not call.replies.done():
                            call.replies.set_exception(exc)
                    continue
                for call, replies in zip(batch, results, strict=True):
                    if not call.replies.done():
                        call.replies.set_result(replies)
        finally:
            self._flusher = None
            self._busy = False
            # Only if the flusher itself was cancelled (the loop is closing): nobody is left waiting forever.
            for call in [*batch, *self._queue]:
                call.replies.cancel()
            self._queue.clear()

    async def _send(self, builds: list[Build]) -> list[list[Any]]:
        """One pipeline holding every build's commands; the replies split back per build."""
        ends: list[int] = []
        async with self._client.pipeline(transaction=False) as pipe:
            for build in builds:
                build(pipe)
                ends.append(len(pipe))
            connection = self._connection or await self._own_connection()
            if connection is None or pipe.scripts:
                replies = await pipe.execute(raise_on_error=False)
            else:
                commands = pipe.command_stack
                replies = await connection.retry.call_with_retry(
                    lambda: self._round_trip(connection, commands), lambda _: connection.disconnect()
                )
        self.pipelines += 1
        self.calls += len(builds)
        starts = [0, *ends[:-1]]
        return [replies[start:end] for start, end in zip(starts, ends, strict=True)]

    async def _own_connection(self) -> AbstractConnection | None:
        """The batcher's connection: checked out of the client's pool once and kept (the pool still closes it with
        the client), its socket timeout bounding each whole round trip instead of each read and write (see
        `_round_trip`); None where the client has no such pool (a cluster client): `Pipeline.execute` then sends
        every batch."""
        pool = getattr(self._client, "connection_pool", None)
        if not isinstance(pool, ConnectionPool):
            return None
        connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
        self._timeout_s, connection.socket_timeout = connection.socket_timeout, None
        self._connection = connection
        return connection

    async def _round_trip(self, connection: AbstractConnection, commands: Any) -> list[Any]:
        """`commands` (a pipeline's queued `(args, options)`) in one write, their replies as `Pipeline.execute`
        gives them with `raise_on_error=False`; the whole exchange bounded by the socket timeout."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await connection.send_packed_command(connection.pack_commands([args for args, _ in commands]))
                replies: list[Any] = []
                parse = self._client.parse_response
                for args, options in commands:
                    try:
                        replies.append(await parse(connection, args[0], **options))  # type: ignore[arg-type]
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
        except TimeoutError:
            await connection.disconnect(nowait=True)  # replies may still be on their way: never read them as others'
            raise RedisTimeoutError("Redis did not answer a pipeline within the socket timeout") from None

    async def aclose(self) -> None:
        """Wait for the batch in flight and the callers queued behind it, then return the batcher's connection to
        the pool."""
        flusher = self._flusher
        if flusher is not None:
            await asyncio.wait([flusher])
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.socket_timeout = self._timeout_s
            await self._client.connection_pool.release(connection)
