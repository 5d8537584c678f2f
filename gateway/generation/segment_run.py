"""A segment in flight and how it closes: one engine request's tokens joined to the request's whole completion.

`SegmentRun` is the segment's bookkeeping (its replica, the version it was dispatched for, what its engine labelled
its tokens with, its routed experts); `close_segment` appends the segment to the generation state: its tokens'
versions, its `Segment` record and its experts, spliced or replaced per `generation.routed_experts`.
"""

from __future__ import annotations

import logging

import numpy as np

from backends.base import VersionSpan
from backends.routed_experts import ExpertArray
from gateway.generation.request import GenerationState, RoutedExpertsPolicy, Segment
from gateway.routing import Replica
from gateway.token_versions import token_versions
from gateway.weights.labels import version_label, version_labels

logger = logging.getLogger(__name__)


class SegmentRun:
    """Mutable bookkeeping of the segment in flight."""

    def __init__(self, replica: Replica, start: int, dispatch_version: int, salted: bool) -> None:
        self.replica = replica
        self.start = start
        self.dispatch_version = dispatch_version
        self.salted = salted  # its request carries the prefix-cache salt of `dispatch_version`
        self.newer: int | None = None  # the newer version its engine labelled its first token with
        self.dispatch_label = version_label(dispatch_version)  # what engines label this version's tokens with
        self.dispatch_labels = version_labels(dispatch_version)  # ... and what else they may label them with
        self.finish: str | None = None
        self.stop_reason: int | str | None = None
        self.spans: list[VersionSpan] | None = None
        self.experts: ExpertArray | None = None
        self.weight_version: str | None = None
        self.interrupted_at: float | None = None  # monotonic time the previous segment broke off (resume latency)
        self.preempted_at: float | None = None  # the same, when a weight update aborted it (dispatch latency)


def close_segment(state: GenerationState, run: SegmentRun, experts_policy: RoutedExpertsPolicy) -> None:
    """Append the segment's tokens' versions, its `Segment` and its routed experts to `state`; a finish of `stop`
    or `length` finishes the whole completion."""
    count = len(state.output_ids) - run.start
    versions = token_versions(run.spans, count, run.weight_version, run.dispatch_label, run.dispatch_version)
    if versions and state.versions and versions[0] < state.versions[-1]:
        # The coordinator never lets this happen (stale replicas serve nothing); record the truth, loudly.
        logger.error(
            "request %s: version went back from %d to %d on replica %s",
            state.request.request_id,
            state.versions[-1],
            versions[0],
            run.replica.id,
            extra={"session_id": state.request.session_id, "replica": run.replica.id, "version": versions[0]},
        )
    state.versions.extend(versions)
    state.segments.append(Segment(run.replica.id, run.start, len(state.output_ids), run.finish))
    _merge_experts(state, run, count, experts_policy)
    if run.finish in ("stop", "length"):
        state.finish_reason = run.finish
        state.stop_reason = run.stop_reason


def _merge_experts(state: GenerationState, run: SegmentRun, count: int, policy: RoutedExpertsPolicy) -> None:
    if not state.request.want_routed_experts:
        return
    new = run.experts
    if policy == "replace" or run.start == 0:
        if new is not None:
            state.routed_experts = new
            state.routed_experts_start = 0 if policy == "replace" else state.request.experts_start
        elif count:
            state.routed_experts_complete = False
        return
    if count == 0:
        return  # an empty tail: the continuation produced nothing, the accumulated experts stand
    if new is None or state.routed_experts is None:
        state.routed_experts_complete = False
        return
    # The continuation reports positions [len(prompt+earlier output) - 1, ...): exactly the new ones.
    state.routed_experts = np.concatenate([state.routed_experts, new.astype(state.routed_experts.dtype)])
