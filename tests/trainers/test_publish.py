"""The reference trainer's weight publishers (`trainers.publish`): what a transfer sends is what a checkpoint holds,
and the inline-tensor transfer through the gateway's two-phase update over simulator replicas (real gateway, Redis,
HTTP). The gloo transfer needs a real group on the engine's side: it is checked on vLLM's CPU build
(tests/engines: `test_an_in_memory_transfer_serves_what_a_disk_load_of_the_same_checkpoint_serves`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.mismatch import build_model
from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, expected_tokens, generate_body
from trainers.grpo import GRPOConfig, Learner
from trainers.nccl_transfer import NcclGroup
from trainers.publish import TransferPublisher, chunked


def identity(name: str) -> list[tuple[str, torch.Tensor]]:
    """The simulated model's one parameter set to the weights `name` (its identity's bytes)."""
    return [("weights", torch.tensor(list(name.encode()), dtype=torch.uint8))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_transfer_sends_exactly_what_a_checkpoint_holds(tmp_path: Path, dtype: str) -> None:
    learner = Learner(build_model(tmp_path / "models", "float32"), GRPOConfig(dtype=dtype, threads=1))  # type: ignore[arg-type]
    named = learner.named_weights()
    with torch.no_grad():
        learner.model.lm_head.weight.add_(1.0)  # after the copy: what was sent is what the weights were then
    saved = load_file(learner.save(tmp_path, 1) / "model.safetensors")
    sent = dict(named)
    assert len(sent) == len(named) and sent.keys() == saved.keys()
    for name, tensor in saved.items():
        assert sent[name].dtype == tensor.dtype
        assert torch.equal(sent[name], tensor) is (name != "lm_head.weight"), name


def test_chunks_keep_the_order_and_stay_under_the_limit() -> None:
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([3, 4, 10, 1, 2])]
    chunks = list(chunked(named, 5))
    assert [[name for name, _ in chunk] for chunk in chunks] == [["t0"], ["t1"], ["t2"], ["t3", "t4"]]
    assert list(chunked([], 5)) == []


async def test_an_inline_transfer_through_the_gateway_serves_the_pushed_weights(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Over two SGLang replicas the publisher picks `tensor` (what every engine takes), pushes each its tensors and
    commits; both then sample exactly as a load of those weights would, under the new version."""
    sims = [await make_sim("sglang"), await make_sim("sglang")]
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="sglang") for sim in sims])
    async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN, timeout=30.0) as trainer:
        publisher = TransferPublisher(trainer, "abort")
        try:
            first = await publisher.transfer(1, identity("ckpt-1"))
            second = await publisher.transfer(2, identity("ckpt-2"))
        finally:
            await publisher.aclose()
    assert publisher.backend == "tensor"
    assert (first["status"], second["status"]) == ("updated", "updated")
    assert sorted(second["updated"]) == sorted(sim.url.removeprefix("http://") for sim in sims)
    for i in range(4):
        answer = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 6, session_id=f"s{i}"))).json()
        assert answer["versions"] == [2] * 6
        assert answer["output_ids"] == expected_tokens(PROMPT, [2] * 6, 6)


async def test_inline_tensors_have_no_manifest_to_fan_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The gateway fans out the receiving calls of a group transfer only; asked for an inline one, the publisher
    says so before anything starts."""
    gw = await make_gateway([await make_sim("sglang")])
    async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN, timeout=30.0) as trainer:
        publisher = TransferPublisher(trainer, "abort", "tensor", fan_out=True)
        with pytest.raises(RuntimeError, match="has no manifest"):
            await publisher.transfer(1, identity("ckpt-1"))
        await publisher.aclose()
    assert (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()["state"] == "serving"


async def test_a_fleet_with_no_transfer_the_trainer_can_push_is_told_so(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    sim = await make_sim("vllm")  # no --weight-transfer-config: it takes no in-memory transfer
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")])
    async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN, timeout=30.0) as trainer:
        publisher = TransferPublisher(trainer, "abort")
        with pytest.raises(RuntimeError, match="no in-memory transfer the trainer can push"):
            await publisher.transfer(1, identity("ckpt-1"))
        await publisher.aclose()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (a GPU recipe)")
def test_an_nccl_group_says_what_it_needs_where_vllm_is_missing() -> None:
    """The nccl group is vLLM's own helper: without vLLM the trainer is told so before anything is sent."""
    with pytest.raises(RuntimeError, match="needs vLLM in the trainer's environment"):
        NcclGroup("127.0.0.1", 1, 2)
