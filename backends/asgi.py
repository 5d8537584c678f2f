"""ASGI helpers shared by the gateway's routes and the simulator: noticing that an HTTP client went away.

ASGI reports a disconnect only to a pending `receive()`, so noticing one needs a task that waits there. That task
costs as much as a short request's whole route logic, and almost every request ends long before its client could
leave; so the watcher can start late (`watch_after_s`): a request that ends before then never makes one, and one
that runs longer notices a disconnect at most that much later. The work itself always runs in the caller's task
(timeouts and cancel scopes inside it keep working); the watcher cancels that task when the client is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

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
    """Watches one request for a disconnect, from `watch_after_s` on, and cancels `task` while it `waiting`."""

    def __init__(self, request: Request, on_disconnect: Callable[[], object], watch_after_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.request = request
        self.on_disconnect = on_disconnect
        self.gone = False
        self.waiting = False
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if watch_after_s > 0:
            self._timer = asyncio.get_running_loop().call_later(watch_after_s, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(watch_disconnect(self.request, self._disconnected))

    def _disconnected(self) -> None:
        self.gone = True
        self.on_disconnect()
        if self.waiting:
            self.task.cancel()

    def absorb(self) -> bool:
        """In an `except CancelledError`: True if the cancellation was this watch's (absorbed: the client left)."""
        if not self.gone:
            return False
        self.task.uncancel()
        return True

    def close(self) -> None:
        """Stop watching. Not awaited: a cleanup that waits could itself be cancelled (a disconnect while a stream
        ends) and skip what follows it; a cancelled watcher ends at the loop's next pass, consuming nothing."""
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def unless_disconnected(
    request: Request, awaitable: Awaitable[T], on_disconnect: Callable[[], object], watch_after_s: float = 0.0
) -> T:
    """Await `awaitable`; if the client disconnects first, call `on_disconnect`, cancel the work and raise
    `ClientDisconnected` (answer it with `disconnected_response`: nobody is there to read it). A disconnect is
    noticed from `watch_after_s` after the call on (see the module docstring)."""
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
) -> AsyncIterator[T]:
    """Relay `items` from a streaming response body until the client disconnects.

    A disconnect is noticed even while no item is due (a send-free wait would never see it): the task is
    cancelled if it is waiting on `items` at that moment, the cancellation is absorbed here, and `items` is
    closed, which is how the producer (generation) learns that the caller left. Everything runs in the
    response's own task, so timeouts and cancel scopes inside `items` keep working. A disconnect is noticed from
    `watch_after_s` after the first item was asked for on (see the module docstring).
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
