"""The trainer's group of an `nccl` weight transfer into vLLM on GPUs (`--weight-transfer-config '{"backend":
"nccl"}'`): vLLM's own trainer-side helper (`vllm.distributed.weight_transfer.nccl_common.trainer_init`, a
`StatelessProcessGroup` rendezvous the trainer hosts, then an NCCL communicator on the current CUDA device), so the
trainer's environment needs vLLM and a GPU; the engine side receives unpacked broadcasts (the default of the init
info the gateway sends). What goes over it, and when: `trainers.group_transfer`.

Untested by the project: no GPU in CI or on its machines. `scripts/gpu_check.sh` runs the vLLM tier's transfer
checks over it where a GPU is lent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class NcclGroup:
    """Rank 0 of one vLLM engine's NCCL group. Forming it blocks until every rank joined (the engine joins when the
    gateway opens its side): form it in a thread while the gateway does. `timeout_s` is vLLM's own store timeout
    (300 s), not settable from here."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float = 300.0) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        except ImportError as exc:
            raise RuntimeError("an nccl weight transfer needs vLLM in the trainer's environment (and a GPU)") from exc
        self._comm: Any = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send `tensors` from rank 0 on the current CUDA stream, one after another, and wait until they are sent."""
        stream = torch.cuda.current_stream()
        sent = []
        for tensor in tensors:
            on_device = tensor.detach().to("cuda", non_blocking=False).contiguous()
            self._comm.broadcast(on_device, src=0, stream=stream)
            sent.append(on_device)  # kept until the stream has run the broadcasts
        stream.synchronize()

    def close(self) -> None:
        """Let the communicator go (the engine's side is let go by its next rendezvous or its shutdown)."""
        self._comm = None
