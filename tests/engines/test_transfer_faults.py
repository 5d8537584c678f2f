"""An engine killed in the middle of an in-memory weight transfer (issue 53), on each real engine.

The tiers' shared servers must live on, so this module starts a server of its own per engine (one at a time: a
tier's shared server is stopped when its module ends, and this one when its test ends), kills its whole process
group with SIGKILL mid-transfer, and starts it again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from backends.launcher import free_port
from gateway.weights import version_label
from tests.conftest import ADMIN, GatewayFactory
from tests.engines.checks import admin, transfer_backend
from tests.engines.conftest import gateway_over
from tests.engines.direct import greedy, load_from_disk, prompt_of, restore
from tests.engines.servers import EngineServer, engine_server
from tests.gateway_helpers import generate_body
from tests.sim_helpers import wait_for
from trainers.publish import TransferPublisher

pytestmark = pytest.mark.timeout(900)

KINDS = [pytest.param("sglang", marks=pytest.mark.sglang), pytest.param("vllm", marks=pytest.mark.vllm)]


async def started(stack: contextlib.ExitStack, kind: str, folder: Path, port: int) -> EngineServer:
    """A server of this test's own (started in a thread: a minute of startup must not stall the event loop)."""
    server: EngineServer = await asyncio.to_thread(stack.enter_context, engine_server(kind, folder, port))  # type: ignore[arg-type]
    if server.process_group is None:
        pytest.skip("an external server (RG_<KIND>_URL) cannot be killed and restarted here")
    return server


@pytest.mark.parametrize("kind", KINDS)
async def test_an_engine_killed_mid_transfer_fails_the_commit_and_serves_again_from_the_last_path(
    kind: str, tmp_path: Path, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """One engine: a path update to the second checkpoint (version 1), then a transfer of the first, the engine
    killed once half its tensors landed. The commit is a 502 (no engine finished it) and version 1 stands, the
    engine held out. Started again on the same port (its initial weights, the label "default"), it is caught up
    from version 1's path before it serves: exactly the second checkpoint, under label 1."""
    port, stack = free_port(), contextlib.ExitStack()
    try:
        server = await started(stack, kind, tmp_path / "first", port)
        prompt, n = prompt_of(40, seed=7), 12
        await load_from_disk(http, server, server.second_checkpoint)
        second = await greedy(http, server, prompt, n)
        await restore(http, server)
        backend = transfer_backend(server)
        replica = {"new_requests_while_paused": "block"}
        if kind == "vllm":
            replica |= {"scale_out": True, "weight_transfer": backend}
        gw = await gateway_over(make_gateway, server, None, **replica)
        await admin(http, gw, "weights", {"version": 1, "path": server.second_checkpoint, "mode": "abort"})
        tensors = list(load_file(str(server.model_path / "model.safetensors")).items())
        async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN, timeout=300.0) as trainer:
            publisher = TransferPublisher(trainer, "abort", backend)  # type: ignore[arg-type]
            try:
                [url] = await publisher.begin(2)
                await publisher.push(url, tensors[: len(tensors) // 2])
                assert server.process_group is not None
                os.killpg(server.process_group, signal.SIGKILL)
                with pytest.raises(RuntimeError, match="failed: 502"):
                    await publisher.commit(2)
            finally:
                await publisher.aclose()
        status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
        assert (status["version"], status["state"]) == (1, "serving")
        [replica_status] = status["replicas"]
        assert replica_status["stale"] or not replica_status["healthy"], replica_status

        await asyncio.to_thread(stack.close)  # reaps the killed group
        server = await started(stack, kind, tmp_path / "again", port)

        async def caught_up() -> bool:
            [again] = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()["replicas"]
            return bool(again["healthy"] and not again["stale"] and again["version"] == 1)

        await wait_for(caught_up, timeout=120.0, what="the restarted engine caught up from version 1's path")
        label = "weight_info" if kind == "vllm" else "model_info"
        assert (await http.get(f"{server.url}/{label}")).json()["weight_version"] == version_label(1)
        reloaded = await greedy(http, server, prompt, n)
        assert reloaded[0] == second[0] and reloaded[1] == pytest.approx(second[1], abs=1e-5)
        served = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 4, session_id="after"), timeout=120)
        assert served.status_code == 200 and served.json()["versions"] == [1] * 4, served.text
        await gw.stop()
    finally:
        await asyncio.to_thread(stack.close)
