"""Fixtures of the real-engine tiers: one engine server per tier, gateways over it per test.

The servers are module-scoped: each tier is one module, so each server starts once per test run, and it is
stopped when its tier ends, before the other tier starts (never two engines at once on a small machine)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from tests.conftest import GatewayFactory
from tests.engines.servers import EngineServer, engine_server


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    # LoRA on: the tier's LoRA checks share it (tests/engines/lora_checks.py); the base model serves as without.
    with engine_server("vllm", tmp_path_factory.mktemp("vllm"), max_loras=4) as server:
        yield server


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server("sglang", tmp_path_factory.mktemp("sglang")) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """A client without keep-alive: a busy engine server drops idle connections, and a request written onto one
    just as it closes fails with "Server disconnected" (httpx does not retry it)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        yield client


async def gateway_over(
    make_gateway: GatewayFactory, server: EngineServer, weights: dict[str, Any] | None = None, **replica: object
) -> RunningGateway:
    """A gateway in front of the real engine only (its tokenizer is the model's own); `weights`: its `weights:`
    section."""
    config = ReplicaConfig(url=server.url, backend=server.kind, **replica)  # type: ignore[arg-type]
    return await make_gateway(
        [config],
        model={"tokenizer": str(server.model_path), "max_model_len": 4096},
        generation={"request_timeout_s": 300},
        weights=weights or {},
    )
