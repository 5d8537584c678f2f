"""Helpers for tests that drive simulator replicas over real HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson

from backends.generation_transport import TransportFactory
from gateway.config import Settings
from gateway.services import generation_transport


async def wait_for(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition on a real server (bounded); fail with `what` if it never holds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.005)


async def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    """Decode `data: {json}` events until `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield orjson.loads(data)


async def sim_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/sim/state")
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def gateway_transport() -> TransportFactory | None:
    """The generation transport the gateway gives its replicas in this test run: the fast path's pool, or aiohttp's
    (None) where `RG_FASTPATH__ENABLED=false` turns the fast path off."""
    return generation_transport(Settings().fastpath)
