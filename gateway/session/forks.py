"""Where a new sample of a session comes from (docs/architecture.md §7, "Forks"): the sample a retried turn asks for
again, the one a new sample branches from, the one whose conversation a rewritten history goes on from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.history import ReplayMatch, same_messages
from gateway.sample_tree import shared_prefix
from gateway.session.working_sample import Branch, WorkingSample
from gateway.trajectory import I32

Message = dict[str, Any]
Tool = dict[str, Any]

__all__ = ["BRANCH_CANDIDATES", "branch_of", "last_turn_start", "retried", "rewritten_from"]


# How many of a session's most recent samples a new sample looks for the one it branches from (a session id shared by
# unrelated conversations gathers thousands; a fork is almost always from a recent one).
BRANCH_CANDIDATES = 64


def branch_of(samples: Sequence[WorkingSample], prompt: list[int]) -> Branch | None:
    """Where a new sample prompted with `prompt` branches from: the recent sample (`BRANCH_CANDIDATES`) it shares the
    most leading ids with (the most recent of equals), and how many; None when it shares none."""
    if not samples:
        return None
    ids = np.asarray(prompt, I32)
    best: Branch | None = None
    for sample in reversed(samples[-BRANCH_CANDIDATES:]):
        arrays = sample.arrays()
        shared = min(shared_prefix(ids, arrays.prompt_ids), len(arrays.prompt_ids))
        if shared == len(arrays.prompt_ids):
            shared += shared_prefix(ids[shared:], arrays.response_ids)
        if shared and (best is None or shared > best.point):
            best = Branch(sample.index, shared)
    return best


def retried(
    samples: Sequence[WorkingSample],
    messages: list[Message],
    tools: list[Tool] | None,
    template_kwargs: dict[str, Any] | None,
    match: ReplayMatch,
) -> WorkingSample | None:
    """The most recent sample whose last turn `messages` ask for again: its conversation is these messages and the
    reply (under `match`), with the same tools and template arguments."""
    for sample in reversed(samples):
        conversation = sample.conversation
        if not sample.num_turns or len(conversation) != len(messages) + 1 or sample.tools != tools:
            continue
        if sample.template_kwargs != template_kwargs or conversation[-1].get("role") != "assistant":
            continue
        if all(same_messages(old, new, match) for old, new in zip(conversation, messages, strict=False)):
            return sample
    return None


def last_turn_start(sample: WorkingSample) -> int:
    """Where the sample's last turn's reply begins, in its ids: after the last environment id of its response (a
    later turn's ids begin with what the template wrote after the reply before, never nothing), else after the
    prompt."""
    mask = sample.loss_mask
    last_env = next((i for i in range(len(mask) - 1, -1, -1) if not mask[i]), -1)
    return len(sample.prompt_ids) + last_env + 1


def rewritten_from(
    samples: Sequence[WorkingSample], messages: list[Message], tools: list[Tool] | None, match: ReplayMatch
) -> int | None:
    """The most recent sample whose conversation `messages` go on from, read as messages, not ids: the same messages
    in the same order, then more (an assistant reply's reasoning aside: templates like Qwen3's drop it from earlier
    turns, and agents may not echo it). The new sample's `rewritten_from`; None when there is none."""
    for sample in reversed(samples):
        conversation = sample.conversation
        if not sample.num_turns or sample.tools != tools or len(conversation) >= len(messages):
            continue
        pairs = zip(conversation, messages[: len(conversation)], strict=True)
        if all(same_messages(old, new, match) for old, new in pairs):
            return sample.index
    return None
