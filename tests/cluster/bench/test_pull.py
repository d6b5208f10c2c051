"""``orchard bench pull`` at its smallest, on a forged model: the names the checks read, a
pull that brought the whole prefix on each link, outputs identical (not its figures: those are
taken on an idle machine)."""
from __future__ import annotations

import asyncio

from cluster.bench.pull import LINKS, LinkResult, RateLimit, bench_pull, pull_wins_from
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
    assert set(out["pull_wins_from_tokens"]) == {"10gbit", "1gbit"}
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


def _step(link: str, tokens: int, pull_s: float, recompute_s: float) -> LinkResult:
    return LinkResult(link, tokens, pull_s, recompute_s, pull_s / recompute_s, tokens, 0.01,
                      True)


def test_a_pull_wins_from_the_shortest_length_it_wins_at_and_beyond():
    steps = [_step("1gbit", 64, 0.20, 0.10), _step("10gbit", 64, 0.12, 0.10),
             _step("1gbit", 128, 0.15, 0.18), _step("10gbit", 128, 0.11, 0.18),
             _step("1gbit", 256, 0.21, 0.20), _step("10gbit", 256, 0.12, 0.30),
             _step("1gbit", 512, 0.30, 0.60), _step("10gbit", 512, 0.13, 0.60)]
    # 1 Gbit/s won at 128 but lost again at 256: it wins from 512
    assert (pull_wins_from(steps, "10gbit"), pull_wins_from(steps, "1gbit")) == (128, 512)
    assert pull_wins_from([_step("1gbit", 64, 0.1, 0.2), _step("1gbit", 128, 0.3, 0.2)],
                          "1gbit") is None
    assert pull_wins_from(steps, "100gbit") is None


def test_ladder_alone_is_the_default_ladder():
    import argparse

    from cluster.bench.pull import DEFAULT_LADDER, register_bench

    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers())
    assert parser.parse_args(["pull", "--ladder"]).ladder == "64,128,256,512,1024,2000"
    assert DEFAULT_LADDER == (64, 128, 256, 512, 1024, 2000)
    assert parser.parse_args(["pull"]).ladder == ""
