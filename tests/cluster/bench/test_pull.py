"""``orchard bench pull`` at its smallest, on a forged model: the names the checks read, a
pull that brought the whole prefix on each link, outputs identical (not its figures: those are
taken on an idle machine)."""
from __future__ import annotations

import asyncio

from cluster.bench.pull import LINKS, RateLimit, bench_pull
from tests.support.forged_models import tiny_model


def test_the_bench_reports_both_links_and_identical_outputs():
    out = bench_pull(str(tiny_model()), prefix_tokens=48, suffix_tokens=4, trials=1,
                     ladder=(16,), decode_tokens=8)
    assert {"ttft_pull_over_recompute_10gbit", "ttft_pull_over_recompute_1gbit",
            "outputs_identical"} <= set(out)
    assert out["outputs_identical"] is True
    assert [(r["link"], r["pulled_tokens"]) for r in out["links"]] == [("10gbit", 48),
                                                                      ("1gbit", 48)]
    assert [(r["link"], r["prefix_tokens"]) for r in out["ladder"]] == [("10gbit", 16),
                                                                       ("1gbit", 16)]
    assert out["shaping"].startswith("rate limit in the transfer stream")
    assert out["holder_tpot_during_pull_over_alone"] > 0


def test_the_rate_limit_spaces_blocks_by_their_bytes():
    async def paced() -> float:
        limit = RateLimit(1e6, 0.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(3):
            await limit(10_000)   # 10 ms each at 1 MB/s
        return loop.time() - start
    assert asyncio.run(paced()) >= 0.03
    assert LINKS["1gbit"][0] == 1e9 / 8
