"""`generation:`: the generate-with-resume loop and its upstream HTTP client."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config.section import Seconds, Section

RoutedExpertsPolicy = Literal["splice", "replace"]


class GenerationConfig(Section):
    """The generate-with-resume loop and its upstream HTTP client (docs/architecture.md §4)."""

    max_resumes: int = Field(32, ge=0, description="Re-issues of one request after aborts/failures.")
    request_timeout_s: Seconds = Field(600.0, description="Overall deadline of one request, seconds.")
    max_wait_s: float = Field(60.0, ge=0, description="Wait for a serving replica before 503, seconds.")
    routed_experts: RoutedExpertsPolicy = Field("splice", description="Merge of experts across resumes.")
    connect_timeout_s: Seconds = Field(5.0, description="TCP connect timeout to a replica, seconds.")
    read_timeout_s: Seconds = Field(
        600.0, description="Max gap between bytes from a replica (a whole answer: up to request_timeout_s), seconds."
    )
    stall_timeout_s: float = Field(
        60.0,
        ge=0,
        description="A stream silent this long after its first token: its replica failed, resume elsewhere; s, 0: off.",
    )
    first_token_timeout_s: float = Field(
        120.0,
        ge=0,
        description="A stream with no first token this long while its replica sends no token for any request either: "
        "the replica is hung, resume elsewhere; s, 0: off.",
    )
    write_timeout_s: Seconds = Field(30.0, description="Max time to send a request body, seconds.")
    pool_timeout_s: Seconds = Field(30.0, description="Max wait for a free pooled connection, seconds.")
    keepalive_expiry_s: Seconds = Field(
        4.0,
        description="An unused connection to a replica is closed after this, s; keep it under the engines' keep-alive.",
    )
    max_connections_per_replica: int = Field(1024, ge=1, description="Size of each replica's connection pool.")
    stream_pacing_s: float = Field(
        0.2, ge=0, le=1, description="Least time between two reads of an engine stream while many are open, s (0: off)."
    )
    stream_pacing_min_streams: int = Field(
        32, ge=1, description="Open streams of a replica from which its stream reads are paced."
    )

    @model_validator(mode="after")
    def _pacing_within_timeouts(self) -> GenerationConfig:
        if self.stream_pacing_s >= self.read_timeout_s:
            raise ValueError(
                f"stream_pacing_s ({self.stream_pacing_s:g}) must be shorter than read_timeout_s "
                f"({self.read_timeout_s:g}): a held stream would count as a silent replica"
            )
        if 0 < self.stall_timeout_s <= self.stream_pacing_s:
            raise ValueError(
                f"stall_timeout_s ({self.stall_timeout_s:g}) must be 0 (off) or longer than stream_pacing_s "
                f"({self.stream_pacing_s:g}): a held stream would count as a stalled replica"
            )
        if 0 < self.first_token_timeout_s <= self.stream_pacing_s:
            raise ValueError(
                f"first_token_timeout_s ({self.first_token_timeout_s:g}) must be 0 (off) or longer than "
                f"stream_pacing_s ({self.stream_pacing_s:g}): a held stream would count as a hung replica"
            )
        return self
