"""Graceful shutdown of a real `rollout-gateway serve` process: SIGTERM mid-generation, then a new process.

Within `server.shutdown_timeout_s` an in-flight generation finishes and the agent gets all of it; past it the
generation is cut and its tokens so far are checkpointed to Redis. Either way the session lives in Redis and
the next process continues it with the exact tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from backends.sim.server import SimProcess
from gateway.store import Keys, TrajectoryStore
from tests.cli_helpers import free_port, serving, wait_for_health
from tests.sim_helpers import sse_events

ADMIN_TOKEN = "shutdown-admin-token"


@contextlib.contextmanager
def serve(config: Path, port: int) -> Iterator[tuple[subprocess.Popen[str], str]]:
    with serving("--config", str(config)) as process:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(process, url, timeout_s=120)  # a loaded 2-core CI machine starts python slowly
        yield process, url


def write_config(tmp_path: Path, port: int, redis_url: str, sim: SimProcess, shutdown_timeout_s: float) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(
        f'server:\n  port: {port}\n  admin_token: "{ADMIN_TOKEN}"\n  shutdown_timeout_s: {shutdown_timeout_s}\n'
        f'redis:\n  url: "{redis_url}"\n'
        f'replicas:\n  - url: "{sim.url}"\n    backend: sim\n    dialect: vllm\n'
    )
    return config


def chat(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def stream_until(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    on_tokens: int = -1,
    process: subprocess.Popen[str] | None = None,
) -> tuple[str, dict[str, Any] | None, bool]:
    """Stream a chat turn, SIGTERM `process` once `on_tokens` content deltas arrived (if given); return (text,
    the final rollout record or None, whether [DONE] came)."""
    text, rollout, deltas = "", None, 0
    headers = {"x-session-id": "survivor"}
    with contextlib.suppress(httpx.RemoteProtocolError, httpx.ReadError):
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for event in sse_events(response):
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    deltas += bool(choice["delta"].get("content"))
                if "rollout" in event:
                    rollout = event["rollout"]
                if deltas == on_tokens and process is not None:
                    process.send_signal(signal.SIGTERM)
            return text, rollout, True
    return text, rollout, False


async def stopped(process: subprocess.Popen[str]) -> str:
    assert await asyncio.to_thread(process.wait, 60) in (0, -signal.SIGTERM)
    return process.stderr.read() if process.stderr else ""


@pytest.mark.timeout(400)
async def test_sigterm_lets_the_generation_finish_and_the_next_process_continues(
    tmp_path: Path, redis: Redis, redis_server: Any
) -> None:
    with SimProcess(["--token-delay", "0.01"]) as sim:
        port = free_port()
        config = write_config(tmp_path, port, redis_server.url, sim, shutdown_timeout_s=60)
        user = [{"role": "user", "content": "count"}]
        async with httpx.AsyncClient(timeout=60) as client:
            with serve(config, port) as (process, url):
                text, rollout, done = await stream_until(client, url, chat(user, 200), 10, process)
                stderr = await stopped(process)
            assert done and rollout is not None, stderr
            first = rollout["choices"][0]["output_ids"]
            assert len(first) == 200  # all of it, although SIGTERM came after 10
            assert "Application shutdown complete" in stderr and "Cancel" not in stderr
            assert ADMIN_TOKEN not in stderr
            with serve(config, port) as (_, url):  # a new process, the same Redis
                follow = [*user, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
                text2, rollout2, done2 = await stream_until(client, url, chat(follow, 7))
            assert done2 and rollout2 is not None
            choice = rollout2["choices"][0]
            assert choice["sample_index"] == 0 and not choice["new_sample"]  # the same sample, continued
    samples = await TrajectoryStore(redis, Keys(), sweep_interval_s=None).load_samples("survivor")
    assert len(samples) == 1 and samples[0].num_turns == 2
    response = samples[0].response_ids.tolist()
    mask = samples[0].loss_mask.tolist()
    assert response[:200] == first and mask[:200] == [1] * 200  # turn 1's exact tokens, from Redis
    assert response[-7:] == choice["output_ids"] and sum(mask) == 207


@pytest.mark.timeout(400)
async def test_sigterm_past_the_bound_checkpoints_the_generation(
    tmp_path: Path, redis: Redis, redis_server: Any
) -> None:
    with SimProcess(["--token-delay", "0.01"]) as sim:
        port = free_port()
        config = write_config(tmp_path, port, redis_server.url, sim, shutdown_timeout_s=1)
        user = [{"role": "user", "content": "count"}]
        async with httpx.AsyncClient(timeout=60) as client:
            with serve(config, port) as (process, url):
                _, rollout, done = await stream_until(client, url, chat(user, 3000), 10, process)
                stderr = await stopped(process)
            assert not done and rollout is None  # cut: 3000 tokens take 30 s, the bound is 1 s
            assert "timeout graceful shutdown exceeded" in stderr and "Application shutdown complete" in stderr
            store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
            [checkpoint] = await store.load_samples("survivor")
            cut = int(checkpoint.loss_mask.sum())
            assert checkpoint.cancelled and 10 <= cut < 3000  # the tokens generated before the cut, kept
            with serve(config, port) as (_, url):  # the agent retries its turn on a new process
                _, rollout2, done2 = await stream_until(client, url, chat(user, 5))
            assert done2 and rollout2 is not None
            assert rollout2["choices"][0]["sample_index"] == 1  # the cut turn never reached the agent
    samples = await store.load_samples("survivor")
    assert [int(s.loss_mask.sum()) for s in samples] == [cut, 5]
    assert samples[1].response_ids.tolist() == rollout2["choices"][0]["output_ids"]
    assert samples[0].response_ids.tolist()[:5] == samples[1].response_ids.tolist()  # same prompt, same tokens
