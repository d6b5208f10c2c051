"""What crosses the Backend protocol (``cluster.backend.protocol``): the model a worker
reported made into the frontend's ``ModelInfo`` and its tenants' namespaces, the worker's
time on a request, and the cluster-wide cache statistics summed over the workers."""
from __future__ import annotations

from cluster.backend.protocol import CacheStats, GenerateOutcome, ModelInfo
from router.kv.key import Namespace
from workers.messages import (DiskTierStats, GenerateResult, LookupOutcome, LookupReport,
                              ModelFacts, Timings, WorkerStats)

FACTS = ModelFacts("tiny", "r7", 256, 2048, 16, 512, 128)


def _result(received_ns: int, finished_ns: int) -> GenerateResult:
    report = LookupReport(LookupOutcome.MISS, 4, 0, 0, 1, None, None, 600.0)
    return GenerateResult("r", (1,), "a", "length", 0.0, 0.0, 4, 0, 4, 0, report,
                          Timings(received_ns, 0, 0, 0, 0, finished_ns))


def _disk(blocks: int, free: int | None, full: bool = False) -> DiskTierStats:
    return DiskTierStats(blocks, blocks * 100, 10_000, free, 1, 2, 3, full, blocks)


class TestModelInfo:
    def test_is_made_from_the_facts_a_worker_reported(self):
        info = ModelInfo.of(FACTS, "/models/tiny", b"k" * 32)
        assert info == ModelInfo("tiny", "r7", 256, 2048, "/models/tiny", 16, 512, 128,
                                 b"k" * 32)

    def test_a_tenants_namespace_is_keyed_with_the_workers_secret(self):
        info = ModelInfo.of(FACTS, "/models/tiny", b"k" * 32)
        assert info.namespace("acme") == Namespace("acme", "tiny", "r7", secret=b"k" * 32)
        assert info.namespace("acme") != Namespace("acme", "tiny", "r7")

    def test_the_secret_is_never_printed(self):
        assert "kkkk" not in repr(ModelInfo.of(FACTS, "/m", b"k" * 32))


class TestGenerateOutcome:
    def test_the_worker_time_is_its_own_measure_when_it_has_one(self):
        outcome = GenerateOutcome(_result(1_000_000_000, 3_500_000_000), None, 1, "w0",
                                  worker_s=0.25)
        assert outcome.worker_time_s() == 0.25

    def test_else_the_engines_received_to_finished_stamps_stand_in(self):
        outcome = GenerateOutcome(_result(1_000_000_000, 3_500_000_000), None, 1, "w0")
        assert outcome.worker_time_s() == 2.5


class TestCacheStats:
    def test_sums_the_live_workers_stats(self):
        stats = CacheStats.of([WorkerStats(1, 100, 1000, 3, 48, 80, 32, 5),
                               WorkerStats(0, 50, 1000, 2, 32, 20, 0, 1)])
        assert stats == CacheStats(workers=2, cache_bytes=150, cache_capacity_bytes=2000,
                                   cache_blocks=5, input_tokens=100, cached_tokens=32,
                                   computed_tokens=68, written_tokens=80, disk=None)
        assert stats.hit_ratio == 0.32

    def test_no_input_yet_is_a_hit_ratio_of_zero(self):
        assert CacheStats.of([WorkerStats(0, 0, 1000, 0, 0, 0, 0, 0)]).hit_ratio == 0.0
        assert CacheStats.of([]).workers == 0

    def test_the_disk_tiers_of_those_that_have_one_are_summed(self):
        stats = CacheStats.of([WorkerStats(0, 0, 0, 0, 0, 0, 0, 0, disk=_disk(2, 500)),
                               WorkerStats(0, 0, 0, 0, 0, 0, 0, 0),
                               WorkerStats(0, 0, 0, 0, 0, 0, 0, 0, disk=_disk(3, 700, True))])
        assert stats.disk == DiskTierStats(5, 500, 20_000, 1200, 2, 4, 6, True, 5)

