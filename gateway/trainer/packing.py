"""The packed layout of `Batch.to_tensors(layout="packed")`: one row per trajectory, each shared token once.

A trajectory's samples form a tree (`Sample.parent`, `Sample.branch_point`, docs/architecture.md §7 "Forks"): a
branch shares its parent's first `branch_point` ids. Its row holds sample 0's ids, then each later sample's ids
from its branch point on (its *own part*; a root's own part is its whole sequence), so every token appears once,
in the part of the sample that holds it. A token attends the tokens of its own sequence up to itself: its
ancestors' shared prefix and its own part, never a sibling's. Because a branch point never passes the branch's
prompt, every response token is in its own sample's part, with that sample's loss mask, logprob and version: the
packed layout trains exactly the tokens the row layout trains.

The tree attention mask takes T² bytes per row; `prev_index` alone determines it (a token attends itself and, by
`prev_index`, its predecessors back to its sequence's first token), for an attention kernel that takes another form.

numpy only; `Batch.to_tensors` makes the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.trajectory import ENV_VERSION, Sample, Trajectory, TrajectoryFormatError

__all__ = ["PackedTree", "pack_tree", "packed_arrays"]

Positions = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class PackedTree:
    """Where one trajectory's samples lie in its packed row: `positions[s][k]` is the packed position of token `k`
    of sample `s`'s sequence (`input_ids`), `starts[s]` the first packed position of its own part, and `length`
    the row's token count."""

    positions: tuple[Positions, ...]
    starts: tuple[int, ...]
    length: int


def pack_tree(trajectory: Trajectory) -> PackedTree:
    """The packed places of the trajectory's samples; a `TrajectoryFormatError` when its tree is inconsistent: a
    parent that is not an earlier sample, a branch point past the parent's length or the branch's prompt, a root
    with a branch point, or shared ids that differ from the parent's."""
    positions: list[Positions] = []
    starts: list[int] = []
    end = 0
    for index, sample in enumerate(trajectory.samples):
        _check_branch(trajectory, index)
        shared = positions[sample.parent][: sample.branch_point] if sample.parent is not None else _NONE
        own = np.arange(end, end + _length(sample) - sample.branch_point, dtype=np.int64)
        positions.append(np.concatenate([shared, own]))
        starts.append(end)
        end += own.size
    return PackedTree(tuple(positions), tuple(starts), end)


_NONE: Positions = np.zeros(0, np.int64)


def _check_branch(trajectory: Trajectory, index: int) -> None:
    sample = trajectory.samples[index]
    where = f"session {trajectory.session_id} sample {index}"
    if sample.parent is None:
        if sample.branch_point != 0:
            raise TrajectoryFormatError(f"{where}: a root with branch point {sample.branch_point}")
        return
    if not 0 <= sample.parent < index:
        raise TrajectoryFormatError(f"{where}: its parent {sample.parent} is not an earlier sample")
    parent = trajectory.samples[sample.parent]
    point = sample.branch_point
    if not 0 <= point <= min(_length(parent), sample.prompt_ids.size):
        raise TrajectoryFormatError(
            f"{where}: branch point {point} is past its parent's {_length(parent)} ids "
            f"or its own {sample.prompt_ids.size} prompt ids"
        )
    if not np.array_equal(sample.prompt_ids[:point], parent.input_ids[:point]):
        raise TrajectoryFormatError(f"{where}: its first {point} ids differ from its parent {sample.parent}'s")


