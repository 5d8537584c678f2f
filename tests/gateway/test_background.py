"""Background tasks stop for sure, even one that lost its cancellation (a CI shutdown once waited for good)."""

from __future__ import annotations

import asyncio

from gateway.background import background, stop


async def _loop_that_loses_one_cancellation(rounds: list[int]) -> None:
    """A loop that survives errors, as the gateway's periodic loops do; its first cancellation is swallowed, as
    Python 3.11's `asyncio.timeout` swallows one arriving as its deadline passes."""
    lost = False
    while True:
        rounds.append(1)
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True
            asyncio.current_task().uncancel()  # type: ignore[union-attr]


async def test_stop_ends_a_task_that_swallowed_its_cancellation() -> None:
    rounds: list[int] = []
    task = background(_loop_that_loses_one_cancellation(rounds), "lossy-loop")
    await asyncio.sleep(0.05)
    async with asyncio.timeout(10):
        await stop(task)
    assert task.cancelled()
    # It ran on after the first cancellation, so one cancel would have left `await task` waiting for good.
    ran = len(rounds)
    await asyncio.sleep(0.05)
    assert len(rounds) == ran


async def test_stop_takes_none_done_and_crashed_tasks() -> None:
    async def crash() -> None:
        raise RuntimeError("boom")

    crashed = background(crash(), "crash")
    finished = background(asyncio.sleep(0), "finished")
    await asyncio.wait([crashed, finished])
    async with asyncio.timeout(5):
        await stop(None, crashed, finished)
    assert isinstance(crashed.exception(), RuntimeError)


async def test_a_cancelled_caller_of_stop_is_cancelled_too() -> None:
    stubborn_now = True

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not stubborn_now:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]

    task = background(stubborn(), "stubborn")
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop(task))
    await asyncio.sleep(0.1)
    stopper.cancel()
    async with asyncio.timeout(5):
        await asyncio.wait([stopper])
    assert stopper.cancelled()
    assert not task.done()
    stubborn_now = False
    async with asyncio.timeout(5):
        await stop(task)
    assert task.cancelled()
