"""GRPO siblings together (`routing.group_placement: together`, the default).

The members of one group (sessions with one `group_id`: a `grp-<group>-<index>` name, or `metadata.group_id`) share
their prompt: on one replica it is prefilled once and its KV shared, where hashing each member's own session id
spreads them and every replica prefills it. So a new member goes to the first replica, in rendezvous order of the
group id, that is not loaded (`LoadBound`: more than `routing.load_bound` requests above the least loaded, or its
KV cache full): every gateway process computes the same order, so members sent to different processes meet, and
the group spreads, in that order, only where a replica has no room. The one request of a group (`n` choices,
`group: true`) is placed as one session already. `hash` places each member by its own session id, as any session.

No state: the group's placement is a function of its id and the loads, and each member's own placement is recorded
with its session as any other's (`ReplicaPool.placements`, the session's Redis meta).
"""

from __future__ import annotations

from common.hashing import mix64
from gateway.routing.load import LoadBound
from gateway.routing.replica import Replica

__all__ = ["together"]


def together(group_key: int, candidates: list[Replica], bound: LoadBound) -> Replica | None:
    """The replica for a new member of the group `group_key` (its id's `string_key`); None where every candidate is
    loaded (its KV caches full): the member is placed as any new session."""
    least = min(r.load for r in candidates)
    for replica in sorted(candidates, key=lambda r: mix64(group_key ^ r.key), reverse=True):
        if not bound.loaded(replica, least):
            return replica
    return None
