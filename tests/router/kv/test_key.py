"""The cache key at its edges: namespace fields kept apart, exact block boundaries, the suffix cap.
"""
from __future__ import annotations

import os
import subprocess
import sys
import pytest
from router.kv.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from router.kv.key import (BlockIdentity, CacheSecret, Namespace, block_hash, hash_blocks,
                           identities, reusable_tokens)
from array import array


NS = Namespace(tenant="acme", model="tiny-llama", revision="r1")


class TestBehaviour:
    def test_chain_covers_parent_and_tokens(self):
        hashes = hash_blocks(list(range(40)), 16, NS)
        assert len(hashes) == 2  # the partial tail of 8 tokens is not hashed
        assert hashes[0] == block_hash(NS.root(), range(16))
        assert hashes[1] == block_hash(hashes[0], range(16, 32))
        assert hash_blocks([1] + list(range(1, 40)), 16, NS)[1] != hashes[1]

    def test_namespace_is_part_of_every_key(self):
        tokens = list(range(64))
        other_tenant = Namespace(tenant="globex", model="tiny-llama", revision="r1")
        other_revision = Namespace(tenant="acme", model="tiny-llama", revision="r2")
        mine = set(hash_blocks(tokens, 16, NS))
        assert mine.isdisjoint(hash_blocks(tokens, 16, other_tenant))
        assert mine.isdisjoint(hash_blocks(tokens, 16, other_revision))

    def test_hash_is_stable_across_processes_and_hash_seeds(self):
        code = ("from router.kv.key import Namespace, hash_blocks;"
                "print(hash_blocks(list(range(100)), 16, Namespace('acme','tiny-llama','r1'))[-1])")
        outputs = set()
        for seed in ("1", "12345"):
            env = dict(os.environ, PYTHONHASHSEED=seed)
            out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                 capture_output=True, text=True).stdout.strip()
            outputs.add(out)
        assert outputs == {str(hash_blocks(list(range(100)), 16, NS)[-1])}

    def test_bad_input_is_a_value_error(self):
        with pytest.raises(ValueError, match="block_size"):
            hash_blocks([1, 2, 3], 0, NS)
        with pytest.raises(ValueError, match="token ids"):
            hash_blocks([-1] * 16, 16, NS)

    def test_reusable_tokens_always_leaves_a_suffix(self):
        assert reusable_tokens(prompt_len=32, matched_blocks=2, block_size=16) == 31
        assert reusable_tokens(prompt_len=40, matched_blocks=2, block_size=16) == 32
        assert reusable_tokens(prompt_len=1, matched_blocks=0, block_size=16) == 0

    def test_event_batch_round_trips_through_msgpack(self):
        h = hash_blocks(list(range(32)), 16, NS)
        batch = EventBatch("w0", 7, (BlockStored(h[1], h[0], 16, NS.label()), BlockRemoved(h[0], NS.label())))
        assert decode_batch(encode_batch(batch)) == batch
        with pytest.raises(ValueError, match="malformed"):
            decode_batch(b"\x93\x01")

    def test_hash_values_are_pinned_and_equal_from_a_list_or_a_buffer(self):
        import numpy as np
        from array import array

        # The cache key must not move between releases: router and workers of two versions share it.
        first, last = 131787574816592137532233729878316044690, 46044941595271819160590813093171433529
        for tokens in (list(range(100)), array("I", range(100)), np.arange(100, dtype=np.uint32),
                       memoryview(array("I", range(100))), np.arange(100, dtype=np.int64)):
            hashes = hash_blocks(tokens, 16, NS)
            assert (len(hashes), hashes[0], hashes[-1]) == (6, first, last)
        big = hash_blocks(np.arange(1024, dtype=np.uint32), 512, NS)
        assert big[-1] == 319547859412077813212946138576845728989
        # a strided view is not one contiguous buffer: it is read item by item, same hashes
        assert hash_blocks(np.arange(200, dtype=np.uint32)[::2], 16, NS) == \
            hash_blocks(list(range(0, 200, 2)), 16, NS)

    def test_a_signed_buffer_with_a_negative_id_is_a_value_error(self):
        import numpy as np

        with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
            hash_blocks(np.full(16, -1, dtype=np.int32), 16, NS)


ROOT_ACME = 143368105513921563379075562956746078729

ROOT_ACME_LORA = 186793725950951311661457717394083250194

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


