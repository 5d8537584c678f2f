"""Long-lived background tasks: started with a logged crash, stopped for sure.

A cancellation can be lost: Python 3.11's `asyncio.timeout` and `TaskGroup` each have a case that swallows one, and
a loop that survives errors then runs on. A shutdown that cancelled a loop once and awaited it waited for good (seen
in CI, with the dashboard's sampler). `stop` cancels again until the task is done."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["background", "stop"]

logger = logging.getLogger(__name__)

_RECANCEL_S = 0.5  # how long a cancelled task gets before it is cancelled again


def background(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A background task whose crash is logged. The caller keeps the reference: the event loop keeps weak ones."""
    task: asyncio.Task[None] = asyncio.ensure_future(coro)
    task.set_name(name)
    task.add_done_callback(_log_crash)
    return task


async def stop(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks and wait until each has ended, cancelling again any that swallowed its cancellation.

    Unlike `await task`, a cancellation of the caller itself still propagates."""
    pending = {task for task in tasks if task is not None and not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
        for task in pending:
            logger.warning("background task %s outlived its cancellation: cancelling it again", task.get_name())


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("background task %s crashed", task.get_name(), exc_info=exc)
