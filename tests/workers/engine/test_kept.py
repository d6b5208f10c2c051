"""Kept caches (``workers.engine.kept``): what is kept, handed over, superseded and evicted, exactly;
and the engine's next turn extending a kept cache computes what a join (and no store) does."""
from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.model.forge import ForgeSpec, forge
from workers.engine.kept import KeptCaches, KeptStats
from workers.messages import GenerateRequest, SamplingParams

BS = 16
LAYERS, HEADS, DIM = 2, 2, 4
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # K and V, float32: 128 bytes a token


def _cache(tokens: int, fill: float = 1.0) -> list[KVCache]:
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        c.state = (mx.full((1, HEADS, tokens, DIM), fill), mx.full((1, HEADS, tokens, DIM), fill),
                   tokens)
        caches.append(c)
    return caches


def test_take_hands_over_the_cache_cut_to_the_matched_tokens():
    kept = KeptCaches(1 << 20)
    assert kept.keep("a", list(range(10)), _cache(10, fill=3.0))
    assert kept.take("a", list(range(8)) + [99, 98], 9) is None  # token 8 differs
    assert kept.take("b", list(range(12)), 8) is None            # another namespace
    assert kept.take("a", list(range(12)), 11) is None           # holds only 10 tokens
    got, held = kept.take("a", list(range(12)), 8)
    assert held == 8 and [c.offset for c in got] == [8, 8]
    assert got[0].keys.shape == (1, HEADS, 10, DIM)  # the buffer, extended in place later
    keys, _ = got[0].update_and_fetch(mx.zeros((1, HEADS, 3, DIM)), mx.zeros((1, HEADS, 3, DIM)))
    assert keys.shape == (1, HEADS, 11, DIM)
    assert keys[0, 0, :, 0].tolist() == [3.0] * 8 + [0.0] * 3
    assert kept.take("a", list(range(12)), 8) is None  # handed over, not shared
    assert kept.stats() == KeptStats(0, 0, 1 << 20, 1, 0)


def test_the_tail_past_the_stores_match_is_taken_only_within_the_next_block():
    kept = KeptCaches(1 << 20)
    tokens = list(range(40))
    # parts from the prompt 5 tokens past a 16-token match: the tail of 5 comes along
    kept.keep("a", tokens, _cache(40))
    got, held = kept.take("a", tokens[:21] + [99] * 10, 16, block_size=16)
    assert held == 21 and [c.offset for c in got] == [21, 21]
    # a whole block past the match still in common: the store lacks a block it holds
    kept.keep("a", tokens, _cache(40))
    assert kept.take("a", tokens[:32] + [99], 16, block_size=16)[1] == 16
    # 15 past the match (one short of a block): taken
    kept.keep("a", tokens, _cache(40))
    assert kept.take("a", tokens[:31] + [99], 16, block_size=16)[1] == 31
    # the prompt's last token is always computed, even when the kept cache holds it
    kept.keep("a", tokens, _cache(40))
    assert kept.take("a", tokens[:20], 16, block_size=16)[1] == 19
    # the kept cache ends inside the tail: all of it
    kept.keep("a", tokens[:18], _cache(18))
    assert kept.take("a", tokens[:30], 16, block_size=16)[1] == 18
    # block size 1 (the default): exactly the store's match
    kept.keep("a", tokens, _cache(40))
    assert kept.take("a", tokens[:30], 16)[1] == 16


def test_a_later_turn_supersedes_the_older_one_and_eviction_goes_oldest_first():
    kept = KeptCaches(30 * TOKEN_BYTES)
    assert kept.keep("a", [1, 2, 3, 4], _cache(4))
    assert kept.keep("a", [1, 2, 3, 4, 5, 6], _cache(6))  # the same conversation, later
    assert kept.stats() == KeptStats(1, 6 * TOKEN_BYTES, 30 * TOKEN_BYTES, 0, 0)
    assert kept.keep("b", [1, 2, 3, 4], _cache(4))        # another namespace: both stay
    assert kept.keep("a", [7] * 10, _cache(10))
    assert kept.stats().bytes == 20 * TOKEN_BYTES
    assert kept.keep("a", [8] * 12, _cache(12))           # 32 > 30: the oldest one goes
    assert kept.stats() == KeptStats(3, 26 * TOKEN_BYTES, 30 * TOKEN_BYTES, 0, 1)
    assert kept.take("a", [1, 2, 3, 4, 5, 6, 0], 6) is None  # it was evicted
    assert kept.take("b", [1, 2, 3, 4, 0], 4) is not None
    assert not kept.keep("a", [9] * 31, _cache(31))       # larger than the whole bound
    assert kept.drop("a") == 2
    assert kept.stats() == KeptStats(0, 0, 30 * TOKEN_BYTES, 1, 1)


