"""The simulator's side of the engines' in-memory weight transfer (issue 53 §1): a process group with the trainer,
an update session, and tensors that change the simulated weights.

The simulated model has ONE parameter, `weights`: the identity of the weights it runs (what a disk load sets to the
checkpoint's path). A transfer sends that parameter as bytes (uint8, the identity's UTF-8), so tokens sampled after
a transfer of `ckpt-3` are exactly those sampled after a load of the path `ckpt-3` under the same label. Another
parameter name is refused, as a real engine refuses a name its model does not have.

No NCCL: the "process group" is one TCP connection from the engine to the trainer's rendezvous address, which the
trainer listens on as the rank 0 of a real group hosts its TCPStore. Joining retries until the trainer listens or
`join_timeout_s` passes (the engines' init blocks until the trainer joins). A broadcast of the tensors named in an
update is, here, their bytes written by the trainer on that connection, read in the order and sizes the update's
metadata (names, dtypes, shapes) gives.

Inline tensors (SGLang `/update_weights_from_tensor`): the engine's own format, `backends.sim.inline_tensors`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

from backends.sim.engine import SimEngine

PARAMETER = "weights"
"""The simulated model's one parameter: the identity of the weights it runs."""

_ITEM_BYTES = {
    "uint8": 1,
    "int8": 1,
    "bool": 1,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "float32": 4,
    "int32": 4,
    "float64": 8,
    "int64": 8,
}


class TransferError(RuntimeError):
    """A transfer call the engine refuses (the message is the engine's)."""


def _item_bytes(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    if name not in _ITEM_BYTES:
        raise TransferError(f"unsupported dtype {dtype!r}")
    return _ITEM_BYTES[name]


class SimGroup:
    """The engine's end of a process group with the trainer (rank 0): one TCP connection."""

    def __init__(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        self.address, self.port = address, port
        self.rank_offset, self.world_size = rank_offset, world_size
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def join(self, timeout_s: float) -> None:
        """Connect to the trainer's rendezvous, retrying until it listens; `TransferError` after `timeout_s`."""
        if not 0 < self.rank_offset < self.world_size:
            raise TransferError(f"rank_offset {self.rank_offset} is not a worker rank of world_size {self.world_size}")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._reader, self._writer = await asyncio.open_connection(self.address, self.port)
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TransferError(
                        f"timed out after {timeout_s:g} s waiting for the trainer to join the rendezvous at "
                        f"{self.address}:{self.port} ({exc})"
                    ) from exc
                # A TCPStore client's own retry: the trainer may not listen yet. Not synchronisation.
                await asyncio.sleep(0.05)

    async def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> bytes:
        """The broadcast of the simulated model's parameter: its bytes, read from the trainer."""
        if not len(names) == len(dtypes) == len(shapes):
            raise TransferError("names, dtypes and shapes must be of the same length")
        check_names(names)
        if self._reader is None:
            raise TransferError("the process group is not initialized")
        sizes = [_item_bytes(dtype) * math.prod(shape) for dtype, shape in zip(dtypes, shapes, strict=True)]
        try:
            chunks = [await self._reader.readexactly(size) for size in sizes]
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise TransferError(f"the trainer left the process group mid-broadcast ({exc})") from exc
        return chunks[-1] if chunks else b""

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None


def check_names(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - {PARAMETER})
    if unknown:
        raise TransferError(f"the simulated model has no parameter {unknown[0]!r} (it has only {PARAMETER!r})")


class TransferSide:
    """One simulated replica's transfer state: its group (kept across updates) and whether an update is open."""

    def __init__(self, engine: SimEngine, join_timeout_s: float) -> None:
        self.engine = engine
        self.join_timeout_s = join_timeout_s
        self.group: SimGroup | None = None
        self.active = False  # between start (begin) and finish (end)
        self.loaded = 0  # tensor updates received (the simulator's counter)

    async def init_group(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        """Form a new group (an earlier one is dropped, as re-initializing replaces the communicator)."""
        if self.group is not None:
            await self.group.close()
            self.group = None
        group = SimGroup(address, port, rank_offset, world_size)
        await group.join(self.join_timeout_s)
        self.group = group

    async def destroy_group(self) -> None:
        if self.group is None:
            raise TransferError("no weight update group to destroy")
        await self.group.close()
        self.group = None

    def start(self) -> None:
        if self.active:
            raise TransferError("a weight update is already active; finish it first")
        self.active = True

    def finish(self) -> None:
        if not self.active:
            raise TransferError("no weight update is active; start one first")
        self.active = False

    async def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        """Receive the broadcast of an update: the weights change in place at once (as on the engines: that is why
        the gateway keeps the replica paused until the update is committed)."""
        if not self.active:
            raise TransferError("update must run within an active weight update (start/begin first)")
        if self.group is None:
            raise TransferError("the weight transfer process group is not initialized")
        data = await self.group.receive(names, dtypes, shapes)
        if names:
            self.apply(data.decode("utf-8", "replace"))

    def apply(self, identity: str) -> None:
        self.engine.load_weights(identity)
        self.engine.counters["weight_transfers"] += 1
        self.loaded += 1

    async def aclose(self) -> None:
        if self.group is not None:
            await self.group.close()
