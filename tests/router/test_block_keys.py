"""``router.block_keys``: a block's table key and its two buckets, exactly."""
from __future__ import annotations

import numpy as np

from router.block_keys import GOLDEN, homes_of, key_of, keys_of


def test_a_keys_first_bucket_is_from_its_high_half_and_its_second_from_its_low_half():
    key = (0x80000000 << 32) | 0x40000000      # high half 1/2 of 2**32, low half 1/4
    homes = homes_of(np.array([key, 0xFFFFFFFF_00000000], np.uint64), 1000)
    assert homes.tolist() == [[250, 500], [0, 999]]


def test_keys_are_the_hash_times_golden_modulo_2_64_and_never_0():
    blocks = [1, 2, 12345, 0]
    assert keys_of(blocks).tolist() == [GOLDEN, (2 * GOLDEN) % 2**64,
                                        (12345 * GOLDEN) % 2**64, 1]
    assert [key_of(b) for b in blocks] == keys_of(blocks).tolist()
