"""The trainer's side of a transfer over a process group (vLLM `/update_weights`, `gloo` or `nccl`): for each engine
of the gateway's layout the trainer is rank 0 of a group of its own, and for each chunk of tensors it posts the
engine's `/update_weights` with their names, dtypes and shapes while it broadcasts them in that order. The engine
loads them by their checkpoint names. The gateway pauses, opens and finishes the update around it (`POST
/admin/weights` with a `transfer`, then `/admin/weights/{version}/commit`). The groups: `trainers.gloo_transfer`
(vLLM's CPU build with the project's plugin, torch alone), `trainers.nccl_transfer` (GPUs, vLLM's own helper).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class TensorGroup(Protocol):
    """Rank 0 of one engine's group: formed when constructed (blocking until the engine joined), kept across
    updates."""

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send `tensors` from rank 0, one after another (the engine receives them in the same order)."""
        ...

    def close(self) -> None: ...


def update_info(named: NamedTensors) -> dict[str, list[Any]]:
    """The `/update_weights` description of a chunk: names, torch dtype names, shapes, in broadcast order."""
    return {
        "names": [name for name, _ in named],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }


async def push(http: httpx.AsyncClient, engine_url: str, group: TensorGroup, named: NamedTensors) -> None:
    """One chunk into one engine: its `/update_weights` call, answered once the broadcast is received and loaded."""
    call = asyncio.ensure_future(http.post(f"{engine_url}/update_weights", json={"update_info": update_info(named)}))
    try:
        await asyncio.to_thread(group.broadcast, [tensor for _, tensor in named])
    except BaseException:
        call.cancel()
        raise
    answer = await call
    if answer.status_code != 200:
        raise RuntimeError(f"{engine_url}/update_weights answered {answer.status_code}: {answer.text[:300]}")
