"""A policy trained as a LoRA adapter: its versions are adapters loaded side by side on engines that serve the base
model, so an update needs no pause (docs/architecture.md §5, "LoRA policies").

Version v of adapter `name` is the engine adapter `adapter_name(name, v)` (`<name>-v<v>`), loaded from the
update's path; version 0 is the base model itself (LoRA's B matrices start at zero: step 0 samples as the base).
A request names the version it was dispatched under (vLLM's `model`, SGLang's `lora_path`) and keeps it to its
end, so an update only changes what new requests name; the newest `keep_versions` stay loaded.

`EngineAdapters` makes one engine's adapter calls in its dialect. `LoraPolicyBackend` wraps an engine's backend so
that the gateway's update machinery drives adapter versions unchanged: `update_weights` loads one (and unloads the
oldest), `weight_version` is the newest the engine holds, `pause` and `resume` do nothing (requests in flight go on
under the adapter they named), and every labelled chunk is labelled with its request's adapter version, the label
a full-weights engine would give (the engine's own label is its base model's).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Sequence
from typing import Literal

import aiohttp

from backends.base import (
    Capabilities,
    Chunk,
    EngineBackend,
    Load,
    PauseMode,
    SamplingParams,
    TensorMeta,
    TransferBackend,
    TransferGroup,
    raise_for_load_status,
    raise_for_status,
    translate_errors,
)
from backends.errors import BackendRejected, WeightsNotLoaded
from backends.http_client import ReplicaClient, request, request_json
from backends.routed_experts import ExpertArray

__all__ = ["EngineAdapters", "LoraPolicyBackend", "adapter_name", "adapter_version"]

_PATHS = {
    "vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "sglang": ("/load_lora_adapter", "/unload_lora_adapter"),
}


def adapter_name(adapter: str, version: int) -> str | None:
    """The engine adapter of `adapter`'s version `version`; None for version 0, the base model."""
    return None if version == 0 else f"{adapter}-v{version}"


def adapter_version(adapter: str, name: str) -> int | None:
    """The version an engine adapter named `name` is of `adapter` (None: another adapter's)."""
    found = re.fullmatch(re.escape(adapter) + r"-v(\d+)", name)
    return int(found.group(1)) if found else None


class EngineAdapters:
    """One engine's LoRA adapter calls: vLLM `/v1/load_lora_adapter` (with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`),
    SGLang `/load_lora_adapter`; the loaded ones from `GET /v1/models` (their cards name a `parent`)."""

    def __init__(
        self,
        client: ReplicaClient,
        replica: str,
        dialect: Literal["vllm", "sglang"],
        control: aiohttp.ClientTimeout,
        load: aiohttp.ClientTimeout,
    ) -> None:
        self._client, self._replica, self._control, self._load = client, replica, control, load
        self._load_path, self._unload_path = _PATHS[dialect]

    async def load(self, name: str, path: str) -> None:
        """Load the adapter at `path` as `name`; an engine that refuses it raises `WeightsNotLoaded` (it serves on
        without it)."""
        body = {"lora_name": name, "lora_path": path}
        reply = await request(
            self._client, self._replica, "POST", self._load_path, json=body, timeout=self._load, check=False
        )
        raise_for_load_status(self._replica, reply.status, reply.content, f"load_lora_adapter {name!r} from {path!r}")

    async def unload(self, name: str) -> None:
        """Unload `name`; one the engine does not hold is already unloaded."""
        reply = await request(
            self._client,
            self._replica,
            "POST",
            self._unload_path,
            json={"lora_name": name},
            timeout=self._control,
            check=False,
        )
        if reply.status in (400, 404) and b"not" in reply.content.lower():  # "cannot be found", "not loaded"
            return
        raise_for_status(self._replica, reply.status, reply.content)

    async def loaded(self) -> list[str]:
        answer = await request_json(self._client, self._replica, "GET", "/v1/models", timeout=self._control)
        with translate_errors(self._replica):
            return [str(card["id"]) for card in answer["data"] if card.get("parent")]


