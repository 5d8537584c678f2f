"""A session's samples as a tree (docs/architecture.md §7, "Forks"): a sample that branches from an earlier one
(`Sample.parent`) shares its first `branch_point` ids with it, and Redis holds those ids once, in the parent."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gateway.trajectory import I32, Sample, TrajectoryFormatError

__all__ = ["joined", "shared_prefix"]


def joined(samples: Mapping[int, Sample]) -> list[Sample]:
    """The session's samples, read from Redis by index, in index order with each branch's prompt whole again (its
    parent's first `branch_point` ids, then what its hash holds), and each sample a retry abandoned `superseded`.
    A parent that is missing, not earlier, or shorter than the branch point is a `TrajectoryFormatError`."""
    for index in sorted(samples):
        sample = samples[index]
        if sample.parent is None:
            continue
        parent = samples.get(sample.parent)
        if parent is None or sample.parent >= index or parent.input_ids.size < sample.branch_point:
            raise TrajectoryFormatError(
                f"sample {index} branches from sample {sample.parent} at {sample.branch_point}, which it cannot"
            )
        sample.prompt_ids = np.concatenate([parent.input_ids[: sample.branch_point], sample.prompt_ids]).astype(I32)
        if sample.retry:
            parent.superseded = True
    return [samples[index] for index in sorted(samples)]


def shared_prefix(ids: np.ndarray, other: np.ndarray) -> int:
    """How many leading ids the two sequences share."""
    size = min(ids.size, other.size)
    differ = np.flatnonzero(ids[:size] != other[:size])
    return int(differ[0]) if differ.size else size
