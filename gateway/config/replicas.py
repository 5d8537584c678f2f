"""`replicas:`, `replicas_from:` and `discovery:`: the engine replicas, those found at run time, and how."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from gateway.config.section import Seconds, Section

Backend = Literal["vllm", "sglang", "sim"]
Dialect = Literal["vllm", "sglang"]


def _check_http_url(url: str) -> str:
    """Accept `http(s)://host[:port][/path]` and drop a trailing slash so paths join cleanly."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8001")
    _ = parts.port  # raises ValueError for an out-of-range or non-numeric port
    return url.rstrip("/")


HttpUrlStr = Annotated[str, AfterValidator(_check_http_url)]


def _id_from_url(data: dict[str, Any]) -> str:
    url: str = data["url"]
    parts = urlsplit(url)
    return parts.netloc + parts.path.rstrip("/")


def _dialect_from_backend(data: dict[str, Any]) -> Dialect:
    return "sglang" if data["backend"] == "sglang" else "vllm"


class ReplicaFields(Section):
    """What a replica is besides where: its engine, protocol and capabilities (`discovery.replica` is one)."""

    backend: Backend = Field(description="Engine kind: vllm | sglang | sim (the bundled simulator).")
    dialect: Dialect = Field(
        default_factory=_dialect_from_backend, description="Protocol; settable only for backend sim."
    )
    routed_experts_shape: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] | None = Field(
        None, description="(layers, top_k) to decode SGLang's raw int32 routed experts."
    )
    routed_experts: bool = Field(
        False, description="The engine captures routed experts (started with --enable-return-routed-experts)."
    )
    routed_experts_input: bool = Field(
        False, description="The engine accepts routing replay input (the simulator's opt-in extension)."
    )
    scale_out: bool = Field(False, description="vLLM: /inference/v1/generate is enabled (--enable-scale-out).")
    keep_mode: Literal["retract", "in_place"] = Field(
        "retract", description="SGLang: the pause mode that implements the gateway's keep."
    )
    new_requests_while_paused: Literal["block", "reject", "unknown"] = Field(
        "unknown", description="How the engine treats new requests during an abort/wait pause."
    )
    weight_transfer: Literal["nccl", "gloo"] | None = Field(
        None,
        description="vLLM: the backend of its --weight-transfer-config (in-memory weight updates; none: none; gloo: "
        "the CPU build with the project's plugin, backends/vllm-gloo-plugin/). SGLang takes nccl and tensor "
        "transfers without it.",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks behind the engine's one server (its --data-parallel-size / --dp-size): each "
        "is a routing target of its own, `<id>@dp<rank>`, its requests pinned to that rank.",
    )

    @model_validator(mode="after")
    def _dialect_matches_backend(self) -> ReplicaFields:
        if self.backend != "sim" and self.dialect != self.backend:
            raise ValueError(f"dialect {self.dialect!r} contradicts backend {self.backend!r} (only sim takes one)")
        if self.routed_experts and self.dialect == "sglang" and self.routed_experts_shape is None:
            raise ValueError("routed_experts on an SGLang replica needs routed_experts_shape: [layers, top_k]")
        return self


class ReplicaConfig(ReplicaFields):
    """One engine replica. `dialect` is the wire protocol it speaks: its backend's, or the simulator's choice."""

    url: HttpUrlStr = Field(description="Base URL of the engine's HTTP server.")
    id: str = Field(default_factory=_id_from_url, min_length=1, description="Unique name; default host:port.")


def _unique_ids(replicas: tuple[ReplicaConfig, ...]) -> tuple[ReplicaConfig, ...]:
    seen: dict[str, int] = {}
    for index, replica in enumerate(replicas):
        if replica.id in seen:
            raise ValueError(f"duplicate replica id {replica.id!r} (replicas[{seen[replica.id]}] and [{index}])")
        seen[replica.id] = index
    return replicas


#: `replicas:`, a list whose ids are unique.
Replicas = Annotated[tuple[ReplicaConfig, ...], AfterValidator(_unique_ids)]

DEFAULT_REPLICAS = (
    ReplicaConfig(url="http://127.0.0.1:8001", backend="sim", dialect="vllm"),
    ReplicaConfig(url="http://127.0.0.1:8002", backend="sim", dialect="sglang"),
)


def _check_replicas_from(source: str | None) -> str | None:
    """`dns://name:port` or `file://path` (relative paths: to the working folder)."""
    if source is None:
        return None
    parts = urlsplit(source)
    if parts.scheme == "dns":
        if not parts.hostname or parts.port is None:
            raise ValueError("a dns:// source names a host and the engines' port, e.g. dns://engines.ns.svc:8000")
    elif parts.scheme == "file":
        if not (parts.netloc + parts.path):
            raise ValueError("a file:// source names a YAML file, e.g. file:///etc/rollout-gateway/replicas.yaml")
    else:
        raise ValueError("must be null, dns://name:port or file://path")
    return source


#: `replicas_from:`, null or a source of replicas followed at run time.
ReplicasFrom = Annotated[str | None, AfterValidator(_check_replicas_from)]


class DiscoveryConfig(Section):
    """How `replicas_from` is followed (docs/serving.md, replica discovery)."""

    interval_s: Seconds = Field(5.0, description="Period of re-resolving the name or re-reading the file, seconds.")
    nameserver: str | None = Field(
        None,
        pattern=r"^[^:\s]+:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$",
        description="dns://: the DNS server to ask, host:port; null: the system's (/etc/resolv.conf).",
    )
    replica: ReplicaFields = Field(
        ReplicaFields(backend="vllm"),
        description="dns://: the fields of every discovered replica but its url (backend, dialect, routed_experts...).",
    )
