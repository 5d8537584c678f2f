"""Generation with transparent resume (docs/architecture.md §4): the request and its state (`request`), the loop
that serves it across segments, updates and replica failures (`generator`)."""

from gateway.generation.generator import Generator, ServingWeights, StalenessCheck
from gateway.generation.request import (
    STALE,
    Delta,
    GenerationRequest,
    GenerationSettings,
    GenerationState,
    PartialHook,
    RoutedExpertsPolicy,
    Segment,
    StopChecker,
    sampling_used,
)

__all__ = [
    "STALE",
    "Delta",
    "GenerationRequest",
    "GenerationSettings",
    "GenerationState",
    "Generator",
    "PartialHook",
    "RoutedExpertsPolicy",
    "Segment",
    "ServingWeights",
    "StalenessCheck",
    "StopChecker",
    "sampling_used",
]
