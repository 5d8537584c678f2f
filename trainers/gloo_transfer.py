"""The trainer's side of a `gloo` weight transfer (vLLM's CPU build with the project's plugin): torch alone.

For each engine of the gateway's transfer layout the trainer is rank 0 of a process group of its own: it hosts the
rendezvous (a `TCPStore` at the layout's `master_address:master_port`, the group over `PrefixStore("tcp://host:port",
store)`, as vLLM's stateless helper forms it on the engine's side) and, for each chunk of tensors, posts the
engine's `/update_weights` with their names, dtypes and shapes while it broadcasts them in that order. The engine
loads them by their checkpoint names. The gateway pauses, opens and finishes the update around it
(`POST /admin/weights` with a `transfer`, then `/admin/weights/{version}/commit`).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Sequence
from typing import Any

import httpx
import torch
import torch.distributed as dist

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class GlooGroup:
    """Rank 0 of one engine's group. Forming it blocks until every rank joined (the engine joins when the gateway
    opens its side): form it in a thread while the gateway does."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float = 300.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        # TCPStore and PrefixStore are torch.distributed's documented stores; its stubs do not re-export them.
        # Listening at once; forming the group below is what waits for the engine's workers to join.
        self._store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(f"tcp://{address}:{port}", self._store)  # type: ignore[attr-defined]
        self._group: Any = dist.ProcessGroupGloo(prefixed, 0, world_size, timeout)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send `tensors` from rank 0, one after another (the engine receives them in the same order)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self._group.broadcast([tensor.detach().contiguous()], options).wait()

    def close(self) -> None:
        """Let the group and its store go, freeing the rendezvous port for a group formed again there (the engine's
        side is let go by its next rendezvous or its shutdown)."""
        self._group = self._store = None


def update_info(named: NamedTensors) -> dict[str, list[Any]]:
    """The `/update_weights` description of a chunk: names, torch dtype names, shapes, in broadcast order."""
    return {
        "names": [name for name, _ in named],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }


async def push(http: httpx.AsyncClient, engine_url: str, group: GlooGroup, named: NamedTensors) -> None:
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
