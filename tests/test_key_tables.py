"""The hashing tables built from nothing: exact word weights, P's powers and their inverses."""
from __future__ import annotations

import numpy as np

from router.key import _Tables

_P = 0x9E3779B97F4A7C15
_M = 1 << 64


def _splitmix_odd(position: int) -> int:
    z = position * _P % _M
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % _M
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % _M
    return (z ^ (z >> 31)) | 1


def test_fresh_tables_start_empty_with_the_zeroth_power():
    tables = _Tables()
    assert tables.weights.dtype == np.uint64 and tables.weights.tolist() == []
    assert tables.powers.dtype == np.uint64 and tables.powers.tolist() == [1]
    assert tables.inverses.dtype == np.uint64 and tables.inverses.tolist() == [1]


def test_word_weights_are_the_odd_splitmix_of_each_position():
    tables = _Tables()
    assert tables.word_weights(3).tolist() == [_splitmix_odd(i) for i in (1, 2, 3)]
    assert tables.word_weights(5).tolist() == [_splitmix_odd(i) for i in range(1, 6)]
    assert tables.word_weights(2).tolist() == [_splitmix_odd(i) for i in (1, 2)]
    assert len(tables.weights) == 5


def test_chain_powers_are_exact_powers_of_p_and_their_inverses():
    tables = _Tables()
    powers, inverses = tables.chain_powers(7)
    assert powers.dtype == np.uint64 and inverses.dtype == np.uint64
    assert powers.tolist() == [pow(_P, i, _M) for i in range(7)]
    assert inverses.tolist() == [pow(_P, -i, _M) for i in range(7)]
    assert len(tables.powers) == 8   # grown by doubling: 1, 2, 4, 8
    small, _ = tables.chain_powers(3)
    assert small.tolist() == [1, _P, _P * _P % _M]



def test_an_empty_block_is_hashed_with_a_zero_digest():
    from router.key import Namespace, block_hash
    root = Namespace("acme", "tiny-llama", "r1").root()
    assert block_hash(root, []) == 3925950002724158989
    assert block_hash(root, []) != block_hash(root, [0])
