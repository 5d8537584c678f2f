"""Helpers for tests that drive the gateway over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from gateway.server import RunningGateway
from tests.conftest import ADMIN
from tests.sim_helpers import sse_events, wait_for

SHAPE = ModelShape()
PROMPT = [11, 22, 33, 44, 55]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""`/metrics` read by `scrape`: (sample name, sorted labels) → value."""


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


def slow(dialect: str, delay: float = 0.002, **engine: Any) -> tuple[str, EngineSettings]:
    return dialect, EngineSettings(token_delay_s=delay, block_size=16 if dialect == "vllm" else 1, **engine)


@contextlib.asynccontextmanager
async def streams_under_way(
    gw: RunningGateway, prompts: list[list[int]], total: int, session_prefix: str
) -> AsyncIterator[list[asyncio.Task[Streamed]]]:
    """One streamed `/generate` of `total` tokens per prompt (session `session_prefix` + its index), every one in
    flight and past its first token on entry; those still running on exit are cancelled."""
    n = len(prompts)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        progress = [0]
        tasks = [
            asyncio.create_task(
                stream_generate(client, gw.url, generate_body(p, total, session_id=f"{session_prefix}{i}"), progress)
            )
            for i, p in enumerate(prompts)
        ]
        try:
            pool = gw.services.pool
            await wait_for(lambda: sum(r.in_flight for r in pool.all()) == n and progress[0] >= n, what="streams")
            yield tasks
        finally:
            for task in tasks:
                task.cancel()


async def scrape(http: httpx.AsyncClient, url: str) -> Samples:
    """Every sample of `/metrics`, keyed by (sample name, sorted labels)."""
    response = await http.get(f"{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def client(gw: RunningGateway, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", default_headers=headers, max_retries=0)
