"""What each replica's prefix cache likely holds: the token ids the gateway sent it (policy `cache_aware`).

Per replica, a tree of whole blocks of prompt ids (`routing.prefix_block_tokens` each), stored flat as the engines
store theirs (vLLM's block hashes, SGLang's radix tree by pages): a block's key is the hash of its ids chained to
its parent's key, so a prompt's path is the chain of its blocks' keys and its longest cached prefix is the run of
leading keys present. The chain starts from the request's cache partition, the weight version its cache salt names
(`gateway.weights.labels.cache_salt`; without a salt every update flushes the engines' caches, so they hold one
version's prefixes then too): prefixes sent under other weights never match.

Bounded: each tree holds `routing.prefix_max_blocks` blocks at most and forgets the least recently sent first,
a block's descendants before it (a chain is touched from its end back to its root, as an engine frees blocks). It
also follows its engine (`calibrate`, at each load read): where the engine reports fewer prefix-cache hits than the
tree predicted for the requests sent since the last read, the engine evicted what the tree still holds, and the
tree shrinks by that ratio (it grows back while predictions hold); an engine whose counters went down restarted
with an empty cache, and so does its tree.

Keys are Python's `hash` of int tuples: the same in every process, but a tree lives in one process and nothing
compares keys across processes (a rare collision costs one placement, never a wrong token).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["MIN_BLOCKS", "PrefixTree", "block_keys"]

MIN_BLOCKS = 64
"""The fewest blocks calibration shrinks a tree to: an engine that evicts everything still keeps the newest few."""

SHORTFALL = 0.5
"""Calibration shrinks a tree only where the engine reported less than this share of the hits it predicted: a
request sent just before a read is counted by the engine at its prefill, after the read."""


def block_keys(partition: int | None, ids: Sequence[int], block_tokens: int, blocks: int) -> list[int]:
    """The chained keys of the first `blocks` whole blocks of `ids` in cache partition `partition`."""
    keys = []
    key = hash(("rg-prefix", partition))
    for start in range(0, blocks * block_tokens, block_tokens):
        key = hash((key, *ids[start : start + block_tokens]))
        keys.append(key)
    return keys


class PrefixTree:
    """The blocks sent to one replica, most recently sent last."""

    __slots__ = ("_blocks", "_hits", "capacity", "expected", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.capacity = max_blocks  # max_blocks, or less where the engine keeps less (`calibrate`)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.expected = 0  # prompt tokens predicted cached for the requests sent since the last read
        self._hits: float | None = None  # the engine's prefix-cache hit counter at the last read

    def __len__(self) -> int:
        return len(self._blocks)

    def depth(self, keys: Sequence[int]) -> int:
        """How many of the leading `keys` the tree holds."""
        blocks = self._blocks
        for index, key in enumerate(keys):
            if key not in blocks:
                return index
        return len(keys)

    def sent(self, keys: Sequence[int], expected_tokens: int) -> None:
        """A request whose prompt's whole blocks are `keys` went to the replica, `expected_tokens` of it predicted
        cached: the engine holds every block now, the deepest least likely to stay."""
        self.expected += expected_tokens
        blocks = self._blocks
        for key in reversed(keys):
            blocks[key] = None
            blocks.move_to_end(key)
        self._trim()

    def calibrate(self, hits: float | None) -> None:
        """Follow the engine's prefix-cache hit counter `hits` (None: not reported), read now."""
        previous, self._hits = self._hits, hits
        expected, self.expected = self.expected, 0
        if hits is None or previous is None:
            return
        reported = hits - previous
        if reported < 0:  # the counter went back: the engine restarted, its cache empty
            self._blocks.clear()
            self.capacity = self.max_blocks
        elif expected and reported < expected * SHORTFALL:
            self.capacity = max(MIN_BLOCKS, min(self.capacity, int(len(self._blocks) * reported / expected)))
            self._trim()
        elif expected:
            self.capacity = min(self.max_blocks, self.capacity * 2)

    def clear(self) -> None:
        self._blocks.clear()

    def _trim(self) -> None:
        blocks = self._blocks
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
