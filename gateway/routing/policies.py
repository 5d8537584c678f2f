"""Placement policies: which serving replica a request goes to.

Policy `sticky` is rendezvous (highest-random-weight) hashing of the session id over the replicas that can serve,
with a bounded-load rule for NEW sessions: a replica whose in-flight count is above `(1 + balance_factor) × mean` is
skipped. Because HRW needs no shared state, every gateway process agrees on placement; a session's later turns
follow its recorded replica and move only when that replica leaves or fails.
"""

from __future__ import annotations

import itertools
from typing import Literal, Protocol

from common.hashing import mix64
from gateway.routing.replica import Replica

RoutingPolicyName = Literal["sticky", "least_loaded", "round_robin"]


class Policy(Protocol):
    def choose(self, session_key: int, candidates: list[Replica], is_new: bool) -> Replica: ...


class StickyPolicy:
    """HRW over candidates; new sessions skip replicas above (1 + ε) × mean in-flight."""

    def __init__(self, balance_factor: float) -> None:
        self.balance_factor = balance_factor

    def choose(self, session_key: int, candidates: list[Replica], is_new: bool) -> Replica:
        ranked = sorted(candidates, key=lambda r: mix64(session_key ^ r.key), reverse=True)
        if not is_new or len(ranked) == 1:
            return ranked[0]
        limit = (1 + self.balance_factor) * (sum(r.in_flight for r in ranked) / len(ranked))
        return next((r for r in ranked if r.in_flight <= limit), ranked[0])


class LeastLoadedPolicy:
    def choose(self, session_key: int, candidates: list[Replica], is_new: bool) -> Replica:
        return min(candidates, key=lambda r: (r.in_flight, mix64(session_key ^ r.key)))


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, session_key: int, candidates: list[Replica], is_new: bool) -> Replica:
        ordered = sorted(candidates, key=lambda r: r.id)
        return ordered[next(self._counter) % len(ordered)]


def make_policy(name: RoutingPolicyName, balance_factor: float) -> Policy:
    if name == "sticky":
        return StickyPolicy(balance_factor)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    return RoundRobinPolicy()