class LoraPolicyBackend:
    """An engine serving the versions of one LoRA adapter (`EngineBackend`; see the module docstring)."""

    def __init__(self, engine: EngineBackend, adapters: EngineAdapters, adapter: str, keep_versions: int) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be at least 1, got {keep_versions}")
        self.engine, self.adapters, self.adapter, self.keep_versions = engine, adapters, adapter, keep_versions
        self.id, self.url, self.data_parallel_size = engine.id, engine.url, engine.data_parallel_size
        self.scorer = engine.scorer  # a teacher served as an adapter names it per call
        # `keep` only: a request in flight goes on under the adapter it named; nothing is paused nor aborted.
        self.capabilities: Capabilities = Capabilities(
            pause_modes=frozenset({"keep"}),
            routed_experts_out=engine.capabilities.routed_experts_out,
            routed_experts_in=engine.capabilities.routed_experts_in,
            streams_routed_experts=engine.capabilities.streams_routed_experts,
            version_spans=False,
            token_endpoint=engine.capabilities.token_endpoint,
            new_requests_while_paused="block",
        )

    @property
    def paced_reads(self) -> int:
        return self.engine.paced_reads

    def generate(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        routed_experts: ExpertArray | None = None,
        experts_start: int = 0,
        *,
        stream: bool = True,
        deadline: float | None = None,
        cache_salt: str | None = None,
        dp_rank: int | None = None,
        adapter: str | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """The engine's answer under `adapter` (None: the base model, version 0), each labelled chunk labelled with
        that version."""
        version = 0 if adapter is None else adapter_version(self.adapter, adapter)
        if version is None:
            raise BackendRejected(f"replica {self.id}: {adapter!r} is no version of {self.adapter!r}", replica=self.id)
        chunks = self.engine.generate(
            token_ids,
            sampling,
            request_id,
            routed_experts,
            experts_start,
            stream=stream,
            deadline=deadline,
            cache_salt=cache_salt,
            dp_rank=dp_rank,
            adapter=adapter,
        )
        return _labelled(chunks, str(version))

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self, mode: PauseMode) -> None:
        return None  # requests in flight keep their adapter; new ones wait in the gateway for the new version

    async def resume(self) -> None:
        return None

    async def update_weights(self, version: str, source: str | None, *, flush: bool = True) -> bool:
        """Load the adapter at `source` as version `version` (the versions beyond `keep_versions` unloaded first).
        Its prefix cache needs no flush: the engines key cached blocks by adapter."""
        if source is None:
            raise WeightsNotLoaded(
                f"replica {self.id}: a version of adapter {self.adapter!r} is loaded from a path (no relabel)",
                replica=self.id,
            )
        number = int(version)
        for name in await self.adapters.loaded():
            held = adapter_version(self.adapter, name)
            if held is not None and (held <= number - self.keep_versions or held == number):
                await self.adapters.unload(name)
        new = adapter_name(self.adapter, number)
        if new is not None:
            await self.adapters.load(new, source)
        return True

    async def weight_version(self) -> str:
        """The newest version of the adapter the engine holds ("0": none, the base model)."""
        held = [adapter_version(self.adapter, name) for name in await self.adapters.loaded()]
        return str(max((v for v in held if v is not None), default=0))

    async def transfer_workers(self) -> int:
        return await self.engine.transfer_workers()

    def forms_transfer_group(self, group: TransferGroup | None) -> bool:
        return False

    async def open_transfer(self, backend: TransferBackend, group: TransferGroup | None) -> bool:
        raise WeightsNotLoaded(
            f"replica {self.id}: adapter {self.adapter!r} is loaded from a path, not transferred", replica=self.id
        )

    async def receive_transfer_chunk(self, chunk: Sequence[TensorMeta]) -> None:
        raise WeightsNotLoaded(f"replica {self.id}: no transfer is open", replica=self.id)

    async def finish_transfer(self, version: str, *, flush: bool = True) -> bool:
        raise WeightsNotLoaded(f"replica {self.id}: no transfer is open", replica=self.id)

    async def abort_transfer(self) -> None:
        return None

    async def flush_cache(self) -> bool:
        return True  # cached blocks are keyed by adapter: no version reuses another's

    async def health(self) -> bool:
        return await self.engine.health()

    async def load(self) -> Load:
        return await self.engine.load()

    async def aclose(self) -> None:
        await self.engine.aclose()


async def _labelled(chunks: AsyncGenerator[Chunk, None], label: str) -> AsyncGenerator[Chunk, None]:
    try:
        async for chunk in chunks:
            if chunk.finish_reason is not None or chunk.weight_version is not None or chunk.version_spans:
                chunk.weight_version, chunk.version_spans = label, None
            yield chunk
    finally:
        await chunks.aclose()
