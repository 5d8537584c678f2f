"""Build the adapter for a replica from its kind: `vllm`, `sglang`, or `sim` (the simulator, in either dialect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from backends.base import EngineBackend, ReplicaSpec

if TYPE_CHECKING:
    from backends.sglang import SglangBackend
    from backends.vllm import VllmBackend

BackendKind = Literal["vllm", "sglang", "sim"]
Dialect = Literal["vllm", "sglang"]


def create_backend(
    kind: BackendKind, spec: ReplicaSpec, dialect: Dialect | None = None, lora: LoraPolicy | None = None
) -> EngineBackend:
    """The adapter for one replica. A `sim` replica speaks a real engine's protocol, so it gets that adapter.
    `lora`: the replica serves the versions of a LoRA adapter (`backends.lora.LoraPolicyBackend`)."""
    protocol = dialect if kind == "sim" and dialect else kind
    engine: SglangBackend | VllmBackend
    if protocol == "sglang":
        from backends.sglang import SglangBackend

        engine = SglangBackend(spec)
    elif protocol == "vllm":
        from backends.vllm import VllmBackend

        engine = VllmBackend(spec)
    else:
        raise ValueError(f"unknown backend {kind!r} (expected vllm, sglang or sim)")
    if lora is None:
        return engine
    from backends.lora import LoraPolicyBackend

    return LoraPolicyBackend(engine, engine.adapters, lora.adapter, lora.keep_versions)


@dataclass(frozen=True, slots=True)
class LoraPolicy:
    """A policy trained as a LoRA adapter: its name, and how many of its newest versions each engine keeps."""

    adapter: str
    keep_versions: int
