"""How the store sends its short, non-transactional pipelines: `Pipelines`, and the plain way, one pipeline per caller
(`OwnPipelines`). The fast path's batcher (`gateway.fastpath`) sends concurrent callers' pipelines as one instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

__all__ = ["Build", "OwnPipelines", "Pipelines"]

Build = Callable[[Pipeline], None]
"""Queues one caller's commands on a pipeline (and does nothing else: it may run in another caller's task)."""


class Pipelines(Protocol):
    """Runs a caller's commands as one pipeline; `pipelines` and `calls` count what was sent (their ratio: callers
    per pipeline)."""

    pipelines: int
    calls: int

    async def execute(self, build: Build) -> list[Any]:
        """The replies to the commands `build` queues, in order; a command's error is its reply (an exception
        object), a transport failure raises."""
        ...

    async def aclose(self) -> None: ...


class OwnPipelines:
    """Each caller's commands in a pipeline of its own: redis-py's `Pipeline.execute(raise_on_error=False)`."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self.pipelines = 0
        self.calls = 0

    async def execute(self, build: Build) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            build(pipe)
            self.pipelines += 1
            self.calls += 1
            return await pipe.execute(raise_on_error=False)

    async def aclose(self) -> None:
        return None
