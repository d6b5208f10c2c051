"""One source of truth for each value: the no-workers error, the eviction policy, the percentile,
the node id, the KV bytes per token. Each test drives the real component that owns the value."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from cluster.backend.local import LocalBackend
from router.kv.key import Namespace
from router.policy import NoWorkerAvailable, RoutingDecision
from router.kv.stats import percentile
from tests.support.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams


def test_an_outcome_carries_the_routers_decision_and_no_worker_is_the_routers_error():
    async def scenario():
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=16))
        await backend.start()
        try:
            (worker,) = await backend.workers()
            request = GenerateRequest("r", Namespace("t", "tiny"), (1, 2, 3),
                                      SamplingParams(max_tokens=1))
            outcome = await backend.generate(request, ())
            assert isinstance(outcome.decision, RoutingDecision)
            assert outcome.decision.worker_id == outcome.worker_id == worker.worker_id
            await backend.drain(worker.worker_id)
            with pytest.raises(NoWorkerAvailable, match="no worker"):
                await backend.generate(dataclasses.replace(request, request_id="r2"), ())
        finally:
            await backend.close()
    asyncio.run(scenario())


def test_store_ledger_engine_config_forecast_and_simulator_share_one_eviction_default():
    import inspect

    from cluster.config import CacheConfig
    from router.forecast import CacheModel
    from router.kv.ledger import DEFAULT_EVICTION, BlockLedger, Eviction
    from router.sim.simulator import SimConfig
    from workers.cache.disk_tier import DiskTier
    from workers.cache.open_store import open_store
    from workers.cache.store import PrefixStore

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default
    defaults = {"ledger": default(BlockLedger, "policy"), "store": default(PrefixStore, "eviction"),
                "open_store": default(open_store, "eviction"),
                "disk": default(DiskTier, "eviction"), "engine": EngineConfig().eviction,
                "config": CacheConfig().eviction, "simulator": SimConfig().eviction,
                "forecast": CacheModel(16, 100, 60.0).eviction}
    assert defaults == dict.fromkeys(defaults, Eviction.REUSE)
    assert DEFAULT_EVICTION is Eviction.REUSE
    with pytest.raises(ValueError, match="lru, reuse"):
        BlockLedger(10, 1.0, lambda: 0.0, 1, policy="fifo")


def test_the_percentile_is_the_nearest_rank_and_always_a_measured_value():
    values = [float(v) for v in range(100, 0, -1)]   # 1..100, unordered
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) \
        == (50.0, 99.0, 100.0)
    assert percentile([3.0, 1.0], 0.5) == 1.0 and percentile([7.0], 0.01) == 7.0
    assert percentile([], 0.99) == 0.0
    with pytest.raises(ValueError, match="0.99 for a p99"):
        percentile(values, 99)


def test_the_node_id_outside_ray_is_local():
    import ray

    from cluster.backend.bootstrap import node_address, node_id
    if ray.is_initialized():
        pytest.skip("a Ray cluster is up in this process")
    assert (node_id(), node_address()) == ("local", "local")


def _bf16_model(root: Path) -> Path:
    """The tiny forged model with its weights (hence its K/V) in bfloat16."""
    import json
    import shutil

    import mlx.core as mx

    out = root / "llama-bf16"
    shutil.copytree(tiny_model(), out)
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(out / "model.safetensors")).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


def test_the_forecast_capacity_comes_from_the_engines_bytes_per_token_for_a_bf16_model(tmp_path):
    from cluster.config import CacheConfig, Config, TelemetryConfig
    from cluster.telemetry.job_tracing import frontend_tracing

    async def scenario():
        backend = LocalBackend(_bf16_model(tmp_path), workers=2,
                               engine=EngineConfig(block_size=16, store_bytes=1 << 20))
        await backend.start()
        try:
            return backend.model_info()
        finally:
            await backend.close()
    info = asyncio.run(scenario())
    # 2 x 2 layers x 2 kv heads x head_dim 16 x 2 bytes (bfloat16): half the float32 figure
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256
    config = Config(tmp_path, {}, frozenset(), cache=CacheConfig(capacity_bytes=1 << 20),
                    telemetry=TelemetryConfig(exporter="none"))
    tracing = frontend_tracing(config, info, workers=2, decode=None)
    assert tracing.observer.holdings.capacity_tokens() == 2 * (1 << 20) // 256 == 8192


def test_the_forecast_capacity_of_the_disk_tier_comes_from_the_engines_too(tmp_path):
    from cluster.config import CacheConfig, Config, TelemetryConfig
    from cluster.telemetry.job_tracing import frontend_tracing

    disk_bytes = 1 << 22

    async def scenario():
        backend = LocalBackend(_bf16_model(tmp_path), workers=2, engine=EngineConfig(
            block_size=16, store_bytes=1 << 20, disk_bytes=disk_bytes,
            disk_dir=str(tmp_path / "cache")))
        await backend.start()
        try:
            return backend.model_info()
        finally:
            await backend.close()
    info = asyncio.run(scenario())
    assert info.disk_kv_bytes_per_token == info.kv_bytes_per_token == 256
    config = Config(tmp_path, {}, frozenset(),
                    cache=CacheConfig(capacity_bytes=1 << 20, disk_bytes=disk_bytes),
                    telemetry=TelemetryConfig(exporter="none"))
    holdings = frontend_tracing(config, info, workers=2, decode=None).observer.holdings
    assert holdings.capacity_by_tier() == (2 * 4096, 2 * (1 << 22) // 256)
    assert holdings.capacity_tokens() == 8192 + 32768


def test_a_backend_restarted_on_its_disk_directory_routes_to_what_it_kept(tmp_path):
    """The restored blocks reach the router, as disk blocks, before the first request."""
    from router.kv.key import hash_blocks

    engine = EngineConfig(block_size=16, store_bytes=1 << 20, disk_bytes=1 << 22,
                          disk_dir=str(tmp_path / "cache"))
    prompt = tuple(range(40, 40 + 4 * 16 + 3))

    async def run_once():
        backend = LocalBackend(tiny_model(), workers=1, engine=engine)
        await backend.start()
        try:
            info = backend.model_info()
            ns = Namespace("t", info.model_id, info.revision)
            request = GenerateRequest("r", ns, prompt, SamplingParams(max_tokens=2))
            return await backend.generate(request, hash_blocks(prompt, 16, ns))
        finally:
            await backend.close()  # the store's blocks are written to disk
    first = asyncio.run(run_once())
    again = asyncio.run(run_once())
    assert (first.decision.expected_cached_tokens, first.result.cached_tokens) == (0, 0)
    assert again.decision.expected_cached_tokens == 64
    assert (again.result.cached_tokens, again.result.lookup.disk_tokens) == (64, 64)
