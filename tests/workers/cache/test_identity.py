"""A hash never decides a hit alone: with block hashes that collide on purpose (test doubles
injected where the store builds its key), the memory tier, the disk tier and the engine's kept
caches serve no block whose namespace, parent or position differ from the prompt's, for two
tenants and for one tenant at two positions; invalidating one tenant never removes another's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from router.kv.key import BlockHash, Namespace, hash_blocks
from router.kv.ledger import Eviction
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.prefix_stores import BS, SHAPE, kv_for
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams
from workers.cache.open_store import open_store
from workers.cache.store import PrefixStore

A_NS = Namespace("tenant-a", "m", "r1")
B_NS = Namespace("tenant-b", "m", "r1")
X = [11, 12, 13, 14]   # one block each
Y = [21, 22, 23, 24]
Z = [31, 32, 33, 34]
BLOCK_BYTES = BS * SHAPE.bytes_per_token


def tenant_blind(tokens, block_size, namespace):
    """Every tenant's chain hashes alike: equal tokens collide across namespaces."""
    return hash_blocks(tokens, block_size, Namespace("same", namespace.model, namespace.revision))


def chain_blind(tokens, block_size, namespace):
    """A block hashes by its own tokens alone: equal blocks collide at any position, under
    any parent and in any namespace (the forged-chain attack, made free)."""
    root = Namespace("same", "same")
    return [hash_blocks(tokens[i:i + block_size], block_size, root)[0]
            for i in range(0, len(tokens) - block_size + 1, block_size)]


def memory_store(hasher) -> PrefixStore:
    return PrefixStore(SHAPE, BS, 100 * BLOCK_BYTES, 60.0, Clock(), Eviction.LRU, hasher=hasher)


def put(store: PrefixStore, ns: Namespace, tokens: list[int]) -> int:
    return store.write(ns, tokens, kv_for(tokens))


class TestTheMemoryTier:
    def test_reading_another_tenants_blocks_is_a_counted_miss(self):
        store = memory_store(tenant_blind)
        assert put(store, B_NS, X + Y) == 8
        report = store.lookup(A_NS, X + Y + [1]).report
        assert (report.outcome, report.matched_tokens, report.identity_mismatches) == (
            LookupOutcome.MISS, 0, 1)
        assert store.lookup(B_NS, X + Y + [1]).report.matched_tokens == 8
        assert store.stats().identity_mismatches == 1

    def test_a_tenant_writing_first_cannot_poison_the_next_tenant(self):
        store = memory_store(tenant_blind)
        assert put(store, A_NS, X + Y) == 8
        assert put(store, B_NS, X + Y) == 0  # the hashes are A's blocks: nothing stored
        assert store.ledger.stats().collisions == 1
        report = store.lookup(B_NS, X + Y + [1]).report
        assert (report.matched_tokens, report.identity_mismatches) == (0, 1)
        assert store.lookup(A_NS, X + Y + [1]).report.matched_tokens == 8  # A's untouched

    def test_a_forged_chain_landing_on_another_tenants_root_is_refused(self):
        # A's second block hashes like B's first (the attack on the linear key): B's prompt
        # starts as A's second block does, and must not read A's K/V computed after X
        store = memory_store(chain_blind)
        assert put(store, A_NS, X + Y) == 8
        report = store.lookup(B_NS, Y + Z + [1]).report
        assert (report.matched_tokens, report.identity_mismatches) == (0, 1)

    def test_one_tenants_block_at_another_position_is_a_miss(self):
        store = memory_store(chain_blind)
        assert put(store, A_NS, X + Y) == 8
        report = store.lookup(A_NS, Y + [1]).report  # Y at position 0: stored at position 1
        assert (report.matched_tokens, report.identity_mismatches) == (0, 1)
        report = store.lookup(A_NS, X + X + [1]).report  # X again at position 1
        assert (report.matched_tokens, report.identity_mismatches) == (4, 1)

    def test_invalidating_a_tenant_never_removes_another_tenants_blocks(self):
        store = memory_store(chain_blind)
        assert put(store, B_NS, Y + Z) == 8
        assert put(store, A_NS, X + Y) == 4  # X stored; Y's hash is B's first block
        assert store.invalidate_namespace(A_NS) == 1
        assert store.lookup(B_NS, Y + Z + [1]).report.matched_tokens == 8
        # and the other order: B's block is never hung under A's chain
        store = memory_store(chain_blind)
        assert put(store, A_NS, X + Y) == 8
        assert put(store, B_NS, Y + Z) == 0
        assert store.invalidate_namespace(A_NS) == 2
        assert put(store, B_NS, Y + Z) == 8


def tiered(directory: Path, hasher, mem_blocks: int = 2) -> PrefixStore:
    return open_store(SHAPE, BS, 60.0, Clock(), memory_bytes=mem_blocks * BLOCK_BYTES,
                      eviction=Eviction.LRU, disk_dir=directory, disk_bytes=100 * BLOCK_BYTES,
                      model="m", revision="r1", wall_clock=Clock(1_000_000.0), hasher=hasher)


