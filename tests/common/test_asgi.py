"""Noticing a client's disconnect (`common.asgi`), driven through the ASGI receive channel itself."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from starlette.requests import Request

from common.asgi import ClientDisconnected, relay_until_disconnected, unless_disconnected


class Channel:
    """An ASGI `receive` whose client leaves when told to; counts the calls (each one is a watcher waiting)."""

    def __init__(self) -> None:
        self.calls = 0
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        await self.left.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, self.receive)


async def test_a_request_that_ends_before_the_watch_starts_never_waits_on_receive() -> None:
    channel = Channel()

    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await unless_disconnected(channel.request(), quick(), lambda: None, watch_after_s=0.5) == "done"
    await asyncio.sleep(0.6)  # past the start the watch would have had
    assert channel.calls == 0


async def test_a_finished_request_is_not_kept_alive_until_its_watch_would_have_started() -> None:
    channel = Channel()
    request = channel.request()
    gone = weakref.ref(request)

    async def quick() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await unless_disconnected(request, quick(), lambda: None, watch_after_s=30) == "done"
    del request
    assert gone() is None  # freed now by reference counting, not when the queued late start comes due in 30 s


async def test_a_late_watch_still_cancels_work_whose_client_left() -> None:
    channel = Channel()
    noticed: list[bool] = []
    cancelled = asyncio.Event()

    async def endless() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    channel.left.set()  # gone before the watch starts: noticed once it does
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(
            unless_disconnected(channel.request(), endless(), lambda: noticed.append(True), watch_after_s=0.05), 5
        )
    assert noticed == [True] and cancelled.is_set() and channel.calls == 1


async def test_a_cancellation_from_elsewhere_is_not_taken_for_a_disconnect() -> None:
    channel = Channel()
    started = asyncio.Event()

    async def endless() -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(unless_disconnected(channel.request(), endless(), lambda: None, watch_after_s=0))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert channel.calls == 1


async def test_a_relay_stops_and_closes_its_source_when_the_client_leaves_mid_stream() -> None:
    channel = Channel()
    closed = asyncio.Event()

    async def items() -> AsyncGenerator[int, None]:
        try:
            yield 1
            await asyncio.sleep(60)  # the next item never comes: only the watch can end the relay
            yield 2
        finally:
            closed.set()

    got = []
    relay = relay_until_disconnected(channel.request(), items(), watch_after_s=0.05)
    async for item in relay:
        got.append(item)
        channel.left.set()
    assert got == [1] and closed.is_set()


async def test_late_watches_made_apart_each_start_after_their_own_delay() -> None:
    """One timer starts every late watch of the loop: each no sooner than its own delay (nor much later), and one
    whose request ended before then never."""
    delay = 0.2
    loop = asyncio.get_running_loop()
    channels = [Channel() for _ in range(3)]
    made: list[float] = []
    release = asyncio.Event()

    async def watched(channel: Channel) -> None:
        made.append(loop.time())
        await unless_disconnected(channel.request(), release.wait(), lambda: None, watch_after_s=delay)

    quick = Channel()
    tasks = []
    for channel in channels:
        tasks.append(asyncio.create_task(watched(channel)))
        await unless_disconnected(quick.request(), asyncio.sleep(0.01), lambda: None, watch_after_s=delay)
        await asyncio.sleep(0.06)
    started: dict[int, float] = {}
    while len(started) < len(channels) and loop.time() < made[0] + 5:
        for index, channel in enumerate(channels):
            if channel.calls and index not in started:
                started[index] = loop.time()
        await asyncio.sleep(0.002)
    release.set()
    await asyncio.gather(*tasks)
    assert sorted(started) == [0, 1, 2]
    for index, at in started.items():
        assert delay <= at - made[index] < delay * 1.25 + 0.25  # a quarter of the delay late at most, plus a busy CI
    assert quick.calls == 0
