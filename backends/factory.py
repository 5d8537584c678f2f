"""Build the adapter for a replica from its kind: `vllm`, `sglang`, or `sim` (the simulator, in either dialect)."""

from __future__ import annotations

from typing import Literal

from backends.base import EngineBackend, ReplicaSpec

BackendKind = Literal["vllm", "sglang", "sim"]
Dialect = Literal["vllm", "sglang"]


def create_backend(kind: BackendKind, spec: ReplicaSpec, dialect: Dialect | None = None) -> EngineBackend:
    """The adapter for one replica. A `sim` replica speaks a real engine's protocol, so it gets that adapter."""
    protocol = dialect if kind == "sim" and dialect else kind
    if protocol == "sglang":
        from backends.sglang import SglangBackend

        return SglangBackend(spec)
    if protocol == "vllm":
        from backends.vllm import VllmBackend

        return VllmBackend(spec)
    raise ValueError(f"unknown backend {kind!r} (expected vllm, sglang or sim)")
