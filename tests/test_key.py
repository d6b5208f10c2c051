import os
import subprocess
import sys

import pytest

from router.kv.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from router.kv.key import Namespace, block_hash, hash_blocks, reusable_tokens

NS = Namespace(tenant="acme", model="tiny-llama", revision="r1")


def test_chain_covers_parent_and_tokens():
    hashes = hash_blocks(list(range(40)), 16, NS)
    assert len(hashes) == 2  # the partial tail of 8 tokens is not hashed
    assert hashes[0] == block_hash(NS.root(), range(16))
    assert hashes[1] == block_hash(hashes[0], range(16, 32))
    assert hash_blocks([1] + list(range(1, 40)), 16, NS)[1] != hashes[1]


def test_namespace_is_part_of_every_key():
    tokens = list(range(64))
    other_tenant = Namespace(tenant="globex", model="tiny-llama", revision="r1")
    other_revision = Namespace(tenant="acme", model="tiny-llama", revision="r2")
    mine = set(hash_blocks(tokens, 16, NS))
    assert mine.isdisjoint(hash_blocks(tokens, 16, other_tenant))
    assert mine.isdisjoint(hash_blocks(tokens, 16, other_revision))


def test_hash_is_stable_across_processes_and_hash_seeds():
    code = ("from router.kv.key import Namespace, hash_blocks;"
            "print(hash_blocks(list(range(100)), 16, Namespace('acme','tiny-llama','r1'))[-1])")
    outputs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        outputs.add(out)
    assert outputs == {str(hash_blocks(list(range(100)), 16, NS)[-1])}


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2, 3], 0, NS)
    with pytest.raises(ValueError, match="token ids"):
        hash_blocks([-1] * 16, 16, NS)


def test_reusable_tokens_always_leaves_a_suffix():
    assert reusable_tokens(prompt_len=32, matched_blocks=2, block_size=16) == 31
    assert reusable_tokens(prompt_len=40, matched_blocks=2, block_size=16) == 32
    assert reusable_tokens(prompt_len=1, matched_blocks=0, block_size=16) == 0


def test_event_batch_round_trips_through_msgpack():
    h = hash_blocks(list(range(32)), 16, NS)
    batch = EventBatch("w0", 7, (BlockStored(h[1], h[0], 16, NS.label()), BlockRemoved(h[0], NS.label())))
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(ValueError, match="malformed"):
        decode_batch(b"\x93\x01")


def test_hash_values_are_pinned_and_equal_from_a_list_or_a_buffer():
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


def test_a_signed_buffer_with_a_negative_id_is_a_value_error():
    import numpy as np

    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        hash_blocks(np.full(16, -1, dtype=np.int32), 16, NS)
