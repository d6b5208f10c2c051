"""What one engine is opened with (``workers.engine.config.EngineConfig``): its defaults, each
exactly, frozen, and the cache-key secret kept out of its text."""
from __future__ import annotations

import dataclasses

import pytest

from router.kv.ledger import DEFAULT_EVICTION
from workers.engine.config import EngineConfig


class TestTheDefaults:
    def test_every_default_exactly(self):
        assert dataclasses.asdict(EngineConfig()) == {
            "block_size": 16, "store_bytes": 1 << 30, "ttl_s": 300.0,
            "eviction": DEFAULT_EVICTION, "kv_bits": 0, "disk_bytes": 0, "disk_dir": "",
            "disk_kv_bits": 0, "use_store": True, "kept_bytes": 256 << 20, "max_batch": 32,
            "prefill_budget": 512, "decode_stall": 1.8, "speculate": False,
            "speculate_max_k": 8, "draft_model": "", "worker_id": "", "cache_secret": b""}


class TestOneConfigPerEngine:
    def test_it_is_frozen_and_a_changed_copy_leaves_the_original(self):
        config = EngineConfig(block_size=32)
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.worker_id = "w1"
        named = dataclasses.replace(config, worker_id="w1")
        assert (config.worker_id, named.worker_id, named.block_size) == ("", "w1", 32)

    def test_the_cache_secret_is_never_in_its_text_and_still_tells_configs_apart(self):
        keyed = EngineConfig(cache_secret=b"s3cret-key")
        assert "s3cret" not in repr(keyed) and "cache_secret" not in repr(keyed)
        assert repr(keyed) == repr(EngineConfig())
        assert keyed != EngineConfig()
