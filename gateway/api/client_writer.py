"""The body of one streamed answer on its way to its client, decoupled from the generation that produces it.

The response's task runs the body generator (the generation, its engine request, the turn's record) and queues
each chunk here without ever waiting for the client; a writer task of its own sends what is queued, every chunk
queued since its last send in one message. So an engine request ends (and leaves the replica's in-flight count,
which a `wait` weight update drains) at engine speed even when its client reads slowly or not at all, and its turn
is recorded then (docs/reliability.md, issue 38 §2). A client is cut (`SlowClient`) when what waits for it passes
`server.stream_buffer_bytes`, or when one send to it has made no progress for `server.slow_client_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import Message, Send

logger = logging.getLogger(__name__)

__all__ = ["ClientWriter", "SlowClient"]


class SlowClient(Exception):
    """The client read its streamed answer too slowly: what waited for it passed a limit."""


class ClientWriter:
    """Sends the queued chunks of one streamed body (`put`), then its end (`finish`), from a task of its own."""

    __slots__ = (
        "_chunks",
        "_end",
        "_error",
        "_ready",
        "_send",
        "_sending_since",
        "_size",
        "_task",
        "limit_bytes",
        "timeout_s",
    )

    def __init__(self, send: Send, limit_bytes: int, timeout_s: float) -> None:
        self._send = send
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self._chunks: list[bytes] = []
        self._size = 0
        self._ready = asyncio.Event()
        self._sending_since: float | None = None  # loop time the send under way began; None between sends
        self._error: BaseException | None = None
        self._end: tuple[Message, Send] | None = None  # the body's last message, once `finish` gave it
        # Hard reference: the loop keeps only weak references to tasks.
        self._task: asyncio.Task[None] | None = None

    def put(self, chunk: bytes) -> None:
        """Queue a body chunk; raises `SlowClient` if the client is past a limit (or the send's own error)."""
        if self._error is not None:
            raise self._error
        self._check_progress()
        self._size += len(chunk)
        if self._size > self.limit_bytes:
            raise SlowClient(f"more than {self.limit_bytes} bytes of the answer wait for the client")
        self._chunks.append(chunk)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write())
        self._ready.set()

    async def finish(self, last: bytes, send_last: Send) -> None:
        """Send everything queued, then `last` as the end of the body through `send_last`; raises `SlowClient` if
        a send makes no progress for `timeout_s`."""
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

    def close(self) -> None:
        """Stop the writer (after `finish`, or when the answer is cut); not awaited, like a disconnect watch."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _check_progress(self) -> None:
        since = self._sending_since
        if since is not None and asyncio.get_running_loop().time() - since > self.timeout_s:
            raise SlowClient(f"a send to the client made no progress for {self.timeout_s:g}s")

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        ready = self._ready
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
                chunks, self._chunks, self._size = self._chunks, [], 0
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._sending_since = loop.time()
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
                self._sending_since = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server's send failed: `put` or `finish` raises it in the response's task
            self._error = exc
