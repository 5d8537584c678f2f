"""Placement policies: which serving replica a request goes to (docs/architecture.md §6).

Every policy places a session that has no replica yet (`Ask.is_new`) or whose replica stopped serving; a session
placed before follows its replica (the pool checks that before asking), except under `sticky_least_loaded`, which
is asked again at every segment whether the session stays (`rebalances`).

- `sticky` (default): rendezvous (highest-random-weight) hashing of the session id over the replicas that can
  serve, with a bounded-load rule for NEW sessions: a replica whose in-flight count is above `(1 + balance_factor)
  × mean` is skipped. HRW needs no shared state, so every gateway process agrees on placement. Reads no engine load.
- `cache_aware`: a new session goes to the replica whose prefix tree (`gateway.routing.prefix_tree`) holds the
  longest prefix of its prompt among those within the bounded load (a load not above `(1 + balance_factor) × mean`,
  or the least plus one where that is more; not loaded by `LoadBound`); equal prefixes (none included) go to the
  least loaded of them (SGLang router's `cache_aware`, with exact token ids instead of text). The bound is
  relative: under an absolute one, every session sharing a long system prompt piled onto the first replica that
  held it until that replica was far above the others (`benchmarks/routing.py`: 2-4× the turn latency).
- `sticky_least_loaded`: a new or moved session goes to the least loaded replica; a placed one stays while its
  replica is not loaded (`LoadBound`), else moves (vLLM router's sticky least-loaded).
- `least_loaded`, `round_robin`: for comparison.

Load is `Replica.load`: the engine's running and waiting requests as last read (`gateway.routing.load`, only for
the policies that say `reads_load`), blended with this process's in-flight count.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from backends.base import Load
from common.hashing import mix64
from gateway.routing.load import LoadBound, least_loaded
from gateway.routing.prefix_tree import PrefixTree, block_keys
from gateway.routing.replica import Replica

RoutingPolicyName = Literal["sticky", "cache_aware", "sticky_least_loaded", "least_loaded", "round_robin"]

__all__ = [
    "Ask",
    "CacheAwarePolicy",
    "LeastLoadedPolicy",
    "Policy",
    "RoundRobinPolicy",
    "RoutingPolicyName",
    "StickyLeastLoadedPolicy",
    "StickyPolicy",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class Ask:
    """One placement: the session's HRW key (a random one without a session), whether the session has no replica
    yet, and the prompt ids of the request (None where the caller has none to give)."""

    key: int
    is_new: bool
    prompt: Sequence[int] | None = None


class Policy(Protocol):
    reads_load: bool  # the pool reads every replica's engine load for it (`gateway.routing.load.LoadPoller`)
    rebalances: bool  # asked at every placement of a placed session whether it stays (`stays`)

    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica: ...

    def stays(self, current: Replica, candidates: list[Replica]) -> bool: ...


class _Placed:
    """What most policies share: no engine load read, and a placed session always stays."""

    reads_load = False
    rebalances = False

    def stays(self, current: Replica, candidates: list[Replica]) -> bool:
        return True


class StickyPolicy(_Placed):
    """HRW over candidates; new sessions skip replicas above (1 + ε) × mean in-flight."""

    def __init__(self, balance_factor: float) -> None:
        self.balance_factor = balance_factor

    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica:
        key = ask.key
        ranked = sorted(candidates, key=lambda r: mix64(key ^ r.key), reverse=True)
        if not ask.is_new or len(ranked) == 1:
            return ranked[0]
        limit = (1 + self.balance_factor) * (sum(r.in_flight for r in ranked) / len(ranked))
        return next((r for r in ranked if r.in_flight <= limit), ranked[0])


class LeastLoadedPolicy(_Placed):
    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica:
        key = ask.key
        return min(candidates, key=lambda r: (r.in_flight, mix64(key ^ r.key)))


class RoundRobinPolicy(_Placed):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica:
        ordered = sorted(candidates, key=lambda r: r.id)
        return ordered[next(self._counter) % len(ordered)]


class StickyLeastLoadedPolicy:
    """New and moved sessions on the least loaded replica; a placed session stays while its replica is not loaded."""

    reads_load = True
    rebalances = True

    def __init__(self, bound: LoadBound) -> None:
        self.bound = bound

    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica:
        return least_loaded(candidates, ask.key)

    def stays(self, current: Replica, candidates: list[Replica]) -> bool:
        return not self.bound.loaded(current, min(r.load for r in candidates))


class CacheAwarePolicy(_Placed):
    """The replica holding the longest prefix of the prompt among those within the bounded load, equal prefixes to
    the least loaded; the least loaded if none is within it. Keeps a `PrefixTree` per replica, fed by `sent` (every
    engine request the gateway sends) and calibrated by `on_read` (every engine load read)."""

    reads_load = True

    def __init__(self, bound: LoadBound, balance_factor: float, block_tokens: int, max_blocks: int) -> None:
        self.bound = bound
        self.balance_factor = balance_factor
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.trees: dict[str, PrefixTree] = {}
        # The keys of the last prompt seen and its partition: a placement and the request it places ask for the
        # same ones, one after the other. The prompt is held, so no other list can take its identity meanwhile.
        self._last: tuple[Sequence[int], int | None, list[int]] | None = None

    def choose(self, ask: Ask, candidates: list[Replica]) -> Replica:
        prompt = ask.prompt
        if prompt is None or len(candidates) == 1:
            return least_loaded(candidates, ask.key)
        loads = [r.load for r in candidates]
        least = min(loads)
        limit = max(least + 1, (1 + self.balance_factor) * sum(loads) / len(loads))
        key, best, best_rank = ask.key, None, (-1, 0, 0)
        for replica in candidates:
            if replica.load > limit or self.bound.loaded(replica, least):
                continue
            tree = self.trees.get(replica.id)
            depth = tree.depth(self._keys(prompt, replica.version)) if tree is not None else 0
            rank = (depth, -replica.load, mix64(key ^ replica.key))
            if rank > best_rank:
                best, best_rank = replica, rank
        return best if best is not None else least_loaded(candidates, key)

    def sent(self, replica: Replica, prompt: Sequence[int]) -> None:
        """An engine request with `prompt` went to `replica`, in the cache partition of the version it runs."""
        tree = self.trees.get(replica.id)
        if tree is None:
            tree = self.trees[replica.id] = PrefixTree(self.max_blocks)
        keys = self._keys(prompt, replica.version, whole=True)
        usable = (len(prompt) - 1) // self.block_tokens  # an engine recomputes the last token: never cached
        tree.sent(keys, min(tree.depth(keys), usable) * self.block_tokens)

    def on_read(self, replica: Replica, load: Load) -> None:
        tree = self.trees.get(replica.id)
        if tree is not None:
            tree.calibrate(load.prefix_cache_hits)

    def drop(self, replica_id: str) -> None:
        self.trees.pop(replica_id, None)

    def _keys(self, prompt: Sequence[int], partition: int | None, *, whole: bool = False) -> list[int]:
        """The chained keys of `prompt`'s blocks: those an engine could find cached (all but the last token's), or
        with `whole` every whole block (what it holds once it prefilled the prompt)."""
        size = self.block_tokens
        blocks = len(prompt) // size if whole else (len(prompt) - 1) // size
        last = self._last
        if last is not None and last[0] is prompt and last[1] == partition and len(last[2]) >= blocks:
            return last[2][:blocks]
        keys = block_keys(partition, prompt, size, len(prompt) // size)
        self._last = (prompt, partition, keys)
        return keys[:blocks]


def make_policy(
    name: RoutingPolicyName,
    balance_factor: float,
    bound: LoadBound | None = None,
    block_tokens: int = 16,
    max_blocks: int = 65_536,
) -> Policy:
    bound = bound if bound is not None else LoadBound()
    if name == "sticky":
        return StickyPolicy(balance_factor)
    if name == "cache_aware":
        return CacheAwarePolicy(bound, balance_factor, block_tokens, max_blocks)
    if name == "sticky_least_loaded":
        return StickyLeastLoadedPolicy(bound)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    return RoundRobinPolicy()
