"""`GlooWeightTransferEngine`: vLLM's in-memory weight transfer over gloo, for the CPU build.

The trainer is rank 0 of one process group per engine. It hosts the rendezvous (a `TCPStore` at `master_address:
master_port`; the group over `PrefixStore("tcp://host:port", store)`, which is what vLLM's stateless helper builds
on this side) and needs torch alone. For each `/update_weights {"update_info": {names, dtype_names, shapes}}` it
broadcasts the named tensors from rank 0 in that order while the call runs; the worker receives each into a CPU
tensor and loads it by its checkpoint name (`model.load_weights`, which fuses q/k/v and gate/up as a disk load
does). `/start_weight_update` and `/finish_weight_update` wrap the chunks in vLLM's layerwise reload, as its NCCL
engine does, so the new weights are processed for the CPU kernels once they are all in.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.utils import init_gloo_process_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

JOIN_TIMEOUT = timedelta(seconds=300)  # how long a worker waits for the trainer's rendezvous to listen
GROUP_TIMEOUT = timedelta(seconds=600)  # one broadcast, and the group's forming once the store answers
CONNECT_ATTEMPT = timedelta(seconds=2)


def _trainers_store(address: str, port: int, timeout: timedelta) -> Any:
    """A client of the store the trainer hosts, connected once it listens. Tried every 0.2 s: the trainer may start
    listening just after the gateway asked this engine to join (both follow the same 202), and a failed first
    connection would otherwise back off for a minute or more inside torch before its next try."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            return dist.TCPStore(address, port, is_master=False, timeout=CONNECT_ATTEMPT)  # type: ignore[attr-defined]
        except RuntimeError:  # torch's DistNetworkError: nothing listens there (yet)
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """The trainer's rendezvous and this engine's place in its group (the gateway's transfer layout)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The tensors of one chunk, in the order the trainer broadcasts them: checkpoint names, torch dtype names
    ("float32", "bfloat16"), shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length ({len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)})"
            )
        for dtype_name in self.dtype_names:
            if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
                raise ValueError(f"{dtype_name!r} is no torch dtype")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the trainer's tensors over a gloo group of its own (see the module's docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None  # torch's ProcessGroup, once the trainer joined

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group (blocks until it joins, at most `JOIN_TIMEOUT`); a group formed before is let go
        first."""
        self.shutdown()
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        address, port = init_info.master_address, init_info.master_port
        store = _trainers_store(address, port, JOIN_TIMEOUT)
        store.set_timeout(GROUP_TIMEOUT)
        prefixed = dist.PrefixStore(f"tcp://{address}:{port}", store)  # type: ignore[attr-defined]
        self.group = init_gloo_process_group(prefixed, rank, init_info.world_size, GROUP_TIMEOUT)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class's, without its accelerator synchronisation (which raises where there is none): a gloo
        broadcast has completed once its `wait` returns."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            ):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                self.group.broadcast(weight, 0).wait()  # the group's own method: root 0 is the trainer's group rank
                self.model.load_weights([(name, weight)])

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):  # a peer already gone
                group.shutdown()
