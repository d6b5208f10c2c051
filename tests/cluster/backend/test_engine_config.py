"""The engine settings a cluster ``Config`` narrows to (``cluster.backend.engine_config``):
each ``[cache]`` and ``[engine]`` value reaches every worker's ``EngineConfig``, the disk tier
under the run directory, and the run directory's cache-key secret, made once."""
from __future__ import annotations

import stat

from cluster.backend.engine_config import engine_config
from cluster.config import CacheConfig, Config, EngineSettings, load_config, write_default_config
from router.kv.key import CacheSecret
from router.kv.ledger import Eviction
from workers.engine.config import EngineConfig


class TestNarrowing:
    def test_cache_settings_narrow_to_the_engine_config(self, tmp_path):
        write_default_config(tmp_path)
        default = engine_config(load_config(tmp_path))
        assert default.eviction == "reuse" and default.block_size == 16
        toml = tmp_path / "orchard.toml"
        toml.write_text(toml.read_text().replace('eviction = "reuse"', 'eviction = "lru"'))
        assert engine_config(load_config(tmp_path)).eviction is Eviction.LRU


    def test_engine_settings_narrow_to_the_engine_config(self, tmp_path):
        write_default_config(tmp_path)
        default = engine_config(load_config(tmp_path))
        assert (default.speculate, default.speculate_max_k, default.draft_model) == (False, 8, "")
        toml = tmp_path / "orchard.toml"
        toml.write_text(toml.read_text() + "\n[engine]\nspeculate = true\nspeculate_max_k = 6\n"
                        "draft_model = \"/models/small\"\n")
        narrowed = engine_config(load_config(tmp_path))
        assert (narrowed.speculate, narrowed.speculate_max_k, narrowed.draft_model) == (
            True, 6, "/models/small")

    def test_every_cache_and_engine_value_reaches_the_engine_config(self, tmp_path):
        config = Config(tmp_path / "run", {}, frozenset(),
                        cache=CacheConfig(block_size=32, ttl_s=60.0, capacity_bytes=1 << 20,
                                          eviction=Eviction.LRU, kv_bits=8, disk_bytes=1 << 24,
                                          disk_dir="disk", disk_kv_bits=4),
                        engine=EngineSettings(speculate=True, speculate_max_k=3, max_batch=5,
                                              draft_model="/models/d"))
        narrowed = engine_config(config)
        secret = (tmp_path / "run" / CacheSecret.NAME).read_bytes()
        assert narrowed == EngineConfig(block_size=32, store_bytes=1 << 20, ttl_s=60.0,
                                        eviction=Eviction.LRU, kv_bits=8, disk_bytes=1 << 24,
                                        disk_dir=str(tmp_path / "run" / "disk"), disk_kv_bits=4,
                                        max_batch=5, speculate=True, speculate_max_k=3,
                                        draft_model="/models/d", cache_secret=secret)


class TestTheRunDirectory:
    def test_is_made_private_with_the_cache_secret_in_it(self, tmp_path):
        config = Config(tmp_path / "new" / "run", {}, frozenset())
        narrowed = engine_config(config)
        assert stat.S_IMODE((tmp_path / "new" / "run").stat().st_mode) == 0o700
        assert len(narrowed.cache_secret) == 32
        assert narrowed.cache_secret == (tmp_path / "new" / "run" / CacheSecret.NAME).read_bytes()

    def test_every_worker_gets_the_same_secret_on_every_call(self, tmp_path):
        config = Config(tmp_path, {}, frozenset())
        first, second = engine_config(config), engine_config(config)
        assert first.cache_secret == second.cache_secret != b""
        assert engine_config(Config(tmp_path / "other", {}, frozenset())).cache_secret != \
            first.cache_secret
