"""`routing:`: placement of sessions on replicas, and replica health."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Seconds, Section

RoutingPolicy = Literal["sticky", "least_loaded", "round_robin"]


class RoutingConfig(Section):
    """Placement of sessions on replicas, and replica health (docs/architecture.md §6)."""

    policy: RoutingPolicy = Field("sticky", description="sticky (HRW + bounded load) | least_loaded | round_robin.")
    balance_factor: float = Field(0.25, ge=0, description="ε: skip replicas above (1+ε)×mean in-flight.")
    health_interval_s: Seconds = Field(2.0, description="Period of GET /health probes, seconds.")
    health_timeout_s: Seconds = Field(2.0, description="Timeout of one health probe, seconds.")
    failure_threshold: int = Field(3, ge=1, description="Consecutive failures that open the circuit.")
    circuit_open_s: Seconds = Field(10.0, description="How long an open circuit keeps a replica out, seconds.")
