"""BlockTree (``router.kv.block_tree``): the held blocks' shape, exactly.

Small trees built by hand (hashes are small ints, the root a fixed one) and the exact
children, chains, prefixes, subtrees, namespace counts and token totals they answer.
"""
from __future__ import annotations

import pytest

from router.kv.block_tree import BlockTree, Entry, token_counts_for
from router.kv.key import BlockHash

ROOT = BlockHash(999)


def entry(parent: int, tokens: int = 4, namespace: str = "a") -> Entry:
    return Entry(BlockHash(parent), tokens, namespace, created=0.0, last_used=0.0, ttl_s=60.0)


def tree(*links: tuple[int, int], namespace: str = "a") -> BlockTree:
    """A tree holding each ``(block, parent)`` in the order given."""
    t = BlockTree()
    for block, parent in links:
        t.add(BlockHash(block), entry(parent, namespace=namespace))
    return t


def hs(*ints: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ints]


class TestShape:
    def test_children_are_listed_per_parent_and_the_root_counts_as_one(self):
        t = tree((1, 999), (2, 1), (3, 1), (4, 999))
        assert sorted(t.children(ROOT)) == hs(1, 4)
        assert sorted(t.children(BlockHash(1))) == hs(2, 3)
        assert t.children(BlockHash(2)) == []
        assert (t.has_children(BlockHash(1)), t.has_children(BlockHash(2))) == (True, False)

    def test_len_contains_get_and_tokens(self):
        t = BlockTree()
        t.add(BlockHash(1), entry(999, tokens=4))
        t.add(BlockHash(2), entry(1, tokens=3))
        assert (len(t), t.tokens) == (2, 7)
        assert BlockHash(2) in t and BlockHash(5) not in t
        assert t[BlockHash(2)].tokens == 3 and t.get(BlockHash(5)) is None
        assert sorted(t.entries) == hs(1, 2)

    def test_the_chain_to_a_block_runs_root_side_first(self):
        t = tree((1, 999), (2, 1), (3, 2), (7, 1))
        assert t.chain_to(BlockHash(3)) == hs(1, 2, 3)
        assert t.chain_to(BlockHash(7)) == hs(1, 7)
        assert t.chain_to(BlockHash(8)) == []

    def test_a_subtree_is_breadth_first_from_its_top(self):
        t = tree((1, 999), (2, 1), (3, 2), (4, 3))
        assert t.subtree(BlockHash(2)) == hs(2, 3, 4)
        assert t.subtree(BlockHash(4)) == hs(4)


class TestPrefixes:
    def test_a_held_run_counts_leading_hashes_by_hash_alone(self):
        t = tree((1, 999), (2, 1), (5, 999))
        assert t.held_run(hs(1, 2, 3)) == 2
        assert t.held_run(hs(1, 5, 2)) == 3  # held, whatever their parents
        assert t.held_run(hs(3, 1)) == 0

    def test_a_held_prefix_needs_each_parent_to_be_the_block_before(self):
        t = tree((1, 999), (2, 1), (3, 2), (5, 999))
        assert t.held_prefix(hs(1, 2, 3), ROOT, "a") == 3
        assert t.held_prefix(hs(1, 5), ROOT, "a") == 1   # 5 hangs off the root, not 1
        assert t.held_prefix(hs(2, 3), ROOT, "a") == 0   # 2's parent is 1, not the root
        assert t.held_prefix(hs(2, 3), BlockHash(1), "a") == 2

    def test_a_held_prefix_stops_at_another_namespace(self):
        t = tree((1, 999), (2, 1))
        t.add(BlockHash(3), entry(2, namespace="b"))
        assert t.held_prefix(hs(1, 2, 3), ROOT, "a") == 2
        assert t.held_prefix(hs(1, 2), ROOT, "b") == 0


class TestNamespaces:
    def test_each_namespace_is_counted_until_its_last_block_goes(self):
        t = tree((1, 999), (2, 1))
        t.add(BlockHash(3), entry(999, namespace="b"))
        assert t.namespaces() == ["a", "b"]
        assert sorted(t.in_namespace("a")) == hs(1, 2) and t.in_namespace("b") == hs(3)
        t.pop(BlockHash(2))
        assert t.namespaces() == ["a", "b"] and t.holds_namespace("a")
        t.pop(BlockHash(1))
        assert t.namespaces() == ["b"]
        assert not t.holds_namespace("a") and t.in_namespace("a") == []


class TestRemoval:
    def test_popping_a_leaf_returns_its_entry_and_forgets_it(self):
        t = BlockTree()
        t.add(BlockHash(1), entry(999, tokens=4))
        t.add(BlockHash(2), entry(1, tokens=3))
        t.add(BlockHash(3), entry(1, tokens=2))
        popped = t.pop(BlockHash(3))
        assert (popped.parent, popped.tokens) == (BlockHash(1), 2)
        assert (len(t), t.tokens, t.children(BlockHash(1))) == (2, 7, hs(2))
        t.pop(BlockHash(2))
        assert t.children(BlockHash(1)) == [] and not t.has_children(BlockHash(1))

    def test_popping_a_block_with_children_is_an_invariant_error(self):
        t = tree((1, 999), (2, 1))
        with pytest.raises(RuntimeError) as info:
            t.pop(BlockHash(1))
        assert str(info.value) == f"block {1:032x} removed before its children"


class TestTokenCounts:
    def test_one_block_size_is_one_count_per_block(self):
        assert token_counts_for(hs(1, 2, 3), 4) == [4, 4, 4]
        assert token_counts_for(hs(1, 2), [4, 1]) == [4, 1]

    @pytest.mark.parametrize("counts, got", [([4], 1), ([4, 0], 2), (0, 2), ([4, -1], 2)])
    def test_a_count_missing_or_not_positive_is_refused_saying_how_many(self, counts, got):
        with pytest.raises(ValueError) as info:
            token_counts_for(hs(1, 2), counts)
        assert str(info.value) == ("token_counts must be one positive count per block (or one "
                                   f"block size); got {got} counts for 2 blocks")
