"""``router.sim.linear``: a simulated worker under the linear service model, and the pull from
a peer it makes first when the router planned one: a hot document's second worker pulls it
instead of prefilling it; a slow link pulls nothing. ``serve_linear`` on one worker: its FIFO
queue, the cached blocks it takes, decodes slowing its prefill, breakpoints, a pull's arrival."""
from __future__ import annotations

from dataclasses import replace

import pytest

from router.kv.events import BlockStored, WorkerRates
from router.kv.key import BlockHash
from router.pull_cost import PullChoice
from router.sim.base import SimRequest
from router.sim.linear import SimWorker, serve_linear
from router.sim.simulator import SimConfig, replay
from tests.support.sim_traces import BS, HOT


class TestAPullFirst:
    def test_a_hot_documents_second_worker_pulls_it_instead_of_prefilling_it(self):
        alone = replay(HOT, "orchard", SimConfig(workers=2))
        pulled = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=10.0))
        assert (alone.pulled_tokens, pulled.pulled_tokens) == (0, 8 * BS)   # one pull, once
        assert pulled.prefill_tokens == alone.prefill_tokens - 8 * BS
        assert pulled.ttft_mean_s < alone.ttft_mean_s
        assert pulled.reasons["load_spill"] == 1

    def test_a_link_too_slow_pulls_nothing(self):
        slow = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=0.01))
        alone = replay(HOT, "orchard", SimConfig(workers=2))
        assert slow.pulled_tokens == 0
        assert (slow.prefill_tokens, slow.reasons) == (alone.prefill_tokens, alone.reasons)


# 4-token blocks, 100 tokens/s of prefill, each running decode slowing it by half, 10 tokens/s
# of decode: times a test can add up by hand.
SMALL = SimConfig(workers=2, capacity_tokens=100, block_size=4, trace_block=4, prefill_tps=100.0,
                  decode_tps=10.0, decode_share=0.5)
ROOT = BlockHash(0)


def request(rid: int, length: int, blocks: tuple[int, ...], output: int = 5,
            write_blocks: int | None = None) -> SimRequest:
    return SimRequest(rid, length, output, tuple(BlockHash(b) for b in blocks),
                      write_blocks=write_blocks)


def worker(wid: str = "w0") -> SimWorker:
    return SimWorker(wid, SMALL, ROOT)


class TestServeLinear:
    def test_a_cold_request_prefills_everything_then_decodes_and_reports_its_blocks(self):
        w = worker()
        served = serve_linear(w, request(0, 10, (1, 2)), 1.0, SMALL, SMALL.service())
        assert (served.cached, served.first, served.end, served.step_s, served.pulled) == (
            0, pytest.approx(1.1), pytest.approx(1.6), 0.1, 0)
        assert (w.free_at, w.prefilled_tokens, w.seq) == (pytest.approx(1.1), 10, 1)
        assert (served.events.worker_id, served.events.seq, served.events.rates) == ("w0", 0, None)
        assert [(type(e), e.block) for e in served.events.events] == [
            (BlockStored, BlockHash(1)), (BlockStored, BlockHash(2))]

    def test_the_next_waits_for_the_queue_and_takes_the_blocks_beside_a_decode(self):
        w = worker()
        service = SMALL.service()
        serve_linear(w, request(0, 10, (1, 2)), 1.0, SMALL, service)
        served = serve_linear(w, request(1, 10, (1, 2)), 1.0, SMALL, service)
        # starts at 1.1 (the queue); 8 tokens cached, 2 new at 100/s slowed by one decode x 1.5
        assert (served.cached, served.first) == (8, pytest.approx(1.1 + 0.02 * 1.5))
        assert w.prefilled_tokens == 12
        later = serve_linear(w, request(2, 6, (7,)), 5.0, SMALL, service)
        assert later.first == pytest.approx(5.06)   # both decodes ended: no slowdown

    def test_a_whole_prompt_held_still_computes_its_last_token(self):
        w = worker()
        serve_linear(w, request(0, 8, (1, 2)), 0.0, SMALL, SMALL.service())
        assert serve_linear(w, request(1, 8, (1, 2)), 9.0, SMALL, SMALL.service()).cached == 7

    def test_blocks_past_the_last_breakpoint_are_not_stored(self):
        w = worker()
        served = serve_linear(w, request(0, 12, (1, 2, 3), write_blocks=1), 0.0, SMALL,
                              SMALL.service())
        assert [e.block for e in served.events.events] == [BlockHash(1)]
        assert w.match([BlockHash(1), BlockHash(2)]) == (1, 0)
        nothing = serve_linear(worker("w1"), request(1, 12, (1, 2, 3), write_blocks=0), 0.0,
                               SMALL, SMALL.service())
        assert nothing.events is None

    def test_a_planned_pull_arrives_first_and_its_tokens_are_cached(self):
        linked = replace(SMALL, link_gbps=8.0, link_fixed_s=0.5)   # 1 GB/s after 0.5 s
        source, receiver = worker("w1"), worker("w0")
        source.insert([BlockHash(1), BlockHash(2)])
        source.drain_events()
        served = serve_linear(receiver, request(0, 10, (1, 2)), 1.0, linked, linked.service(),
                              source, PullChoice("w1", 2, 8, 0.5))
        pull_s = 0.5 + 8 * linked.kv_bytes_per_token / 1e9
        assert (served.pulled, served.cached) == (8, 8)
        assert served.first == pytest.approx(1.0 + pull_s + 0.02)
        assert served.events.rates == WorkerRates(linked.kv_bytes_per_token, None, 100.0)