class TestExact:
    def test_namespace_fields_are_hashed_with_a_separator(self):
        # tenant "ab" + model "c" must not be tenant "a" + model "bc" (nor any other regrouping)
        roots = {Namespace("ab", "c").root(), Namespace("a", "bc").root(),
                 Namespace("a", "b", "c").root(), Namespace("a", "b", "", "c").root(),
                 Namespace("abc", "").root()}
        assert len(roots) == 5

    @pytest.mark.parametrize("field", ["tenant", "model", "revision", "adapter"])
    def test_a_nul_in_a_namespace_field_is_a_value_error(self, field):
        values = dict(tenant="t", model="m", revision="r", adapter="a")
        values[field] = "x\x00y"
        with pytest.raises(ValueError) as info:
            Namespace(**values)
        assert str(info.value) == f"namespace {field} 'x\\x00y' contains a NUL character; remove it"

    def test_the_root_is_pinned(self):
        # The value of every cache key below depends on this: it must not move between releases.
        assert Namespace("acme", "tiny-llama", "r1").root() == ROOT_ACME
        assert Namespace("acme", "tiny-llama", "r1", "lora").root() == ROOT_ACME_LORA

    def test_the_root_is_the_keyed_blake2b_of_the_fields(self):
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

    def test_a_cluster_secret_moves_every_block_hash(self):
        tokens = list(range(64))
        plain = hash_blocks(tokens, 16, Namespace("acme", "m"))
        keyed = hash_blocks(tokens, 16, Namespace("acme", "m", secret=b"k" * 32))
        other = hash_blocks(tokens, 16, Namespace("acme", "m", secret=b"j" * 32))
        assert len(set(plain) | set(keyed) | set(other)) == 12

    def test_the_secret_never_shows_in_a_repr_or_a_label(self):
        ns = Namespace("acme", "m", secret=b"very-secret-bytes")
        assert "very-secret" not in repr(ns) and ns.label() == "acme/m"

    def test_a_secret_longer_than_blake2b_takes_is_a_value_error(self):
        with pytest.raises(ValueError, match="a cache secret is at most 64 bytes, got 65"):
            Namespace("t", "m", secret=b"x" * 65)
        assert Namespace("t", "m", secret=b"x" * 64).root() != Namespace("t", "m").root()

    def test_label_joins_only_the_fields_that_are_set(self):
        assert Namespace("t", "m").label() == "t/m"
        assert Namespace("t", "m", "r").label() == "t/m/r"
        assert Namespace("t", "m", adapter="a").label() == "t/m/a"
        assert Namespace("t", "m", "r", "a").label() == "t/m/r/a"

    def test_a_slash_inside_a_field_is_escaped_so_one_label_is_one_namespace(self):
        assert Namespace("a/b", "c").label() == "a%2Fb/c"
        assert Namespace("50%", "c").label() == "50%25/c"

    def test_a_field_without_a_slash_or_percent_is_shown_as_it_is(self):
        assert Namespace("team a:1", "m?x", "r#1").label() == "team a:1/m?x/r#1"
        assert Namespace("a", "b/c").label() == "a/b%2Fc"
        assert Namespace("a%2Fb", "c").label() == "a%252Fb/c"

    def test_a_prompt_of_exactly_one_block_has_one_hash(self):
        ns = Namespace("t", "m")
        assert hash_blocks(list(range(16)), 16, ns) == [block_hash(ns.root(), range(16))]
        assert hash_blocks(list(range(15)), 16, ns) == []
        assert hash_blocks(list(range(32)), 16, ns)[1] == block_hash(
            block_hash(ns.root(), range(16)), range(16, 32))
        assert hash_blocks([], 16, ns) == []

    def test_token_ids_span_exactly_the_uint32_range(self):
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
    def test_reusable_tokens_leaves_exactly_one_token_to_compute(self, prompt_len, matched, expected):
        assert reusable_tokens(prompt_len, matched, 16) == expected

    def test_any_sequence_or_buffer_of_ids_gives_the_list_hashes(self):
        from collections import deque

        ns = Namespace("t", "m")
        expected = hash_blocks(list(range(32)), 16, ns)
        assert hash_blocks(deque(range(32)), 16, ns) == expected      # a sequence, not a buffer
        assert hash_blocks(array("L", range(32)), 16, ns) == expected  # 8-byte items on Linux
        assert hash_blocks(tuple(range(32)), 16, ns) == expected
        assert hash_blocks(list(range(3)), 1, ns) == [
            block_hash(ns.root(), [0]), block_hash(block_hash(ns.root(), [0]), [1]),
            block_hash(block_hash(block_hash(ns.root(), [0]), [1]), [2])]

    @pytest.mark.parametrize("block_size", [1, 3, 16, 512])
    def test_all_blocks_at_once_equal_the_chain_one_block_at_a_time(self, block_size):
        import random

        rng = random.Random(block_size)
        tokens = [rng.randrange(2**32) for _ in range(block_size * 9 + 1)]
        ns = Namespace("acme", "tiny-llama", "r1")
        assert hash_blocks(tokens, block_size, ns) == _reference_hashes(tokens, block_size, ROOT_ACME)

    def test_a_short_block_is_not_its_zero_padded_twin(self):
        ns = Namespace("t", "m")
        assert block_hash(ns.root(), [7]) != block_hash(ns.root(), [7, 0])
        assert hash_blocks([7, 0], 1, ns)[0] == block_hash(ns.root(), [7])

    def test_equal_tokens_under_two_namespaces_differ_at_every_block(self):
        tokens = list(range(64 * 16))
        a = hash_blocks(tokens, 16, Namespace("a", "m"))
        b = hash_blocks(tokens, 16, Namespace("b", "m"))
        assert all(x != y for x, y in zip(a, b)) and len(a) == 64


