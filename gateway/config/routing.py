"""`routing:`: placement of sessions on replicas, and replica health."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Seconds, Section

RoutingPolicy = Literal["sticky", "cache_aware", "sticky_least_loaded", "least_loaded", "round_robin"]
GroupPlacement = Literal["together", "hash"]


class RoutingConfig(Section):
    """Placement of sessions on replicas, and replica health (docs/architecture.md §6)."""

    policy: RoutingPolicy = Field(
        "sticky",
        description="sticky (HRW + bounded load) | cache_aware | sticky_least_loaded | least_loaded | round_robin.",
    )
    balance_factor: float = Field(
        0.25,
        ge=0,
        description="ε: new sessions skip replicas above (1+ε)×mean load (sticky: in-flight; cache_aware).",
    )
    group_placement: GroupPlacement = Field(
        "together", description="together: a GRPO group's members on one replica while it has room | hash."
    )
    load_bound: int = Field(
        32, ge=0, description="Requests a replica may carry above the least loaded before it counts as loaded."
    )
    kv_usage_limit: float = Field(
        0.95, gt=0, le=1, description="KV cache usage (engine-reported) above which a replica counts as loaded."
    )
    load_interval_s: Seconds = Field(
        1.0, description="Period of each replica's engine-load read (cache_aware, sticky_least_loaded), seconds."
    )
    prefix_block_tokens: int = Field(16, ge=1, description="cache_aware: tokens per block of the prefix trees.")
    prefix_max_blocks: int = Field(
        65_536, ge=1, description="cache_aware: blocks each replica's prefix tree holds at most."
    )
    health_interval_s: Seconds = Field(2.0, description="Period of GET /health probes, seconds.")
    health_timeout_s: Seconds = Field(2.0, description="Timeout of one health probe, seconds.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open the circuit.")
    circuit_open_s: Seconds = Field(10.0, description="How long an open circuit keeps a replica out, seconds.")
