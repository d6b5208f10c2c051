"""The cache key at its edges: namespace fields kept apart, exact block boundaries, the suffix cap."""
from __future__ import annotations

from array import array

import pytest

from router.kv.key import Namespace, block_hash, hash_blocks, reusable_tokens

ROOT_ACME = 143368105513921563379075562956746078729
ROOT_ACME_LORA = 186793725950951311661457717394083250194


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


def test_the_root_is_the_keyed_blake2b_of_the_fields():
    import hashlib

    def reference(secret, *fields):
        data = b"orchard-ns\x00" + b"\x00".join(f.encode() for f in fields)
        digest = hashlib.blake2b(data, key=secret, digest_size=16).digest()
        return int.from_bytes(digest, "little")

    assert ROOT_ACME == reference(b"", "acme", "tiny-llama", "r1", "")
    secret = bytes(range(32))
    keyed = Namespace("acme", "tiny-llama", "r1", secret=secret)
    assert keyed.root() == reference(secret, "acme", "tiny-llama", "r1", "")
    assert keyed.root() != ROOT_ACME


def test_a_cluster_secret_moves_every_block_hash():
    tokens = list(range(64))
    plain = hash_blocks(tokens, 16, Namespace("acme", "m"))
    keyed = hash_blocks(tokens, 16, Namespace("acme", "m", secret=b"k" * 32))
    other = hash_blocks(tokens, 16, Namespace("acme", "m", secret=b"j" * 32))
    assert len(set(plain) | set(keyed) | set(other)) == 12


def test_the_secret_never_shows_in_a_repr_or_a_label():
    ns = Namespace("acme", "m", secret=b"very-secret-bytes")
    assert "very-secret" not in repr(ns) and ns.label() == "acme/m"


def test_a_secret_longer_than_blake2b_takes_is_a_value_error():
    with pytest.raises(ValueError, match="a cache secret is at most 64 bytes, got 65"):
        Namespace("t", "m", secret=b"x" * 65)


def test_label_joins_only_the_fields_that_are_set():
    assert Namespace("t", "m").label() == "t/m"
    assert Namespace("t", "m", "r").label() == "t/m/r"
    assert Namespace("t", "m", adapter="a").label() == "t/m/a"
    assert Namespace("t", "m", "r", "a").label() == "t/m/r/a"


def test_a_slash_inside_a_field_is_escaped_so_one_label_is_one_namespace():
    assert Namespace("a/b", "c").label() == "a%2Fb/c"
    assert Namespace("a", "b/c").label() == "a/b%2Fc"
    assert Namespace("a%2Fb", "c").label() == "a%252Fb/c"


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


def _reference_hashes(tokens, block_size, root):
    """The key's formula written out with struct and xxhash, one block after another."""
    import struct

    import xxhash

    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start:start + block_size])
        digest = xxhash.xxh3_128_digest(parent.to_bytes(16, "little") + block)
        parent = int.from_bytes(digest, "little")
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("block_size", [1, 3, 16, 512])
def test_all_blocks_at_once_equal_the_chain_one_block_at_a_time(block_size):
    import random

    rng = random.Random(block_size)
    tokens = [rng.randrange(2**32) for _ in range(block_size * 9 + 1)]
    ns = Namespace("acme", "tiny-llama", "r1")
    assert hash_blocks(tokens, block_size, ns) == _reference_hashes(tokens, block_size, ROOT_ACME)


def test_a_short_block_is_not_its_zero_padded_twin():
    ns = Namespace("t", "m")
    assert block_hash(ns.root(), [7]) != block_hash(ns.root(), [7, 0])
    assert hash_blocks([7, 0], 1, ns)[0] == block_hash(ns.root(), [7])


def test_equal_tokens_under_two_namespaces_differ_at_every_block():
    tokens = list(range(64 * 16))
    a = hash_blocks(tokens, 16, Namespace("a", "m"))
    b = hash_blocks(tokens, 16, Namespace("b", "m"))
    assert all(x != y for x, y in zip(a, b)) and len(a) == 64
