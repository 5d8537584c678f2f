"""GRPO siblings together (`routing.group_placement: together`, the default).

The members of one group (sessions with one `group_id`: a `grp-<group>-<index>` name, or `metadata.group_id`) share
their prompt: on one replica it is prefilled once and its KV shared, where hashing each member's own session id
spreads them and every replica prefills it. So a group is placed as a whole:

- Its first member picks the group's replica: the least loaded candidate, counting the members still to come of
  the groups placed in the last `RESERVE_S` (`reserved`: a burst of groups spreads over the replicas instead of
  piling onto the one that looked idle to all of them); ties go by rendezvous hash of the group id.
- That choice is recorded in Redis with the group (`SET NX`, `GroupRecords`): a member placed by another gateway
  process, or at the same moment, finds it and follows, so a group meets on one replica whichever process its
  members reach. Each process keeps the groups it saw (`GroupPlacements`, bounded and expiring with the record).
- A later member goes to the group's replica while that replica serves and has room (`LoadBound`: not more than
  `routing.load_bound` requests above the least loaded, its KV cache not full), else to the least loaded candidate:
  the group spreads only where its replica has no room.

The one request of a group (`n` choices, `group: true`) is placed as one session already. `hash` places each member
by its own session id, as any session. Each member's own placement is recorded with its session as any other's
(`ReplicaPool.placements`, the session's Redis meta): a member's later turns follow it, not the group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.hashing import mix64, string_key
from gateway.errors import StoreError
from gateway.routing.load import LoadBound
from gateway.routing.replica import Replica

logger = logging.getLogger(__name__)

__all__ = ["GROUP_TTL_S", "RESERVE_S", "GroupPlacements", "ShareGroup"]

ShareGroup = Callable[[str, str], Awaitable[str]]
"""Records `(group, replica id)` where every gateway process reads it unless a replica is recorded for the group
already, and returns the recorded one (`GroupRecords.claim`: Redis `SET NX`)."""

GROUP_TTL_S = 600
"""How long a group's placement is kept (in Redis and in each process) after its first member was placed, seconds:
longer than its members take to arrive, as a trainer sends them (together, or within a rollout step)."""

RESERVE_S = 5.0
"""How long a new group's members still to come count as load on its replica (`GroupPlacements.reserved`)."""


@dataclass(slots=True)
class _Group:
    replica_id: str
    to_come: int  # members not placed yet (at least the first where the size is unknown): load until `reserve_until`
    reserve_until: float
    expires: float


class GroupPlacements:
    """Each GRPO group's replica as this process knows it (module docstring); at most `max_groups`, the oldest
    forgotten first."""

    def __init__(self, bound: LoadBound, max_groups: int = 100_000, ttl_s: float = GROUP_TTL_S) -> None:
        self.bound = bound
        self.max_groups = max_groups
        self.ttl_s = ttl_s
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self.share: ShareGroup | None = None  # none: this process decides alone (one gateway process, or tests)
        self._agreeing: dict[str, asyncio.Future[None]] = {}
        self._proposed: dict[str, tuple[str, int]] = {}  # group → (replica id, size) while its claim is out

    async def agree(self, group: str, size: int | None, candidates: Callable[[], list[Replica]]) -> None:
        """Before a new member's first turn: unless this process knows the group's replica, propose one
        (`propose`) and record whichever `share` returns (ours, or the one another process recorded first). Members
        arriving together share one claim. Without `share`, or where Redis does not answer, the first member's
        placement decides here (`place`)."""
        if self.share is None or self.recorded(group) is not None:
            return
        pending = self._agreeing.get(group)
        if pending is None:
            pending = self._agreeing[group] = asyncio.ensure_future(self._claim(group, size, candidates()))
            pending.add_done_callback(lambda _: self._agreeing.pop(group, None))
        await asyncio.shield(pending)

    async def _claim(self, group: str, size: int | None, candidates: list[Replica]) -> None:
        if not candidates or self.share is None:
            return  # none serves now: the first member placed decides, once one does
        proposal = self.propose(group, candidates).id
        self._proposed[group] = (proposal, size or 1)  # reserved meanwhile: groups proposing at once spread
        try:
            recorded = await self.share(group, proposal)
        except StoreError as exc:
            logger.warning("group %s: its placement not shared with other gateway processes: %s", group, exc)
            return
        finally:
            del self._proposed[group]
        if self.recorded(group) is None:
            self.record(group, recorded, size)

    def recorded(self, group: str) -> str | None:
        """The replica id the group was placed on, if this process knows it (and it has not expired)."""
        found = self._groups.get(group)
        if found is None:
            return None
        if found.expires <= time.monotonic():
            del self._groups[group]
            return None
        return found.replica_id

    def propose(self, group: str, candidates: list[Replica]) -> Replica:
        """Where the group's first member should go: the least loaded candidate, counting members reserved by other
        new groups; ties by rendezvous of the group id, so processes that see the same loads agree."""
        key = string_key(group)
        reserved = self.reserved()
        return min(candidates, key=lambda r: (r.load + reserved.get(r.id, 0), -mix64(key ^ r.key)))

    def record(self, group: str, replica_id: str, size: int | None) -> None:
        """The group is placed on `replica_id` (chosen here or read from Redis); `size`: its members, where known
        (reserved on the replica for `RESERVE_S`, less each member placed; one where unknown)."""
        now = time.monotonic()
        self._groups[group] = _Group(replica_id, size or 1, now + RESERVE_S, now + self.ttl_s)
        self._groups.move_to_end(group)
        while len(self._groups) > self.max_groups:
            self._groups.popitem(last=False)

    def place(self, group: str, candidates: list[Replica]) -> Replica:
        """The replica of a new member of `group` (module docstring); records the group if it is new here (its
        size unknown: `agree` records it with its size first where a request says it)."""
        found = self._groups.get(group)
        if found is None or found.expires <= time.monotonic():
            chosen = self.propose(group, candidates)
            self.record(group, chosen.id, None)
            self._groups[group].to_come = 0  # this member was the one reserved
            return chosen
        found.to_come = max(0, found.to_come - 1)
        least = min(r.load for r in candidates)
        home = next((r for r in candidates if r.id == found.replica_id), None)
        if home is not None and not self.bound.loaded(home, least):
            return home
        key = string_key(group)
        return min(candidates, key=lambda r: (r.load, -mix64(key ^ r.key)))

    def reserved(self) -> dict[str, int]:
        """Members still to come of the groups placed in the last `RESERVE_S` or being agreed on, by replica id."""
        now, out = time.monotonic(), dict[str, int]()
        for replica_id, size in self._proposed.values():
            out[replica_id] = out.get(replica_id, 0) + size
        for placed in reversed(self._groups.values()):  # newest first: stop at the first group past its window
            if placed.reserve_until <= now:
                break
            if placed.to_come:
                out[placed.replica_id] = out.get(placed.replica_id, 0) + placed.to_come
        return out
