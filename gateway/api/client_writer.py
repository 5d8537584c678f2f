"""The body of one streamed answer on its way to its client, decoupled from the generation that produces it.

The response's task runs the body generator (the generation, its engine request, the turn's record) and queues
each chunk here without ever waiting for the client; a writer task of its own sends what is queued, every chunk
queued since its last send in one message. So an engine request ends (and leaves the replica's in-flight count,
which a `wait` weight update drains) at engine speed even when its client reads slowly or not at all, and its turn
is recorded then (docs/reliability.md, issue 38 §2). A client is cut (`SlowClient`) when what waits for it passes
`server.stream_buffer_bytes`, or when one send to it has made no progress for `server.slow_client_timeout_s`.

Every writer of a process also counts what it holds in one `StreamBuffers` (issue 52 §2): its queued chunks and
the message its send is waiting to hand to the transport (uvicorn's `send` waits for the socket to drain before it
writes). When a chunk takes the process's total past `server.stream_buffer_budget_bytes`, the writers that hold the
most (the slowest readers) are cut until the total is within it: a client that keeps up holds next to nothing and
is never the one cut. A cut writer drops its bytes at once; its response ends as for any `SlowClient` at its next
chunk (or at once if its generation is over). Once a slow client's bytes are dropped the process hands the freed
heap back to the system (`gateway.gc_tuning.trim_heap`): chunks are small allocations, which the C allocator
otherwise keeps.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import Message, Send

from gateway.gc_tuning import trim_heap

logger = logging.getLogger(__name__)

__all__ = ["CUT_CAUSES", "ClientWriter", "SlowClient", "StreamBuffers"]

CUT_CAUSES = ("buffer", "stalled", "budget")
"""Why a client was cut: `server.stream_buffer_bytes`, `server.slow_client_timeout_s`, or the process's budget."""

TRIM_AFTER_BYTES = 4 * 1024 * 1024
"""Bytes dropped by cut writers since the last heap trim that make the next one worth its pause."""

TRIM_DELAY_S = 1.0
"""How long after such a drop the heap is trimmed: the cut connections and their tasks are gone by then, and
a burst of cuts is trimmed once."""


class SlowClient(Exception):
    """The client read its streamed answer too slowly: what waited for it passed a limit."""


class StreamBuffers:
    """The bytes every streamed answer of one process holds for its client (`queued_bytes`), against
    `budget_bytes`; `cuts` counts the clients cut, by cause (`CUT_CAUSES`). O(1) per chunk; over the budget, the
    writers holding the most are found by one pass over the writers with a stream under way."""

    __slots__ = ("_dropped", "_trim", "_writers", "budget_bytes", "cuts", "queued_bytes")

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.queued_bytes = 0
        self.cuts = dict.fromkeys(CUT_CAUSES, 0)
        self._writers: set[ClientWriter] = set()
        self._dropped = 0  # bytes cut writers dropped since the last trim
        self._trim: asyncio.TimerHandle | None = None

    @property
    def streams(self) -> int:
        """Writers with a stream under way (those that queued a chunk and are not closed)."""
        return len(self._writers)

    def enter(self, writer: ClientWriter) -> None:
        """`writer` queued its first chunk."""
        self._writers.add(writer)

    def leave(self, writer: ClientWriter, held: int) -> None:
        """`writer` closed, dropping the `held` bytes it counted."""
        self.queued_bytes -= held
        self._writers.discard(writer)

    def relieve(self) -> None:
        """Cut the writers that hold the most until the total is within the budget."""
        writers = self._writers
        while self.queued_bytes > self.budget_bytes and writers:
            biggest = max(writers, key=ClientWriter.held)
            if not biggest.held():
                return
            biggest.cut(
                "budget",
                f"the process's streamed answers held {self.queued_bytes} bytes, more than "
                f"server.stream_buffer_budget_bytes ({self.budget_bytes}); this client's held the most "
                f"({biggest.held()})",
            )

    def dropped(self, nbytes: int) -> None:
        """A cut writer dropped `nbytes`: trim the heap soon once enough were dropped."""
        self._dropped += nbytes
        if self._dropped >= TRIM_AFTER_BYTES and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        self._dropped = 0
        trim_heap()


