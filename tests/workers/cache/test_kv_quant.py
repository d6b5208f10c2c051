"""Quantized K/V tiers: exact bytes per token, bounded error; config (re-encoding between tiers
on spill: ``test_spill.py``)."""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from cluster.config import load_config, write_default_config
from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier, decode_batch, encode_batch
from router.kv.key import BlockHash
from workers.cache.kv_quant import KVCodec
from workers.cache.blocks import KVShape
from workers.cache.store import PrefixStore

from tests.support.prefix_stores import (WIDE as SHAPE, WIDE_BS as BS, WIDE_NS as NS,
                                         WIDE_TOKENS as TOKENS, random_cache)


@pytest.mark.parametrize("bits, per_token, ratio", [(0, 2048, 1.0), (8, 544, 0.265625),
                                                     (4, 288, 0.140625)])
def test_bytes_per_cached_token_include_scales_and_biases(bits, per_token, ratio):
    # per head and token: 64 x 4 bytes; 64 x 1 + 2 x 2 (f16 scale, bias); 64 / 2 + 2 x 2
    store = PrefixStore(SHAPE, BS, 1 << 20, 60.0, lambda: 0.0, kv_bits=bits)
    assert store.write(NS, TOKENS, random_cache(32)) == 32
    stats = store.stats()
    assert stats.bytes_per_token == per_token
    assert stats.bytes_per_token / SHAPE.bytes_per_token == ratio
    assert stats.tensor_bytes == 32 * per_token  # what is held is exactly what is counted
    assert stats.ledger.bytes == 32 * per_token


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_hit_is_within_a_quantization_step(bits):
    store = PrefixStore(SHAPE, BS, 1 << 20, 60.0, lambda: 0.0, kv_bits=bits)
    cache = random_cache(32)
    store.write(NS, TOKENS, cache)
    found = store.lookup(NS, TOKENS + [99])
    assert found.report.matched_tokens == 32
    for layer in range(SHAPE.layers):
        got = found.cache[layer].keys[:, :, :32]
        want = cache[layer].keys[:, :, :32]
        assert got.dtype == mx.float32
        groups = want.reshape(-1, 64)
        step = (groups.max(axis=1) - groups.min(axis=1)) / (2 ** bits - 1)
        err = mx.abs(got - want).reshape(-1, 64).max(axis=1)
        # mx.quantize alone errs by up to 0.97 of a step on normal data; float16 scales and
        # biases add up to 0.07 more at 8 bits (measured over 4096 groups)
        assert mx.all(err <= 1.1 * step).item()
        assert mx.any(err > 0).item()  # really quantized


def test_heads_that_cannot_be_grouped_by_64_are_refused():
    shape = KVShape(layers=2, kv_heads=2, head_dim=16, dtype=mx.float32)
    with pytest.raises(ValueError, match="head_dim divisible by 64.*head_dim 16"):
        PrefixStore(shape, BS, 1 << 20, 60.0, lambda: 0.0, kv_bits=8)
    with pytest.raises(ValueError, match="must be one of 0, 8, 4"):
        KVCodec(2, mx.float32)


def test_events_carry_their_tier_through_the_wire():
    events = (BlockStored(BlockHash(7), BlockHash(3), 16, "t/m", Tier.DISK),
              BlockRemoved(BlockHash(7), "t/m", Tier.MEMORY))
    assert decode_batch(encode_batch(EventBatch("w0", 4, events))).events == events


def test_cache_config_keys_for_tiers(tmp_path):
    write_default_config(tmp_path)
    path = tmp_path / "orchard.toml"
    text = path.read_text().replace("[cache]\n", "[cache]\ndisk_bytes = 4096\nkv_bits = 8\n")
    path.write_text(text)
    cache = load_config(tmp_path).cache
    assert (cache.disk_bytes, cache.disk_dir, cache.kv_bits, cache.disk_kv_bits) == (4096, "cache", 8, 0)
    path.write_text(text.replace("kv_bits = 8", "kv_bits = 6"))
    with pytest.raises(ValueError, match=r"\[cache\] kv_bits must be 0 \(model precision\), 8 or 4"):
        load_config(tmp_path)