def packed_arrays(
    trajectories: Sequence[Trajectory], off_policy_mask: Sequence[Sequence[npt.NDArray[np.uint8]]], pad_token_id: int
) -> dict[str, npt.NDArray[Any]]:
    """The per-token arrays of the packed layout (`Batch.to_tensors` documents them), one row per trajectory."""
    trees = [pack_tree(trajectory) for trajectory in trajectories]
    rows, width = len(trees), max((tree.length for tree in trees), default=0)
    arrays: dict[str, npt.NDArray[Any]] = {
        "input_ids": np.full((rows, width), pad_token_id, np.int64),
        "attention_mask": np.zeros((rows, width), np.int64),
        "position_ids": np.zeros((rows, width), np.int64),
        "tree_attention_mask": np.zeros((rows, width, width), np.bool_),
        "loss_mask": np.zeros((rows, width), np.float32),
        "old_logprobs": np.zeros((rows, width), np.float32),
        "versions": np.full((rows, width), ENV_VERSION, np.int64),
        "token_sample": np.full((rows, width), -1, np.int64),
        "prev_index": np.full((rows, width), -1, np.int64),
    }
    if trajectories and all(sample.teacher_logprobs is not None for t in trajectories for sample in t.samples):
        arrays["teacher_logprobs"] = np.zeros((rows, width), np.float32)
    first = 0  # the batch-wide number of the row's sample 0
    for row, (trajectory, tree) in enumerate(zip(trajectories, trees, strict=True)):
        for index, sample in enumerate(trajectory.samples):
            _fill_sample(arrays, row, tree, index, sample, off_policy_mask[row][index], first + index)
        padding = np.arange(tree.length, width)
        arrays["tree_attention_mask"][row, padding, padding] = True  # no all-masked row: its softmax would be NaN
        first += len(trajectory.samples)
    experts = _experts(trajectories, trees, width)
    if experts is not None:
        arrays["routed_experts"] = experts
    return arrays


def _fill_sample(
    arrays: dict[str, npt.NDArray[Any]],
    row: int,
    tree: PackedTree,
    index: int,
    sample: Sample,
    on_policy: npt.NDArray[np.uint8],
    number: int,
) -> None:
    sequence, point, length = tree.positions[index], sample.branch_point, _length(sample)
    own = sequence[point:]
    arrays["input_ids"][row, own] = sample.input_ids[point:]
    arrays["attention_mask"][row, own] = 1
    arrays["position_ids"][row, own] = np.arange(point, length)
    arrays["token_sample"][row, own] = number
    arrays["prev_index"][row, own] = np.concatenate([[-1], sequence[:-1]])[point:]
    causal = np.tril(np.ones((length, length), np.bool_))
    arrays["tree_attention_mask"][row][np.ix_(own, sequence)] = causal[point:]
    response = sequence[sample.prompt_ids.size :]  # all in `own`: a branch point never passes the prompt
    model = sample.loss_mask.astype(bool)
    arrays["loss_mask"][row, response] = model * on_policy
    arrays["old_logprobs"][row, response] = np.where(model, sample.logprobs, 0.0)
    arrays["versions"][row, response] = np.where(model, sample.versions, ENV_VERSION)
    if "teacher_logprobs" in arrays and sample.teacher_logprobs is not None:
        arrays["teacher_logprobs"][row, response] = np.where(model, sample.teacher_logprobs, 0.0)


def _experts(
    trajectories: Sequence[Trajectory], trees: Sequence[PackedTree], width: int
) -> npt.NDArray[np.int64] | None:
    """Packed routed experts (rows, width, layers, top_k): at each token, the routing of the forward pass there, as
    the sample that holds the token recorded it (as a later sample did where the holder has none: its last token,
    which only a branch continues); zero where no sample has one. None unless every sample has experts."""
    samples = [sample for trajectory in trajectories for sample in trajectory.samples]
    present = [sample.routed_experts for sample in samples if sample.routed_experts is not None]
    if not samples or len(present) != len(samples):
        return None
    layers, top_k = present[0].shape[1:] if present[0].ndim == 3 else (0, 0)
    out = np.zeros((len(trees), width, layers, top_k), np.int64)
    for row, (trajectory, tree) in enumerate(zip(trajectories, trees, strict=True)):
        # Later samples first, so that the holder of a shared token, written last, wins.
        for index in reversed(range(len(trajectory.samples))):
            sample = trajectory.samples[index]
            experts = sample.routed_experts
            expected = max(_length(sample) - 1, 0)
            if experts is None or experts.shape != (expected, layers, top_k):
                shape = None if experts is None else experts.shape
                raise TrajectoryFormatError(
                    f"session {trajectory.session_id} sample {index}: routed experts of shape {shape}, "
                    f"expected ({expected}, {layers}, {top_k})"
                )
            out[row, tree.positions[index][:expected]] = experts
    return out


def _length(sample: Sample) -> int:
    return int(sample.prompt_ids.size + sample.response_ids.size)
