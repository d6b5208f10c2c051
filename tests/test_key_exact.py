"""The cache key at its edges: namespace fields kept apart, exact block boundaries, the suffix cap."""
from __future__ import annotations

from array import array

import pytest

from router.key import Namespace, block_hash, hash_blocks, reusable_tokens

ROOT_ACME = 130001185748377756834134243796726239182
ROOT_ACME_LORA = 86573135402028660719180029603875124807


def test_namespace_fields_are_hashed_with_a_separator():
    # tenant "ab" + model "c" must not be tenant "a" + model "bc" (nor any other regrouping)
    roots = {Namespace("ab", "c").root(), Namespace("a", "bc").root(),
             Namespace("a", "b", "c").root(), Namespace("a", "b", "", "c").root(),
             Namespace("abc", "").root()}
    assert len(roots) == 5


@pytest.mark.parametrize("field", ["tenant", "model", "revision", "adapter"])
def test_a_nul_in_a_namespace_field_is_a_value_error(field):
    values = dict(tenant="t", model="m", revision="r", adapter="a")
    values[field] = "x\x00y"
    with pytest.raises(ValueError) as info:
        Namespace(**values)
    assert str(info.value) == f"namespace {field} 'x\\x00y' contains a NUL character; remove it"


def test_the_root_is_pinned():
    # The value of every cache key below depends on this: it must not move between releases.
    assert Namespace("acme", "tiny-llama", "r1").root() == ROOT_ACME
    assert Namespace("acme", "tiny-llama", "r1", "lora").root() == ROOT_ACME_LORA


def test_label_joins_only_the_fields_that_are_set():
    assert Namespace("t", "m").label() == "t/m"
    assert Namespace("t", "m", "r").label() == "t/m/r"
    assert Namespace("t", "m", adapter="a").label() == "t/m/a"
    assert Namespace("t", "m", "r", "a").label() == "t/m/r/a"


def test_a_prompt_of_exactly_one_block_has_one_hash():
    ns = Namespace("t", "m")
    assert hash_blocks(list(range(16)), 16, ns) == [block_hash(ns.root(), range(16))]
    assert hash_blocks(list(range(15)), 16, ns) == []
    assert hash_blocks(list(range(32)), 16, ns)[1] == block_hash(
        block_hash(ns.root(), range(16)), range(16, 32))
    assert hash_blocks([], 16, ns) == []


def test_token_ids_span_exactly_the_uint32_range():
    ns = Namespace("t", "m")
    top = 2**32 - 1
    assert hash_blocks([top] * 4, 4, ns) == hash_blocks(array("I", [top] * 4), 4, ns)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        hash_blocks([2**32] * 4, 4, ns)
    with pytest.raises(ValueError, match="block_size must be positive, got -1"):
        hash_blocks([1] * 4, -1, ns)


@pytest.mark.parametrize("prompt_len, matched, expected", [
    (32, 2, 31),   # fully cached whole blocks: one token is left to compute
    (33, 2, 32),   # a partial tail: every matched token is reused
    (32, 1, 16),
    (1, 1, 0),
    (0, 0, 0),     # an empty prompt reuses nothing (never a negative count)
])
def test_reusable_tokens_leaves_exactly_one_token_to_compute(prompt_len, matched, expected):
    assert reusable_tokens(prompt_len, matched, 16) == expected


def test_any_sequence_or_buffer_of_ids_gives_the_list_hashes():
    from collections import deque

    ns = Namespace("t", "m")
    expected = hash_blocks(list(range(32)), 16, ns)
    assert hash_blocks(deque(range(32)), 16, ns) == expected      # a sequence, not a buffer
    assert hash_blocks(array("L", range(32)), 16, ns) == expected  # 8-byte items on Linux
    assert hash_blocks(tuple(range(32)), 16, ns) == expected
    assert hash_blocks(list(range(3)), 1, ns) == [
        block_hash(ns.root(), [0]), block_hash(block_hash(ns.root(), [0]), [1]),
        block_hash(block_hash(block_hash(ns.root(), [0]), [1]), [2])]
