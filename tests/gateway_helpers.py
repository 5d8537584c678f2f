"""Helpers for tests that drive the gateway over real HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from tests.conftest import ADMIN
from tests.sim_helpers import sse_events

SHAPE = ModelShape()


def weights_of(version: int) -> tuple[str, str]:
    """The simulator's (weights identity, label) after the gateway published `version` from path `ckpt-<v>`."""
    return ("init", "default") if version == 0 else (f"ckpt-{version}", str(version))


def generate_body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra.pop("sampling", {})
    return {"input_ids": prompt, "sampling_params": sampling} | extra


@dataclass
class Streamed:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None


async def stream_generate(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], progress: list[int] | None = None
) -> Streamed:
    out = Streamed()
    async with client.stream("POST", f"{url}/generate", json=body | {"stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for event in sse_events(response):
            if "error" in event:
                out.error = event["error"]
            elif "finish_reason" in event:
                out.final = event
            else:
                out.output_ids.extend(event["output_ids"])
                out.logprobs.extend(event["logprobs"])
                if progress is not None:
                    progress[0] += len(event["output_ids"])
    return out


def expected_tokens(prompt: list[int], versions: list[int], max_tokens: int) -> list[int]:
    return reference_tokens(SHAPE, prompt, [weights_of(v) for v in versions], max_tokens, ignore_eos=True)


async def publish(client: httpx.AsyncClient, url: str, version: int, mode: str = "abort") -> httpx.Response:
    body = {"version": version, "path": weights_of(version)[0], "mode": mode}
    return await client.post(f"{url}/admin/weights", json=body, headers=ADMIN)


async def until_a_request_is_in(server: uvicorn.Server, path: str) -> None:
    """Wait (5 s at most) until one of `server`'s connections holds an unanswered request for `path`: its head (and
    whatever came with it) has been read."""
    for _ in range(500):
        for protocol in server.server_state.connections:
            cycle = getattr(protocol, "cycle", None)
            if cycle is not None and not cycle.response_complete and cycle.scope.get("path") == path:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request for {path} reached the server")
