"""ASGI helpers shared by the gateway's routes and the simulator: noticing that an HTTP client went away.

ASGI reports a disconnect only to a pending `receive()`, so noticing one needs a task that waits there. That task
costs as much as a short request's whole route logic, and almost every request ends long before its client could
leave; so the watcher can start late (`watch_after_s`, by one timer for every request of the loop): a request that
ends before then never makes one, and one that runs longer notices a disconnect at most 1.25 times that much later.
The work itself always runs in the caller's task (timeouts and cancel scopes inside it keep working); the watcher
cancels that task when the client is gone.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from common.loop_local import loop_local

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the answer was ready."""


async def watch_disconnect(request: Request, on_disconnect: Callable[[], object]) -> None:
    """Call `on_disconnect` when the client goes away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class _DisconnectWatch:
    """Watches one request for a disconnect (from `watch_after_s` on), and cancels `task` while it `waiting`."""

    __slots__ = ("_watcher", "gone", "on_disconnect", "request", "task", "waiting")

    def __init__(self, request: Request, on_disconnect: Callable[[], object], watch_after_s: float) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task: asyncio.Task[object] | None = task
        self.request: Request | None = request
        self.on_disconnect: Callable[[], object] | None = on_disconnect
        self.gone = False
        self.waiting = False
        self._watcher: asyncio.Task[None] | None = None
        if watch_after_s > 0:
            loop_local(_LateStarts, watch_after_s, loop).add(self)
        else:
            self.start()

    def start(self) -> None:
        if self.request is not None:  # not closed
            self._watcher = asyncio.get_running_loop().create_task(watch_disconnect(self.request, self._disconnected))

    def _disconnected(self) -> None:
        if self.task is None or self.on_disconnect is None:
            return  # closed meanwhile
        self.gone = True
        self.on_disconnect()
        if self.waiting:
            self.task.cancel()

    def absorb(self) -> bool:
        """In an `except CancelledError`: True if the cancellation was this watch's (absorbed: the client left)."""
        if not self.gone or self.task is None:
            return False
        self.task.uncancel()
        return True

    def close(self) -> None:
        """Stop watching. Not awaited: a cleanup that waits could itself be cancelled (a disconnect while a stream
        ends) and skip what follows it; a cancelled watcher ends at the loop's next pass, consuming nothing.

        The watch lets go of the request, its task and the callback: a watch waiting for its late start (most of
        them, closed long before it) would otherwise keep the whole request (scope, server cycle, frames) alive
        until then."""
        self.request = self.task = self.on_disconnect = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


class _LateStarts:
    """Starts the watches of one event loop that wait `delay` before watching, on one timer for all: a watch costs
    an append to a queue, where a timer of its own would be created and cancelled per request (with uvloop, a libuv
    timer handle each). The timer fires at the oldest watch's start and then at most every quarter of `delay`, so
    a watch starts at most that much late; one closed meanwhile (most requests) is dropped unstarted."""

    def __init__(self, delay: float) -> None:
        self.loop = asyncio.get_running_loop()  # made per loop (`loop_local`)
        self.delay = delay
        self.queue: collections.deque[tuple[float, _DisconnectWatch]] = collections.deque()
        self.armed = False

    def add(self, watch: _DisconnectWatch) -> None:
        due = self.loop.time() + self.delay
        self.queue.append((due, watch))
        if not self.armed:
            self.armed = True
            self.loop.call_at(due, self._sweep)

    def _sweep(self) -> None:
        loop = self.loop
        now = loop.time()
        queue = self.queue
        while queue and queue[0][0] <= now:
            watch = queue.popleft()[1]
            if watch.request is not None:  # most were closed long before: nothing to start
                watch.start()
        if queue:
            loop.call_at(max(queue[0][0], now + self.delay / 4), self._sweep)
        else:
            self.armed = False


async def unless_disconnected(
    request: Request, awaitable: Awaitable[T], on_disconnect: Callable[[], object], watch_after_s: float = 0.0
) -> T:
    """Await `awaitable`; if the client disconnects first, call `on_disconnect`, cancel the work and raise
    `ClientDisconnected` (answer it with `disconnected_response`: nobody is there to read it). A disconnect is
    noticed at once where the request's server gives a notice, else from `watch_after_s` after the call on (see the
    module docstring)."""
    watch = _DisconnectWatch(request, on_disconnect, watch_after_s)
    try:
        watch.waiting = True
        return await awaitable
    except asyncio.CancelledError:
        if not watch.absorb():
            raise
        raise ClientDisconnected("client disconnected") from None
    finally:
        watch.waiting = False
        watch.close()


async def relay_until_disconnected(
    request: Request, items: AsyncGenerator[T, None], watch_after_s: float = 0.0
) -> AsyncGenerator[T, None]:
    """Relay `items` from a streaming response body until the client disconnects.

    A disconnect is noticed even while no item is due (a send-free wait would never see it): the task is
    cancelled if it is waiting on `items` at that moment, the cancellation is absorbed here, and `items` is
    closed, which is how the producer (generation) learns that the caller left. Everything runs in the
    response's own task, so timeouts and cancel scopes inside `items` keep working. A disconnect is noticed at once
    where the request's server gives a notice, else from `watch_after_s` after the first item was asked for on (see
    the module docstring).
    """
    watch = _DisconnectWatch(request, lambda: None, watch_after_s)
    try:
        while not watch.gone:
            watch.waiting = True
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                return
            finally:
                watch.waiting = False
            yield item
    finally:
        watch.close()
        await items.aclose()


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request the client abandoned


async def disconnected_response(_: Request, exc: Exception) -> Response:
    """Exception handler for `ClientDisconnected`."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)
