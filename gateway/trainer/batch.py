"""`Batch`: the trajectories handed to the trainer, their off-policy masks and groups, and `to_tensors` (one row per
sample, or packed: one row per trajectory, `gateway.trainer.packing`).

Staleness (docs/architecture.md §5). With `max_staleness`, the version current when `next_batch` is called is read
from `rg:weights` (0 when absent); a model token is off-policy when its version is below `current - max_staleness`,
and a trajectory is stale when any of its samples has `min_version` below that bound. `stale_policy="drop"`
acknowledges and skips stale trajectories (with `group_by`, the whole group: a group is trained whole or not
at all) and counts them in `Batch.dropped_stale`; `"mask"` keeps them but zeroes their off-policy tokens in
`Batch.off_policy_mask`, and so in the `loss_mask` tensor. A sample the gateway's staleness budget cut
(`Sample.stale`) counts as stale under either policy, every token of it off-policy.

torch is imported only by `Batch.to_tensors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from gateway.trainer.entries import Item
from gateway.trainer.packing import packed_arrays
from gateway.trajectory import ENV_VERSION, Sample, Trajectory, TrajectoryFormatError

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "Layout", "StalePolicy", "is_stale"]

StalePolicy = Literal["drop", "mask"]
Layout = Literal["rows", "packed"]


@dataclass
class Batch:
    """Trajectories handed to the trainer, plus what was skipped while collecting them.

    `off_policy_mask[i][j]` is a uint8 array over the response tokens of sample `j` of trajectory `i`: 0 for
    a model token older than the staleness bound (only with `stale_policy="mask"`), 1 everywhere else.
    `group_index[i]` numbers trajectory `i`'s group within the batch (each trajectory is its own group
    without `group_by`). `current_version` is the weight version staleness was judged against. The `dropped_*`
    counters say what the `next_batch` call that made this batch acknowledged without delivering. A batch
    built by hand from trajectories alone gets all-ones masks and one group per trajectory.
    """

    trajectories: list[Trajectory] = field(default_factory=list)
    off_policy_mask: list[list[npt.NDArray[np.uint8]]] = field(default_factory=list)
    group_index: list[int] = field(default_factory=list)
    current_version: int = 0
    stale_before: int | None = None  # versions below this are off-policy; None without max_staleness
    dropped_stale: int = 0
    dropped_duplicate: int = 0
    dropped_unreadable: int = 0
    dropped_incomplete: int = 0

    def __post_init__(self) -> None:
        if self.trajectories and not self.off_policy_mask:
            self.off_policy_mask = [[_on_policy(s, None) for s in t.samples] for t in self.trajectories]
        if self.trajectories and not self.group_index:
            self.group_index = list(range(len(self.trajectories)))

    def __len__(self) -> int:
        return len(self.trajectories)

    def __repr__(self) -> str:  # the default would print every token array
        return (
            f"Batch(trajectories={len(self)}, samples={self.num_samples}, groups={self.num_groups}, "
            f"current_version={self.current_version}, stale_before={self.stale_before}, "
            f"dropped_stale={self.dropped_stale}, dropped_duplicate={self.dropped_duplicate}, "
            f"dropped_unreadable={self.dropped_unreadable}, dropped_incomplete={self.dropped_incomplete})"
        )

    @property
    def entry_ids(self) -> list[str]:
        return [t.entry_id for t in self.trajectories]

    @property
    def num_groups(self) -> int:
        return self.group_index[-1] + 1 if self.group_index else 0

    @property
    def stale_samples(self) -> int:
        """Samples the gateway's staleness budget cut (`Sample.stale`), delivered marked (`weights.stale_samples:
        deliver`)."""
        return sum(sample.stale for t in self.trajectories for sample in t.samples)

    @property
    def num_samples(self) -> int:
        return sum(len(t.samples) for t in self.trajectories)

    def _add_group(self, items: Sequence[Item]) -> None:
        index = self.num_groups
        for item in items:
            samples = item.trajectory.samples
            self.trajectories.append(item.trajectory)
            self.off_policy_mask.append([_on_policy(s, self.stale_before) for s in samples])
            self.group_index.append(index)

    def to_tensors(
        self, pad_token_id: int = 0, device: str | torch.device = "cpu", layout: Layout = "rows"
    ) -> dict[str, torch.Tensor]:
        """The batch as torch tensors, right-padded: `layout="rows"` gives one row per sample of every trajectory (in
        order); `"packed"` one row per trajectory, each token its samples share once (below).

        Rows. Alignment: position `t` of `loss_mask`, `old_logprobs` and `versions` describes the token
        `input_ids[t]` — its log-probability when it was sampled given `input_ids[:t]`, and the weight version
        that sampled it. A trainer that scores `logits[:, :-1]` against `input_ids[:, 1:]` therefore uses
        `loss_mask[:, 1:]`, `old_logprobs[:, 1:]`, `versions[:, 1:]`. `routed_experts[t]` (present only when
        every sample has experts) is the routing of the forward pass at position `t`, the one that produced
        the distribution of token `t + 1`; it has `T - 1` positions, zero on padding.

        - `input_ids` (B, T) long, `pad_token_id` on padding; `attention_mask` (B, T) long, 1 on real tokens;
        - `loss_mask` (B, T) float32: 0 on the prompt, environment tokens, off-policy tokens and padding;
        - `old_logprobs` (B, T) float32, 0 where `loss_mask` of the stored sample is 0;
        - `versions` (B, T) long, -1 on prompt, environment tokens and padding;
        - `teacher_logprobs` (B, T) float32, where every sample was scored by a teacher (`pools[i].teacher`): the
          teacher's log-probability of the token given those before it, aligned as `old_logprobs`, 0 where it is;
        - `routed_experts` (B, T - 1, layers, top_k) long;
        - `rewards` (B,) float32: the row's sample's reward where the session was finished with one per sample
          (`finish {rewards}`), else the trajectory's reward; NaN when the session finished without one;
        - `trajectory_index`, `sample_index`, `group_index` (B,) long: which trajectory of the batch, which
          sample of it, and which group of the batch each row comes from.

        Packed (gateway/trainer/packing.py). A trajectory's samples form a tree (`Sample.parent`, `branch_point`):
        row `b` holds trajectory `b`'s sample 0, then each later sample from its branch point on (a root whole), so
        a prefix shared by several samples is there once, in the sample that holds it. The same tokens are trained,
        with the same masks, logprobs and versions, as in the row layout. S is the number of samples in the batch.

        - `input_ids`, `attention_mask`, `loss_mask`, `old_logprobs`, `versions`, `teacher_logprobs` (B, T): as in
          rows, per token;
        - `position_ids` (B, T) long: the token's position in its own sample's sequence (0 on padding);
        - `tree_attention_mask` (B, T, T) bool: `[b, i, j]` is True iff token `j` is `i` or an earlier token of
          `i`'s sequence (its ancestors' shared prefix included, other branches excluded); a padding position
          attends only itself. For a Hugging Face model pass `torch.where(mask, 0.0, finfo.min)[:, None]` as a
          4D `attention_mask`, with `position_ids`;
        - `prev_index` (B, T) long: the packed position of the token before this one in its sequence, -1 at a
          sequence's first token and on padding. Token `i`'s log-probability is read from the logits at
          `prev_index[i]` (not `i - 1`: a branch's first own token follows its branch point);
        - `token_sample` (B, T) long: which sample's own part the token is, as an index into the (S,) tensors
          below; -1 on padding;
        - `routed_experts` (B, T, layers, top_k) long: at token `i`, the routing of the forward pass there (the one
          that produced the distribution of the tokens whose `prev_index` is `i`), as the sample that holds the
          token recorded it (a later sample's where the holder has none); zero where none has;
        - `rewards`, `trajectory_index`, `sample_index`, `group_index` (S,): one per sample, as in rows.

        A tree that is inconsistent (a parent that is not earlier, a branch point past the parent's length or
        the branch's prompt, shared ids that differ) is a `TrajectoryFormatError` in the packed layout.
        """
        import torch

        if layout == "packed":
            arrays = packed_arrays(self.trajectories, self.off_policy_mask, pad_token_id)
        elif layout == "rows":
            arrays = self._row_arrays(pad_token_id)
        else:
            raise ValueError(f"layout must be 'rows' or 'packed', not {layout!r}")
        arrays.update(self._per_sample())
        return {name: torch.from_numpy(array).to(device) for name, array in arrays.items()}

    def _rows(self) -> list[tuple[int, int]]:
        return [(t, s) for t, trajectory in enumerate(self.trajectories) for s in range(len(trajectory.samples))]

    def _row_arrays(self, pad_token_id: int) -> dict[str, npt.NDArray[Any]]:
        rows = self._rows()
        width = max((_length(self._sample(t, s)) for t, s in rows), default=0)
        arrays: dict[str, npt.NDArray[Any]] = {
            "input_ids": np.full((len(rows), width), pad_token_id, np.int64),
            "attention_mask": np.zeros((len(rows), width), np.int64),
            "loss_mask": np.zeros((len(rows), width), np.float32),
            "old_logprobs": np.zeros((len(rows), width), np.float32),
            "versions": np.full((len(rows), width), ENV_VERSION, np.int64),
        }
        if rows and all(self._sample(t, s).teacher_logprobs is not None for t, s in rows):
            arrays["teacher_logprobs"] = np.zeros((len(rows), width), np.float32)
        for row, (t, s) in enumerate(rows):
            self._fill_row(arrays, row, t, s)
        experts = self._experts(rows, width)
        if experts is not None:
            arrays["routed_experts"] = experts
        return arrays

    def _per_sample(self) -> dict[str, npt.NDArray[Any]]:
        """One entry per sample of the batch, in order: the same in both layouts."""
        rows = self._rows()
        per_trajectory = [trajectory.rewards for trajectory in self.trajectories]
        rewards = [per_trajectory[t][s] for t, s in rows]
        return {
            "rewards": np.array([np.nan if r is None else r for r in rewards], np.float32),
            "trajectory_index": np.array([t for t, _ in rows], np.int64),
            "sample_index": np.array([s for _, s in rows], np.int64),
            "group_index": np.array([self.group_index[t] for t, _ in rows], np.int64),
        }

    def _sample(self, t: int, s: int) -> Sample:
        return self.trajectories[t].samples[s]

    def _fill_row(self, arrays: dict[str, npt.NDArray[Any]], row: int, t: int, s: int) -> None:
        sample = self._sample(t, s)
        start, end = sample.prompt_ids.size, _length(sample)
        model = sample.loss_mask.astype(bool)
        arrays["input_ids"][row, :start] = sample.prompt_ids
        arrays["input_ids"][row, start:end] = sample.response_ids
        arrays["attention_mask"][row, :end] = 1
        arrays["loss_mask"][row, start:end] = model * self.off_policy_mask[t][s]
        arrays["old_logprobs"][row, start:end] = np.where(model, sample.logprobs, 0.0)
        arrays["versions"][row, start:end] = np.where(model, sample.versions, ENV_VERSION)
        if "teacher_logprobs" in arrays and sample.teacher_logprobs is not None:
            arrays["teacher_logprobs"][row, start:end] = np.where(model, sample.teacher_logprobs, 0.0)

    def _experts(self, rows: Sequence[tuple[int, int]], width: int) -> npt.NDArray[np.int64] | None:
        found = [self._sample(t, s).routed_experts for t, s in rows]
        present = [e for e in found if e is not None]
        if not rows or len(present) != len(rows):
            return None
        layers, top_k = present[0].shape[1:] if present[0].ndim == 3 else (0, 0)
        out = np.zeros((len(rows), max(width - 1, 0), layers, top_k), np.int64)
        for row, ((t, s), experts) in enumerate(zip(rows, present, strict=True)):
            expected = max(_length(self._sample(t, s)) - 1, 0)
            if experts.shape != (expected, layers, top_k):
                session = self.trajectories[t].session_id
                raise TrajectoryFormatError(
                    f"session {session} sample {s}: routed experts of shape {experts.shape}, "
                    f"expected ({expected}, {layers}, {top_k})"
                )
            out[row, :expected] = experts
        return out


def _length(sample: Sample) -> int:
    return int(sample.prompt_ids.size + sample.response_ids.size)


def _on_policy(sample: Sample, stale_before: int | None) -> npt.NDArray[np.uint8]:
    if stale_before is None:
        return np.ones(sample.response_ids.size, np.uint8)
    if sample.stale:
        return np.zeros(sample.response_ids.size, np.uint8)
    off = sample.loss_mask.astype(bool) & (sample.versions < stale_before)
    return (~off).astype(np.uint8)


def is_stale(trajectory: Trajectory, stale_before: int) -> bool:
    """Whether a sample of `trajectory` is older than `stale_before`, or was cut for staleness by the gateway."""
    versions = (sample.min_version for sample in trajectory.samples)
    return any(sample.stale for sample in trajectory.samples) or any(
        v is not None and v < stale_before for v in versions
    )
