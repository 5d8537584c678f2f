"""How the reference trainer hands each new weight version to the engines: a checkpoint they load from disk, or an
in-memory transfer it pushes into them itself (issue 53).

`CheckpointPublisher`: write `checkpoints/v{version}` and `POST /admin/weights {version, path, mode}`.

`TransferPublisher`: `POST /admin/weights {version, transfer, mode}`; the gateway answers 202 with the layout at once
and pauses the engines. Over `gloo` (vLLM's CPU build) or `nccl` (vLLM on GPUs; untested by the project) the trainer
is rank 0 of one process group per engine,
formed where the layout says `rendezvous` and kept across updates otherwise (the rendezvous ports stay the same from
one update to the next, so the gateway keeps the groups); with `tensor` (SGLang) the tensors go inline. Once every
engine's side is open (`GET /admin/weights/{version}`) the tensors are pushed straight into each engine, in chunks
of at most `chunk_bytes`, then `POST /admin/weights/{version}/commit`. A push that fails is raised without a commit:
the gateway ends the transfer at its deadline (`weights.transfer_commit_timeout_s`) as a failed update and reloads
the engines from the last checkpoint path it knows, or holds them out.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import torch

from trainers import group_transfer, tensor_transfer
from trainers.gloo_transfer import GlooGroup
from trainers.group_transfer import NamedTensors, TensorGroup
from trainers.grpo import Learner
from trainers.nccl_transfer import NcclGroup

WeightsMode = Literal["checkpoint", "transfer"]
TransferBackend = Literal["gloo", "nccl", "tensor"]
GROUPS: dict[str, type[GlooGroup] | type[NcclGroup]] = {"gloo": GlooGroup, "nccl": NcclGroup}
# What the trainer picks by itself, in this order, where every engine takes it; `nccl` only when asked (it needs
# vLLM and a GPU on the trainer's side, and its group is vLLM's: an SGLang engine's is formed otherwise).
PREFERRED: tuple[TransferBackend, ...] = ("gloo", "tensor")


class Publisher(Protocol):
    async def publish(self, learner: Learner, version: int) -> None:
        """Make the learner's weights version `version` on every engine (raises if the gateway took them nowhere)."""
        ...

    async def aclose(self) -> None: ...


def _pool(model: str | None) -> dict[str, str]:
    """The `model` field that names the gateway's pool (`pools:`), where one is named."""
    return {} if model is None else {"model": model}


class CheckpointPublisher:
    """Checkpoints on disk, the newest `keep` of them kept; `model`: the gateway's pool (`pools:`)."""

    def __init__(
        self, http: httpx.AsyncClient, checkpoints: str | Path, mode: str, keep: int = 3, model: str | None = None
    ) -> None:
        self.http, self.folder, self.mode, self.keep, self.model = http, Path(checkpoints), mode, keep, model

    async def publish(self, learner: Learner, version: int) -> None:
        path = await asyncio.to_thread(learner.save, self.folder, version)
        body = {"version": version, "path": str(path), "mode": self.mode} | _pool(self.model)
        answer = await self.http.post("/admin/weights", json=body)
        if not answer.is_success:
            raise RuntimeError(f"weight update to version {version} failed: {answer.status_code} {answer.text}")
        _prune(self.folder, keep=self.keep, newest=version)

    async def aclose(self) -> None:
        return None


