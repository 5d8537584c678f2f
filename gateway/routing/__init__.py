"""Routing: the replica pool (membership, health, load, placement, each replica's weight version; a data-parallel
replica's ranks as targets of their own), its placement policies (with the prefix trees of `cache_aware`, the engine
load some read, GRPO groups placed together), replica discovery, and the watch on a request in flight on a replica."""

from gateway.routing.load import LoadBound, LoadPoller
from gateway.routing.policies import (
    Ask,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    Policy,
    RoundRobinPolicy,
    RoutingPolicyName,
    StickyLeastLoadedPolicy,
    StickyPolicy,
    make_policy,
)
from gateway.routing.pool import PROBES_TO_TAKE_OUT, AffinityStats, Lease, ReplicaPool
from gateway.routing.prefix_tree import PrefixTree
from gateway.routing.replica import Engine, EngineLoad, InFlight, Replica, rank_id

__all__ = [
    "PROBES_TO_TAKE_OUT",
    "AffinityStats",
    "Ask",
    "CacheAwarePolicy",
    "Engine",
    "EngineLoad",
    "InFlight",
    "LeastLoadedPolicy",
    "Lease",
    "LoadBound",
    "LoadPoller",
    "Policy",
    "PrefixTree",
    "Replica",
    "ReplicaPool",
    "RoundRobinPolicy",
    "RoutingPolicyName",
    "StickyLeastLoadedPolicy",
    "StickyPolicy",
    "make_policy",
    "rank_id",
]