class TestTheDiskTier:
    def test_another_tenants_block_on_disk_is_a_counted_miss_and_stays(self, tmp_path):
        store = tiered(tmp_path / "w0", tenant_blind)
        put(store, B_NS, X + Y)
        put(store, B_NS, Z + [41, 42, 43, 44])  # evicts X + Y to disk
        store.flush()
        assert store.stats().disk.ledger.blocks == 2
        report = store.lookup(A_NS, X + Y + [1]).report
        assert (report.matched_tokens, report.identity_mismatches) == (0, 1)
        stats = store.stats()
        assert (stats.identity_mismatches, stats.disk.corrupt) == (1, 0)
        report = store.lookup(B_NS, X + Y + [1]).report
        assert (report.matched_tokens, report.disk_tokens) == (8, 8)
        store.close()

    def test_a_block_at_another_position_on_disk_is_a_miss(self, tmp_path):
        store = tiered(tmp_path / "w0", chain_blind)
        put(store, A_NS, X + Y)
        put(store, A_NS, Z + [41, 42, 43, 44])  # evicts X + Y to disk
        store.flush()
        report = store.lookup(A_NS, Z + [41, 42, 43, 44] + Y + [1]).report  # Y at position 2
        assert (report.matched_tokens, report.identity_mismatches) == (8, 1)
        store.close()

    def test_the_identity_survives_a_restart(self, tmp_path):
        store = tiered(tmp_path / "w0", tenant_blind)
        put(store, B_NS, X + Y)
        store.close()  # writes the memory tier to disk
        again = tiered(tmp_path / "w0", tenant_blind)
        assert again.stats().disk.start.restored == 2
        assert again.lookup(A_NS, X + Y + [1]).report.matched_tokens == 0
        assert again.lookup(B_NS, X + Y + [1]).report.matched_tokens == 8
        again.close()


def _engine(hasher) -> Engine:
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=16), hasher=hasher)


def _run(engine: Engine, tenant: str, prompt: list[int], rid: str):
    request = GenerateRequest(rid, engine.namespace(tenant), tuple(prompt),
                              SamplingParams(max_tokens=8))
    (result,) = engine.generate([request])
    return result


SYSTEM = [(7 * i + 3) % 1000 + 5 for i in range(48)]  # B's system prompt: three blocks
CRAFTED = [(11 * i + 1) % 1000 + 5 for i in range(32)] + SYSTEM  # A's text, then B's start


@pytest.mark.parametrize("hasher", [tenant_blind, chain_blind], ids=["tenant", "chain"])
class TestTheEngine:
    """Greedy outputs of B equal those of an engine that never saw A, in both orders."""

    def test_poisoning_order_a_first_then_b(self, hasher):
        # tenant-blind: A sends B's very prompt; chain-blind: A's own text, then B's start
        crafted = SYSTEM if hasher is tenant_blind else CRAFTED
        alone = _run(_engine(hasher), "b", SYSTEM + [900, 901], "b0")
        engine = _engine(hasher)
        _run(engine, "a", crafted + [900, 901], "a1")
        b = _run(engine, "b", SYSTEM + [900, 901], "b1")
        assert (b.cached_tokens, b.lookup.identity_mismatches) == (0, 1)
        assert b.output_tokens == alone.output_tokens

    def test_reading_order_b_first_then_a(self, hasher):
        alone = _run(_engine(hasher), "a", SYSTEM + [900, 901], "a0")
        engine = _engine(hasher)
        _run(engine, "b", SYSTEM + [900, 901], "b1")
        a = _run(engine, "a", SYSTEM + [900, 901], "a1")  # kept caches included
        assert (a.cached_tokens, a.lookup.identity_mismatches) == (0, 1)
        assert a.output_tokens == alone.output_tokens


class TestTheClusterSecret:
    def test_made_once_at_first_use_kept_0600_then_read(self, tmp_path):
        from router.kv.key import CacheSecret

        first = CacheSecret.load_or_create(tmp_path)
        path = tmp_path / "cache.key"
        assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600
        assert CacheSecret.load_or_create(tmp_path) == first
        path.chmod(0o644)
        with pytest.raises(ValueError, match=r"cache.key is readable by others \(mode 644\)"):
            CacheSecret.load_or_create(tmp_path)
        path.chmod(0o600)
        path.write_bytes(b"short")
        with pytest.raises(ValueError, match="holds 5 bytes, not a 32-byte cache secret"):
            CacheSecret.load_or_create(tmp_path)

    def test_the_cluster_config_hands_the_workers_its_run_directorys_secret(self, tmp_path):
        from cluster.backend.engine_config import engine_config
        from cluster.config import load_config
        from router.kv.key import CacheSecret

        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "orchard.toml").write_text("")
        config = load_config(run_dir)
        engine = engine_config(config)
        assert engine.cache_secret == CacheSecret.load_or_create(run_dir)
        assert repr(engine.cache_secret) not in repr(engine)
        assert engine_config(load_config(run_dir)).cache_secret == engine.cache_secret

    def test_a_request_hashed_with_another_secret_is_refused(self):
        engine = Engine.open(tiny_model("llama"), EngineConfig(block_size=16,
                                                               cache_secret=b"k" * 32))
        stranger = GenerateRequest("r", Namespace("t", engine.model_id, engine.revision),
                                   (1, 2, 3), SamplingParams(max_tokens=2))
        (failed,) = engine.generate([stranger])
        assert "hashed with another cache secret than this worker's" in failed.error
        (ok,) = engine.generate([GenerateRequest("r2", engine.namespace("t"), (1, 2, 3),
                                                 SamplingParams(max_tokens=2))])
        assert len(ok.output_tokens) == 2