def test_a_cache_that_does_not_hold_its_tokens_is_refused():
    with pytest.raises(RuntimeError, match="a cache of 5 tokens cannot be kept for 4"):
        KeptCaches(1 << 20).keep("a", [1, 2, 3, 4], _cache(5))
    with pytest.raises(ValueError, match="kept bytes must be >= 0"):
        KeptCaches(-1)


def _turns(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[mx.array], int]]:
    out = []
    for i, prompt in enumerate(prompts):
        req = GenerateRequest(f"t{i}", engine.namespace("chat"), tuple(prompt),
                              SamplingParams(max_tokens=6))
        engine.submit(req)
        tokens, logprobs, cached = [], [], -1
        while engine.busy:
            step = engine.step()
            tokens += [d.token for d in step.deltas]
            logprobs += [d.logprobs for d in step.deltas]
            cached = next((r.cached_tokens for r in step.finished), cached)
        out.append((tokens, logprobs, cached))
    return out


def test_next_turns_extend_the_kept_cache_and_compute_what_a_join_does():
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(40)]]
    for extra in (13, 21, 9):  # each turn re-sends the conversation with a new message
        prompts.append(prompts[-1] + [rng.randrange(1, 500) for _ in range(extra)])
    model = tiny_model("llama")
    kept = Engine.open(model, EngineConfig(block_size=BS))
    joined = Engine.open(model, EngineConfig(block_size=BS, kept_bytes=0))
    plain = Engine.open(model, EngineConfig(block_size=BS, use_store=False))
    got, join, ref = _turns(kept, prompts), _turns(joined, prompts), _turns(plain, prompts)
    # prompts of 40, 53, 74 and 83 tokens: the store matches the full blocks of the previous
    # prompt; the kept cache also gives the previous prompt's partial last block
    assert [c for _, _, c in got] == [0, 40, 53, 74]
    assert [c for _, _, c in join] == [0, 32, 48, 64]
    stats = kept.kept_stats()
    assert (stats.taken, stats.entries) == (3, 1)  # turns 2-4 took the previous turn's cache
    assert joined.kept_stats() == KeptStats(0, 0, 0, 0, 0)
    for (a, la, _), (b, lb, _), (c, lc, _) in zip(got, join, ref):
        assert a == b == c
        for x, y, z in zip(la, lb, lc):
            assert mx.max(mx.abs(x - z)).item() <= 1e-4
            assert mx.max(mx.abs(x - y)).item() <= 1e-4


def test_no_kept_caches_beside_a_quantized_store_and_invalidation_drops_them(tmp_path):
    wide = forge(tmp_path / "m", ForgeSpec(layers=1, hidden=128, heads=2, kv_heads=1,
                                           intermediate=128))  # head_dim 64: quantizable
    for config in (EngineConfig(kv_bits=8), EngineConfig(disk_kv_bits=4, disk_bytes=1 << 20,
                                                         disk_dir=str(tmp_path / "d"))):
        quantized = Engine.open(wide, config)
        assert quantized.kept_stats().capacity_bytes == 0
        quantized.close()
    model = tiny_model("llama")
    engine = Engine.open(model, EngineConfig(block_size=BS))
    _turns(engine, [list(range(1, 41))])
    assert engine.kept_stats().entries == 1
    engine.invalidate(engine.namespace("chat"))
    assert engine.kept_stats().entries == 0
    assert _turns(engine, [list(range(1, 50))])[0][2] == 0  # nothing reused after it
    assert engine.kept_stats().taken == 0
