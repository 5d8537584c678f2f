"""`gateway.routing.prefix_tree`: what a replica's prefix cache likely holds, bounded, and following its engine."""

from __future__ import annotations

from gateway.routing.prefix_tree import MIN_BLOCKS, PrefixTree, block_keys

BLOCK = 4


def keys(ids: list[int], partition: int | None = 1) -> list[int]:
    return block_keys(partition, ids, BLOCK, len(ids) // BLOCK)


def test_the_longest_prefix_in_whole_blocks_and_per_partition() -> None:
    tree = PrefixTree(100)
    sent = list(range(12))
    tree.sent(keys(sent), 0)
    assert len(tree) == 3
    assert tree.depth(keys(sent[:8] + [99, 98, 97, 96])) == 2
    assert tree.depth(keys([99, *sent[1:]])) == 0  # a block's key is chained to its parent's
    assert tree.depth(keys(sent, partition=2)) == 0  # sent under other weights: never a match


def test_the_least_recently_sent_goes_first_descendants_before_their_root() -> None:
    tree = PrefixTree(4)
    a, b = list(range(12)), list(range(100, 108))
    tree.sent(keys(a), 0)
    tree.sent(keys(b), 0)  # 5 blocks for 4: a's deepest goes
    assert tree.depth(keys(a)) == 2 and tree.depth(keys(b)) == 2
    tree.sent(keys(a[:4]), 0)  # a's root used again
    tree.sent(keys(list(range(200, 204))), 0)  # a's second block goes (older than b's, its root was touched)
    assert tree.depth(keys(a)) == 1 and tree.depth(keys(b)) == 2


def test_calibration_follows_the_engines_hit_counter() -> None:
    tree = PrefixTree(1000)
    for start in range(0, 400, 4):
        tree.sent(keys(list(range(start + 10_000, start + 10_012))), 0)
    assert len(tree) == 300
    tree.calibrate(0.0)  # the first read: nothing to compare
    tree.sent(keys(list(range(10_000, 10_012))), 8)
    tree.calibrate(1.0)  # the engine found 1 of the 8 predicted: it keeps far less than the tree
    assert tree.capacity == max(MIN_BLOCKS, 300 // 8) and len(tree) == tree.capacity
    tree.sent([], 8)
    tree.calibrate(9.0)  # predictions hold again: room grows back
    assert tree.capacity == 2 * max(MIN_BLOCKS, 300 // 8)
    tree.calibrate(2.0)  # the counter went back: the engine restarted, its cache empty
    assert len(tree) == 0 and tree.capacity == 1000
