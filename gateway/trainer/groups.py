"""GRPO group assembly: the trajectories read by a consumer and not yet handed out.

A trajectory joins the group `metadata[group_by]`; the group is complete when it has `group_size` members (the
consumer's, else the first member's `metadata["group_size"]`); a gateway request with `group: true` and `n=K`
makes K sessions with `group_id` and `group_size` K (`gateway.turns.runner`). Members wait in memory, un-acked, so a
crash of the consumer hands them to another. A batch holds whole complete groups only: `n` counts trajectories, a
group is never split, and a group that does not fit the room left in a batch waits for the next call (a group
larger than `n` comes alone). A group still incomplete `max_group_wait_s` after its first member arrived here (a
member was abandoned, or the trainer that would have sent it crashed) is dropped: its entries are acknowledged
like delivered ones and counted in `Batch.dropped_incomplete`. Dropping, not releasing, keeps the promise that a
batch holds complete groups only (a partial group would skew the group-relative advantage). A trajectory with no
`metadata[group_by]` or no known group size is delivered on its own, with a warning. Without `group_by`, every
trajectory is a group of its own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from gateway.trainer.batch import Batch, is_stale
from gateway.trainer.entries import Item
from gateway.trajectory import Trajectory

__all__ = ["Groups"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Group:
    size: int
    since: float  # monotonic time its first member arrived here
    members: list[Item] = field(default_factory=list)


class Groups:
    """Trajectories held here: incomplete groups, and complete ones waiting for room in a batch."""

    def __init__(self, group_by: str | None, group_size: int | None) -> None:
        self.group_by = group_by
        self.group_size = group_size
        self.held: dict[str, Item] = {}  # read here, not yet handed out (incomplete group, or no room yet), by entry
        self._groups: dict[str, _Group] = {}  # incomplete groups by key
        self._ready: deque[list[Item]] = deque()  # complete groups waiting for room in a batch

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.held

    @property
    def ready(self) -> bool:
        """Whether a complete group waits for room in a batch."""
        return bool(self._ready)

    def clear(self) -> None:
        self.held.clear()
        self._groups.clear()
        self._ready.clear()

    def hold(self, item: Item) -> None:
        self.held[item.entry.entry_id] = item
        if self.group_by is None:
            self._ready.append([item])
            return
        key, size = self._group_of(item.trajectory)
        if key is None or size is None:
            logger.warning(
                "session %s: no %s or group size in its metadata; delivered as a group of its own",
                item.trajectory.session_id,
                self.group_by,
            )
            self._ready.append([item])
            return
        group = self._groups.setdefault(key, _Group(size=size, since=time.monotonic()))
        group.members.append(item)
        if len(group.members) >= group.size:
            del self._groups[key]
            self._ready.append(group.members)

    def _group_of(self, trajectory: Trajectory) -> tuple[str | None, int | None]:
        metadata = trajectory.meta.metadata
        key = metadata.get(self.group_by) if self.group_by is not None else None
        size = self.group_size
        if size is None:
            try:
                size = int(metadata["group_size"])
            except (KeyError, TypeError, ValueError):
                size = None
        if size is not None and size < 1:
            size = None
        return (None if key is None else str(key)), size

    def take_overdue(self, max_wait_s: float) -> list[Item]:
        """The members of groups still incomplete `max_wait_s` after their first member arrived, no longer held."""
        if not self._groups:
            return []
        now = time.monotonic()
        overdue = [key for key, group in self._groups.items() if now - group.since >= max_wait_s]
        dropped: list[Item] = []
        for key in overdue:
            group = self._groups.pop(key)
            logger.warning(
                "group %s: %d of %d members after %.0fs; dropping the incomplete group",
                key,
                len(group.members),
                group.size,
                now - group.since,
            )
            dropped.extend(group.members)
        for item in dropped:
            del self.held[item.entry.entry_id]
        return dropped

    def fill(self, batch: Batch, n: int, drop_before: int | None) -> list[Item]:
        """Move complete groups into the batch while they fit (the first one always does); returns the members of
        the groups taken but stale (a member older than `drop_before`), which the batch does not get."""
        stale: list[Item] = []
        while self._ready and (not batch.trajectories or len(batch) + len(self._ready[0]) <= n):
            group = self._ready.popleft()
            for item in group:
                del self.held[item.entry.entry_id]
            if drop_before is not None and any(is_stale(item.trajectory, drop_before) for item in group):
                stale.extend(group)
            else:
                batch._add_group(group)
        return stale

    def forget(self, lost: set[str]) -> None:
        """Let go of the entries another consumer took over, and of every group one of them belongs to."""
        # A group missing a member cannot be completed here: forget all of it. Its other members are no longer
        # refreshed, so they go idle and are reclaimed — by the consumer that has the missing member, or another.
        broken = [key for key, g in self._groups.items() if any(m.entry.entry_id in lost for m in g.members)]
        for key in broken:
            for item in self._groups.pop(key).members:
                self.held.pop(item.entry.entry_id, None)
        kept: deque[list[Item]] = deque()
        for group in self._ready:
            if any(item.entry.entry_id in lost for item in group):
                for item in group:
                    self.held.pop(item.entry.entry_id, None)
            else:
                kept.append(group)
        self._ready = kept
