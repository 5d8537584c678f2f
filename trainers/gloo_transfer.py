"""The trainer's group of a `gloo` weight transfer (vLLM's CPU build with the project's plugin): torch alone.

The trainer hosts the rendezvous (a `TCPStore` at the layout's `master_address:master_port`, the group over
`PrefixStore("tcp://host:port", store)`, as vLLM's stateless helper forms it on the engine's side). What goes over
it, and when: `trainers.group_transfer`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


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
