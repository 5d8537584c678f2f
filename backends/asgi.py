"""ASGI helpers shared by the gateway's routes and the simulator: noticing that an HTTP client went away."""

from __future__ import annotations

import asyncio
import contextlib
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


async def unless_disconnected(request: Request, awaitable: Awaitable[T], on_disconnect: Callable[[], object]) -> T:
    """Await `awaitable`; if the client disconnects first, call `on_disconnect`, cancel the work and raise
    `ClientDisconnected` (answer it with `disconnected_response`: nobody is there to read it)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(watch_disconnect(request, on_disconnect))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientDisconnected("client disconnected")
        return work.result()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def relay_until_disconnected(request: Request, items: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    """Relay `items` from a streaming response body until the client disconnects.

    A disconnect is noticed even while no item is due (a send-free wait would never see it): the task is
    cancelled if it is waiting on `items` at that moment, the cancellation is absorbed here, and `items` is
    closed, which is how the producer (generation) learns that the caller left. Everything runs in the
    response's own task, so timeouts and cancel scopes inside `items` keep working.
    """
    task = asyncio.current_task()
    assert task is not None
    state = {"waiting": False, "gone": False}

    def on_disconnect() -> None:
        state["gone"] = True
        if state["waiting"]:
            task.cancel()

    watcher = asyncio.create_task(watch_disconnect(request, on_disconnect))
    try:
        while not state["gone"]:
            state["waiting"] = True
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not state["gone"]:
                    raise
                task.uncancel()
                return
            finally:
                state["waiting"] = False
            yield item
    finally:
        watcher.cancel()
        await items.aclose()


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request the client abandoned


async def disconnected_response(_: Request, exc: Exception) -> Response:
    """Exception handler for `ClientDisconnected`."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)
