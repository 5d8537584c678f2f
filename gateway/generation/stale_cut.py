"""Completions whose sample fell behind the staleness budget (`gateway.weights.budget`), found among those in flight.

A weight update that breaks a completion off has it checked at its resume (`Generator._beyond_budget`). One that
keeps it running (a `keep` pause) does not: `cut_behind` ends those once the new version serves, each with its tokens
so far and finish reason "stale" (the generator's handling of `CutForStaleness`), its engine request aborted.
"""

from __future__ import annotations

import logging

from gateway.errors import CutForStaleness
from gateway.generation.request import GenerationRequest, GenerationState
from gateway.routing import ReplicaPool
from gateway.routing.segment_watch import SegmentWatch

__all__ = ["cut_behind", "first_version", "log_cut"]

logger = logging.getLogger(__name__)


def first_version(request: GenerationRequest, state: GenerationState) -> int | None:
    """The weight version of the sample's first token: the turn's (an earlier turn's sample), else this completion's
    first token's; None before it has one."""
    if request.first_version is not None:
        return request.first_version
    return state.versions[0] if state.versions else None


def cut_behind(pool: ReplicaPool, oldest: int) -> int:
    """End every segment in flight on `pool` whose sample's first token is older than version `oldest`. Returns how
    many were told to end."""
    cut = 0
    for replica in pool.all():
        for request in list(replica.requests):
            if not isinstance(request, SegmentWatch) or request.error is not None:
                continue
            if request.first_version is not None and request.first_version < oldest:
                request.end(CutForStaleness(f"its sample's first token is older than version {oldest}"))
                cut += 1
    return cut


def log_cut(request: GenerationRequest, state: GenerationState, version: int) -> None:
    """Say that a completion was cut for staleness under `version`."""
    logger.info(
        "request %s: cut for staleness after %d tokens (its sample began under version %s; the budget moved past it "
        "with version %d)",
        request.request_id,
        len(state.output_ids),
        first_version(request, state),
        version,
        extra={"session_id": request.session_id, "version": version},
    )