class TestSalt:
    """``cache_salt`` enters the root beside the tenant: different salts never share a block."""

    def test_the_salted_root_is_the_keyed_blake2b_of_the_fields_and_the_salt(self):
        import hashlib

        secret = bytes(range(32))
        salted = Namespace("acme", "tiny-llama", "r1", secret=secret, salt="team-7")
        data = (b"orchard-ns\x00" + b"\x00".join([b"acme", b"tiny-llama", b"r1", b""])
                + b"\x00salt\x00team-7")
        digest = hashlib.blake2b(data, key=secret, digest_size=16).digest()
        assert salted.root() == int.from_bytes(digest, "little")

    def test_an_empty_salt_leaves_the_root_pinned(self):
        assert Namespace("acme", "tiny-llama", "r1", salt="").root() == ROOT_ACME

    def test_different_salts_share_no_block_hash(self):
        tokens = list(range(64))
        chains = [hash_blocks(tokens, 16, Namespace("acme", "tiny-llama", "r1", salt=s))
                  for s in ("", "alice", "bob")]
        assert len({h for c in chains for h in c}) == 12  # 3 salts x 4 blocks, none shared
        assert chains[1] == hash_blocks(tokens, 16, Namespace("acme", "tiny-llama", "r1",
                                                              salt="alice"))

    def test_a_salt_never_shows_in_a_label_or_a_repr(self):
        ns = Namespace("acme", "tiny-llama", salt="private-salt")
        assert ns.label() == "acme/tiny-llama"
        assert "private-salt" not in repr(ns)

    def test_a_salt_over_256_bytes_is_a_value_error(self):
        Namespace("acme", "m", salt="é" * 128)  # 256 bytes: the limit
        with pytest.raises(ValueError, match="a cache salt is at most 256 bytes, got 258"):
            Namespace("acme", "m", salt="é" * 129)


class TestIdentities:
    """What each block of a chain stands for (``identities``), and the secret file's checks."""

    TOKENS = list(range(48))  # three blocks of 16

    def _chain(self):
        return hash_blocks(self.TOKENS, 16, NS)

    def test_every_block_from_the_first_by_default(self):
        hashes = self._chain()
        assert identities(NS, hashes, self.TOKENS, 16) == [
            BlockIdentity("acme/tiny-llama/r1", NS.root(), 0, tuple(range(0, 16))),
            BlockIdentity("acme/tiny-llama/r1", hashes[0], 1, tuple(range(16, 32))),
            BlockIdentity("acme/tiny-llama/r1", hashes[1], 2, tuple(range(32, 48))),
        ]

    def test_start_and_stop_pick_the_blocks_between(self):
        hashes = self._chain()
        assert identities(NS, hashes, self.TOKENS, 16, start=1) == [
            BlockIdentity("acme/tiny-llama/r1", hashes[0], 1, tuple(range(16, 32))),
            BlockIdentity("acme/tiny-llama/r1", hashes[1], 2, tuple(range(32, 48))),
        ]
        assert identities(NS, hashes, self.TOKENS, 16, start=1, stop=2) == [
            BlockIdentity("acme/tiny-llama/r1", hashes[0], 1, tuple(range(16, 32)))]

    def test_a_secret_file_of_the_wrong_length_names_its_fix(self, tmp_path):
        path = tmp_path / CacheSecret.NAME
        path.write_bytes(b"short")
        path.chmod(0o600)
        with pytest.raises(ValueError) as refused:
            CacheSecret.load_or_create(tmp_path)
        assert str(refused.value) == (
            f"{path} holds 5 bytes, not a 32-byte cache secret: delete it to make a new one "
            "(the cache restarts cold)")