class ClientWriter:
    """Sends the queued chunks of one streamed body (`put`), then its end (`finish`), from a task of its own."""

    __slots__ = (
        "_buffers",
        "_chunks",
        "_end",
        "_error",
        "_ready",
        "_send",
        "_sending",
        "_sending_since",
        "_size",
        "_task",
        "limit_bytes",
        "timeout_s",
    )

    def __init__(self, send: Send, limit_bytes: int, timeout_s: float, buffers: StreamBuffers) -> None:
        self._send = send
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self._buffers = buffers
        self._chunks: list[bytes] = []
        self._size = 0  # bytes of `_chunks`
        self._sending = 0  # bytes of the message the send under way holds
        self._ready = asyncio.Event()
        self._sending_since: float | None = None  # loop time the send under way began; None between sends
        self._error: BaseException | None = None
        self._end: tuple[Message, Send] | None = None  # the body's last message, once `finish` gave it
        # Hard reference: the loop keeps only weak references to tasks.
        self._task: asyncio.Task[None] | None = None

    def held(self) -> int:
        """Bytes this writer holds for its client: queued, and in the send under way."""
        return self._size + self._sending

    def put(self, chunk: bytes) -> None:
        """Queue a body chunk; raises `SlowClient` if the client is past a limit (or the send's own error)."""
        if self._error is not None:
            raise self._error
        self._check_progress()
        size = self._size + len(chunk)
        if size > self.limit_bytes:
            raise self.cut("buffer", f"more than {self.limit_bytes} bytes of the answer wait for the client")
        self._size = size
        self._chunks.append(chunk)
        buffers = self._buffers
        buffers.queued_bytes += len(chunk)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write())
            buffers.enter(self)
        if buffers.queued_bytes > buffers.budget_bytes:
            buffers.relieve()
            if self._error is not None:  # this client held the most
                raise self._error
        self._ready.set()

    async def finish(self, last: bytes, send_last: Send) -> None:
        """Send everything queued, then `last` as the end of the body through `send_last`; raises `SlowClient` if
        a send makes no progress for `timeout_s`."""
        if self._error is not None:  # cut meanwhile by the process's budget
            raise self._error
        end = {"type": "http.response.body", "body": last, "more_body": False}
        task = self._task
        if task is None:
            await send_last(end)
            return
        self._end = (end, send_last)
        self._ready.set()
        loop = asyncio.get_running_loop()
        while not task.done():
            self._check_progress()
            since = self._sending_since
            left = self.timeout_s if since is None else since + self.timeout_s - loop.time()
            await asyncio.wait((task,), timeout=max(left, 0.001))
        if self._error is not None:
            raise self._error

    def cut(self, cause: str, why: str) -> BaseException:
        """Cut this client (`cause` of `CUT_CAUSES`): drop what it holds, stop its send; `put` and `finish` raise
        `SlowClient(why)` from now on (returned, or the error that ended the writer before)."""
        error = self._error
        if error is None:
            error = self._error = SlowClient(why)
            self._buffers.cuts[cause] += 1
        dropped = self.held()
        self.close()
        self._buffers.dropped(dropped)
        return error

    def close(self) -> None:
        """Stop the writer and drop what it holds (after `finish`, or when the answer is cut); not awaited, like a
        disconnect watch."""
        buffers = self._buffers
        buffers.leave(self, self._size + self._sending)
        self._chunks = []
        self._size = self._sending = 0
        self._end = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _check_progress(self) -> None:
        since = self._sending_since
        if since is not None and asyncio.get_running_loop().time() - since > self.timeout_s:
            raise self.cut("stalled", f"a send to the client made no progress for {self.timeout_s:g}s")

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        ready = self._ready
        buffers = self._buffers
        try:
            while True:
                if not self._chunks:
                    if self._end is not None:
                        message, send = self._end
                        self._sending_since = loop.time()
                        await send(message)
                        return
                    ready.clear()
                    await ready.wait()
                    continue
                chunks, self._chunks = self._chunks, []
                self._sending, self._size = self._size, 0
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                del chunks  # the send holds the joined body alone
                self._sending_since = loop.time()
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
                self._sending_since = None
                buffers.queued_bytes -= self._sending
                self._sending = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server's send failed: `put` or `finish` raises it in the response's task
            self._error = exc
