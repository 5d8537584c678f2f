"""Routing: the replica pool (membership, health, load, placement, each replica's weight version), its placement
policies, replica discovery, and the watch on a request in flight on a replica."""

from gateway.routing.policies import (
    LeastLoadedPolicy,
    Policy,
    RoundRobinPolicy,
    RoutingPolicyName,
    StickyPolicy,
    make_policy,
)
from gateway.routing.pool import PROBES_TO_TAKE_OUT, AffinityStats, Lease, ReplicaPool
from gateway.routing.replica import InFlight, Replica

__all__ = [
    "PROBES_TO_TAKE_OUT",
    "AffinityStats",
    "InFlight",
    "LeastLoadedPolicy",
    "Lease",
    "Policy",
    "Replica",
    "ReplicaPool",
    "RoundRobinPolicy",
    "RoutingPolicyName",
    "StickyPolicy",
    "make_policy",
]