class TransferPublisher:
    """In-memory transfers through the gateway's two-phase update. `backend` None: the first of `PREFERRED` that
    every engine takes (`GET /admin/status`); `master_address`: where the engines reach this process; `fan_out`
    (group backends): the begin carries the manifest of the chunks, the gateway makes the engines' receiving calls,
    and this side only broadcasts (no call to an engine's HTTP port); `model`: the gateway's pool (`pools:`)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        mode: str,
        backend: TransferBackend | None = None,
        master_address: str = "127.0.0.1",
        timeout_s: float = 300.0,
        chunk_bytes: int = 256 << 20,
        fan_out: bool = False,
        model: str | None = None,
    ) -> None:
        self.http, self.mode, self.backend, self.fan_out, self.model = http, mode, backend, fan_out, model
        self.master_address, self.timeout_s, self.chunk_bytes = master_address, timeout_s, chunk_bytes
        self._engines = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))  # straight to the engines
        self._groups: dict[str, TensorGroup] = {}  # engine URL → the group formed with it (gloo, nccl), kept
        self._ports: tuple[int, int] | None = None  # the first rendezvous port and how many follow it

    async def publish(self, learner: Learner, version: int) -> None:
        await self.transfer(version, await asyncio.to_thread(learner.named_weights))
        learner.version = version

    async def transfer(self, version: int, named: NamedTensors) -> dict[str, Any]:
        """Make `named` (checkpoint names, the engines' dtype) version `version` on every engine: `begin`, `push`
        into each engine whose side opened, `commit`; the commit's answer."""
        engines = await self.begin(version, named if self.fan_out else None)
        await asyncio.gather(*(self.push(url, named) for url in engines))
        return await self.commit(version)

    async def begin(self, version: int, manifest_of: NamedTensors | None = None) -> list[str]:
        """Ask the gateway for the transfer of `version` (with `manifest_of`: the manifest of those tensors' chunks,
        for the gateway's fan-out), join the groups its layout forms and wait until every engine's side is open:
        the URLs of the engines to push into (a side that failed is held out by the gateway and left out here)."""
        backend = self.backend = self.backend or await self._choose()
        transfer: dict[str, Any] = {"backend": backend}
        if backend in GROUPS:
            engines = len((await self._status())["engines"])
            transfer |= {"master_address": self.master_address, "master_port": self._master_port(engines)}
        if manifest_of is not None:
            if backend not in GROUPS:
                raise RuntimeError(f"a {backend!r} transfer has no manifest: its tensors go inline")
            transfer["manifest"] = [
                [
                    {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for name, t in chunk
                ]
                for chunk in chunked(manifest_of, self.chunk_bytes)
            ]
        body = {"version": version, "transfer": transfer, "mode": self.mode} | _pool(self.model)
        begun = await self.http.post("/admin/weights", json=body)
        if begun.status_code != 202:
            raise RuntimeError(f"weight transfer of version {version} refused: {begun.status_code} {begun.text}")
        if backend in GROUPS:
            sides = [side for side in begun.json()["engines"] if side["rendezvous"]]
            await asyncio.gather(*(self._join(GROUPS[backend], side) for side in sides))
        opened = await self.http.get(
            f"/admin/weights/{version}", params={"wait_s": str(min(self.timeout_s, 600.0))} | _pool(self.model)
        )
        if opened.status_code != 200 or opened.json()["status"] != "open":
            raise RuntimeError(f"the transfer of version {version} did not open: {opened.status_code} {opened.text}")
        return [side["url"] for side in opened.json()["engines"] if side["state"] == "open"]

    async def push(self, url: str, named: NamedTensors) -> None:
        """`named` into the engine at `url` (between `begin` and `commit`), in chunks of at most `chunk_bytes`; with
        `fan_out`, the broadcasts alone (the gateway makes the engine's calls)."""
        if self.backend is None:
            raise RuntimeError("push before begin: no transfer is under way")
        for chunk in chunked(named, self.chunk_bytes):
            if self.backend in GROUPS:
                group = self._groups.get(url)
                if group is None:
                    raise RuntimeError(
                        f"no {self.backend} group with {url}: the layout asked for no rendezvous with it"
                    )
                if self.fan_out:
                    await asyncio.to_thread(group.broadcast, [tensor for _, tensor in chunk])
                else:
                    await group_transfer.push(self._engines, url, group, chunk)
            else:
                await tensor_transfer.push(self._engines, url, chunk)

    async def commit(self, version: int) -> dict[str, Any]:
        """End the transfer: the gateway finishes it on every engine with the version label and resumes; its answer
        (200 `updated`, 207 `partial`; anything else raised)."""
        committed = await self.http.post(f"/admin/weights/{version}/commit", params=_pool(self.model))
        if not committed.is_success:
            raise RuntimeError(f"weight transfer of version {version} failed: {committed.status_code} {committed.text}")
        answer: dict[str, Any] = committed.json()
        return answer

    async def _status(self) -> dict[str, Any]:
        answer = await self.http.get("/admin/status", params=_pool(self.model))
        if not answer.is_success:
            raise RuntimeError(f"GET /admin/status: {answer.status_code} {answer.text}")
        status: dict[str, Any] = answer.json()
        return status

    async def _choose(self) -> TransferBackend:
        engines = (await self._status())["engines"]
        for backend in PREFERRED:
            if engines and all(backend in engine["transfer_backends"] for engine in engines):
                return backend
        taken = {engine["id"]: engine["transfer_backends"] for engine in engines}
        raise RuntimeError(
            f"no in-memory transfer the trainer can push ({', '.join(PREFERRED)}) is taken by every "
            f'engine: {taken}; start vLLM with --weight-transfer-config \'{{"backend": "gloo"}}\''
        )

    def _master_port(self, engines: int) -> int:
        """Engine i's rendezvous is at the first port + i: the same ports every update (so the groups are kept),
        chosen again only when there are more engines than ports."""
        if self._ports is None or self._ports[1] < engines:
            self._close_groups()
            self._ports = (_free_ports(engines), engines)
        return self._ports[0]

    async def _join(self, group: type[GlooGroup] | type[NcclGroup], side: dict[str, Any]) -> None:
        """Form the group the layout asks for (the engine joins it as the gateway opens its side): blocks until it
        has, so in a thread."""
        kept = self._groups.pop(side["url"], None)
        if kept is not None:
            kept.close()  # the engine formed no group with it any more (it restarted), and its port is wanted again
        self._groups[side["url"]] = await asyncio.to_thread(
            group, side["master_address"], side["master_port"], side["world_size"], self.timeout_s
        )

    def _close_groups(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()

    async def aclose(self) -> None:
        self._close_groups()
        await self._engines.aclose()


def chunked(named: NamedTensors, limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named` in order, in chunks of at most `limit` bytes (a tensor larger than that alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on this host now."""
    while True:
        with socket.socket() as probe:
            probe.bind(("", 0))
            first = int(probe.getsockname()[1])
        if first + count <= 65536 and all(_free(first + i) for i in range(1, count)):
            return first


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _prune(folder: Path, keep: int, newest: int) -> None:
    """Delete the checkpoints older than the newest `keep`."""
    for old in folder.glob("v*"):
        if old.name[1:].isdigit() and int(old.name[1:]) <= newest - keep:
            shutil.rmtree(old, ignore_errors=True)
