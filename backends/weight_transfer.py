"""The engines' side of an in-memory weight transfer (issue 53 §1), one class per dialect; each adapter holds one
and delegates the `EngineBackend` transfer methods to it.

The trainer pushes the tensors straight into the engines (never through the gateway); the gateway only opens each
engine's side (its process group with the trainer, then an update session) and finishes it with the version label.

- vLLM (dev mode, launched with `--weight-transfer-config`): `/init_weight_transfer_engine {init_info: {master_address,
  master_port, rank_offset, world_size}}` (blocks until the trainer joins), `/start_weight_update`; the trainer's
  `/update_weights` calls; `/finish_weight_update {weight_version}`. vLLM has no abort of an update: an abandoned one
  is finished unlabelled, which closes the session and leaves the weights to be reloaded.
- SGLang: `nccl`: `/init_weights_update_group` (blocks until the trainer joins), then `/begin_weight_update`; `tensor`:
  `/begin_weight_update` only (the trainer's `/update_weights_from_tensor` carries the tensors inline). The end is
  `/end_weight_update` (required around every update), then `/update_weight_version`: the label is the gateway's to
  give, whatever the trainer's updates said.

With a manifest (the trainer's `transfer.manifest`) the gateway makes the receiving calls itself, chunk by chunk
(`receive`: vLLM `/update_weights`, SGLang `/update_weights_from_distributed`), while the trainer only broadcasts.

A group is kept across updates while its engine answers every health probe: one missed probe (the engine may have
restarted, and holds no group then) or a failed opening forgets it, and the next transfer forms it again (the layout
says `rendezvous`). SGLang would otherwise open an update session on a restarted engine without its group, and the
commit label its initial weights with the new version. A probe missed by an engine that did not restart costs one
rendezvous more: initializing again replaces the engine's communicator (both engines).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import aiohttp

from backends.base import TensorMeta, TransferBackend, TransferGroup
from backends.errors import BackendError, BackendRejected
from backends.http_client import ReplicaClient, request_json

GROUP_NAME = "rg-weights"
"""The name of the gateway's weight-update group on SGLang (one per engine)."""


class _TransferSide:
    def __init__(
        self, client: ReplicaClient, replica: str, control: aiohttp.ClientTimeout, long: aiohttp.ClientTimeout
    ) -> None:
        self._client, self.replica = client, replica
        self._control, self._long = control, long
        self.group: TransferGroup | None = None  # the group formed with the trainer, kept across updates

    def forget(self) -> None:
        """The group may be gone (the engine missed a health probe: it may have restarted, and a restarted engine
        holds no group): the next transfer forms it again, the trainer joining its rendezvous."""
        self.group = None

    def forms(self, group: TransferGroup | None) -> bool:
        """Whether opening with `group` forms it (none kept, or a different rendezvous) rather than keep it."""
        return group is not None and group != self.group

    async def _call(self, path: str, json: Any = None, *, long: bool = False, method: str = "POST") -> Any:
        timeout = self._long if long else self._control
        return await request_json(self._client, self.replica, method, path, json=json, timeout=timeout)

    def _refused(self, what: str, answer: Any) -> None:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise BackendError(f"replica {self.replica}: {what} failed: {answer.get('message')}", replica=self.replica)


class VllmTransfer(_TransferSide):
    """vLLM's routes; `backend` is the one of its `--weight-transfer-config` (None: it takes no transfer)."""

    async def workers(self) -> int:
        answer = await self._call("/get_world_size", method="GET")
        try:
            return int(answer["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendError(f"replica {self.replica}: unexpected /get_world_size answer {answer!r}") from exc

    async def open(self, group: TransferGroup | None) -> bool:
        formed = False
        try:
            if group is not None and self.forms(group):
                self.group = None
                info = dataclasses.asdict(group)  # master_address, master_port, rank_offset, world_size
                await self._call("/init_weight_transfer_engine", {"init_info": info}, long=True)
                self.group, formed = group, True
            await self._call("/start_weight_update")
        except BackendError:
            self.forget()  # a restart it was not seen in (no group there now) fails here: the next one forms it
            raise
        return formed

    async def receive(self, chunk: Sequence[TensorMeta]) -> None:
        info = {
            "names": [t.name for t in chunk],
            "dtype_names": [t.dtype for t in chunk],
            "shapes": [list(t.shape) for t in chunk],
        }
        await self._call("/update_weights", {"update_info": info}, long=True)

    async def finish(self, version: str) -> None:
        await self._call("/finish_weight_update", {"weight_version": version}, long=True)

    async def abort(self) -> None:
        try:
            await self._call("/finish_weight_update", {})  # closes the session; no label: nothing vouches for it
        except BackendRejected:
            pass  # no session open (it never started, or a failed chunk reset it): nothing to close


class SglangTransfer(_TransferSide):
    """SGLang's routes: `nccl` over a weight-update group, `tensor` inline."""

    def __init__(
        self,
        client: ReplicaClient,
        replica: str,
        control: aiohttp.ClientTimeout,
        long: aiohttp.ClientTimeout,
        workers: int,
    ) -> None:
        super().__init__(client, replica, control, long)
        self._workers = workers

    async def workers(self) -> int:
        """Its schedulers: one per data-parallel rank (tensor parallelism is not counted: a later step)."""
        return self._workers

    async def open(self, backend: TransferBackend, group: TransferGroup | None) -> bool:
        formed = False
        try:
            if backend == "nccl" and group is not None and self.forms(group):
                self.group = None
                body = dataclasses.asdict(group) | {"group_name": GROUP_NAME, "backend": "nccl"}
                answer = await self._call("/init_weights_update_group", body, long=True)
                self._refused("init_weights_update_group", answer)
                self.group, formed = group, True
            self._refused("begin_weight_update", await self._call("/begin_weight_update", {}))
        except BackendError:
            self.forget()
            raise
        return formed

    async def receive(self, chunk: Sequence[TensorMeta]) -> None:
        body = {
            "names": [t.name for t in chunk],
            "dtypes": [t.dtype for t in chunk],
            "shapes": [list(t.shape) for t in chunk],
            "group_name": GROUP_NAME,
            "flush_cache": False,  # the gateway's finish decides; a flush fails while a pause keeps requests
        }
        self._refused(
            "update_weights_from_distributed", await self._call("/update_weights_from_distributed", body, long=True)
        )

    async def finish(self, version: str) -> None:
        self._refused("end_weight_update", await self._call("/end_weight_update", {}))
        body = {"new_version": version, "abort_all_requests": False}
        self._refused("update_weight_version", await self._call("/update_weight_version", body))

    async def abort(self) -> None:
        try:
            await self._call("/end_weight_update", {})
        except BackendRejected:
            pass  # no session open: nothing to close
