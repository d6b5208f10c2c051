"""The worker actor's plain class, ``EngineWorker``, without Ray: a real engine on its runtime
thread, block events piggybacked on results and on its event feed (both applied to a real
frontend router, ``FrontendRouter``), requests aborted."""
from __future__ import annotations

import asyncio
import os

import pytest

from cluster.backend.protocol import TokenChunk
from cluster.backend.routing import FeedHeartbeat, FrontendRouter
from cluster.backend.worker_actor import EngineWorker, QuietWatch, WorkerDone
from router.kv.key import Namespace, hash_blocks
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

BLOCK = 16


def test_engine_worker_runs_streams_publishes_and_invalidates():
    async def scenario():
        routes = FrontendRouter(BLOCK)
        routes.add_worker("w7")
        router = routes.router
        worker = EngineWorker("w7", str(tiny_model()), EngineConfig(block_size=BLOCK))
        hello = await worker.start()
        assert hello.worker_id == "w7" and hello.model.block_size == BLOCK and hello.openblas
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        prompt = tuple(range(20, 84))

        decision = router.route(ns, hash_blocks(prompt, BLOCK, ns), len(prompt))
        router.started("a", decision)
        items = [i async for i in worker.generate(generate_request("a", prompt, 5, ns=ns), feed_after=0)]
        assert all(isinstance(i, TokenChunk) for i in items[:-1])
        assert isinstance(items[-1], WorkerDone) and len(items) == 6
        router.finished("a")
        assert items[-1].worker_s > 0
        # the result carries every block event batch so far: 64 prompt tokens = 4 blocks
        piggybacked = items[-1].events
        assert [b.seq for b in piggybacked] == list(range(1, len(piggybacked) + 1))
        assert sum(len(b.events) for b in piggybacked) == len(prompt) // BLOCK

        # the result's block events reach the router: the prefix is routed home, matched
        routes.apply("w7", piggybacked)
        again = router.route(ns, hash_blocks(prompt + (5,), BLOCK, ns), len(prompt) + 1)
        assert again.worker_id == "w7" and again.expected_cached_tokens == len(prompt)
        done = await worker.run(generate_request("b", prompt + (5,), ns=ns))
        assert done.result.cached_tokens == len(prompt)

        stats = await worker.stats()
        assert stats.requests_served == 2 and stats.cached_tokens == len(prompt)
        holdings = await worker.holdings()
        assert stats.cache_blocks == len(holdings.blocks) == len(prompt) // BLOCK
        assert stats.written_tokens == len(prompt)
        assert holdings.seq == piggybacked[-1].seq  # request b stored no new full block
        assert await worker.ping() == os.getpid()  # answered by this process (no Ray here)

        with pytest.raises(ValueError, match="vocabulary"):
            await worker.run(generate_request("bad", (10**9,), ns=ns))
        with pytest.raises(ValueError, match="namespace"):
            await worker.invalidate(None, None)
        assert await worker.invalidate(Namespace("nobody", "x"), None) == 0
        removed = await worker.invalidate(ns, None)
        assert removed == len(prompt) // BLOCK and (await worker.holdings()).blocks == ()
        # no result carried the removals: the event feed does, at once
        routes.apply("w7", await anext(worker.events(routes.feed_after("w7"))))
        after = router.route(ns, hash_blocks(prompt + (5,), BLOCK, ns), len(prompt) + 1)
        assert after.expected_cached_tokens == 0, "invalidation reaches the router"
        await worker.close()

    asyncio.run(scenario())


def test_calls_before_start_fail_cleanly():
    async def scenario():
        worker = EngineWorker("w0", str(tiny_model()), EngineConfig(block_size=BLOCK))
        with pytest.raises(RuntimeError, match="start"):
            await asyncio.wait_for(worker.stats(), 5)
        with pytest.raises(RuntimeError, match="start"):
            await asyncio.wait_for(worker.run(generate_request("x", (1, 2), ns=Namespace("t", "m"))), 5)
    asyncio.run(scenario())


def test_a_worker_with_a_disk_tier_sends_its_measured_rates_with_its_events(tmp_path):
    """The block events a result carries carry the worker's rates: after a request read its
    prefix from disk, the frontend's router costs a token on that disk exactly as the rates
    say."""
    from router.kv.events import WorkerRates
    from router.policy import disk_token_cost

    config = EngineConfig(block_size=BLOCK, store_bytes=1 << 20, disk_bytes=1 << 22,
                          disk_dir=str(tmp_path))
    prompt = tuple(range(20, 84)) + (1, 2, 3)

    async def scenario():
        worker = EngineWorker("w7", str(tiny_model()), config)
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        done = await worker.run(generate_request("a", prompt, 2, ns=ns), feed_after=0)
        await worker.close()  # the memory tier is written to disk
        return done, hello

    asyncio.run(scenario())
    done, hello = asyncio.run(scenario())  # restarted: the prefix is read from disk
    assert done.result.lookup.disk_tokens == 64
    rates = done.events[-1].rates
    assert isinstance(rates, WorkerRates)
    assert rates.disk_bytes_per_token == hello.model.disk_kv_bytes_per_token
    assert rates.disk_read_bytes_s > 0 and rates.prefill_tokens_s > 0
    routes = FrontendRouter(BLOCK)
    routes.add_worker("w7")
    routes.apply("w7", done.events)
    (status,) = routes.router.workers()
    assert status.disk_token_cost == disk_token_cost(rates)


def test_two_frontends_routers_following_one_worker_each_get_every_batch_without_a_gap():
    """What frontend A's results carried to A's router is not skipped by B's feed: B's
    router (no request of its own) learns every block from its feed, sees no gap and
    believes exactly what A's router believes."""
    async def scenario():
        worker = EngineWorker("w0", str(tiny_model()), EngineConfig(block_size=BLOCK))
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        a, b = FrontendRouter(BLOCK), FrontendRouter(BLOCK)
        a.add_worker("w0")
        b.add_worker("w0", lambda after: worker.events(after, "router-b"))
        for i in range(3):
            prompt = tuple(range(20 + 50 * i, 84 + 50 * i))
            done = await worker.run(generate_request(f"r{i}", prompt, 2, ns=ns),
                                    a.feed_after("w0"), "router-a")
            a.apply("w0", done.events)
        last = a.feed_after("w0")
        for _ in range(500):   # B's feed delivers after its quiet period (FEED_QUIET_S)
            if b.feed_after("w0") == last:
                break
            await asyncio.sleep(0.01)
        held = await worker.holdings()
        beliefs = [r.router.workers()[0].blocks_held for r in (a, b)]
        probe = tuple(range(120, 184)) + (1,)
        matched = [r.router.route(ns, hash_blocks(probe, BLOCK, ns), len(probe))
                   .expected_cached_tokens for r in (a, b)]
        stale = (a.stale_workers(), b.stale_workers())
        await b.close()
        await worker.close()
        return last, held, b.feed_after("w0"), beliefs, matched, stale

    last, held, b_last, beliefs, matched, stale = asyncio.run(scenario())
    assert last == held.seq and b_last == last        # B caught up to A's last batch
    assert beliefs == [len(held.blocks)] * 2 == [12, 12]   # 3 prompts x 4 blocks
    assert matched == [64, 64] and stale == ([], [])



def test_a_router_that_lost_the_last_batch_learns_it_from_the_heartbeat_and_rebuilds():
    """Router A's result carried the worker's batch but was never applied (its caller went
    away), so A's feed skips it and no later batch shows a gap. At the heartbeat A's feed
    names the last batch: A is stale, counted once, and rebuilt from the holdings it matches
    the prompt again. Router B applied everything: its heartbeat changes nothing. (Each feed
    is read by hand: a heartbeat wakes it at once, no quiet period, no clock.)"""
    async def scenario():
        worker = EngineWorker("w0", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              heartbeat_s=None)
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        a, b = FrontendRouter(BLOCK), FrontendRouter(BLOCK)
        a.add_worker("w0")
        b.add_worker("w0")
        a_feed = worker.events(a.feed_after("w0"), "router-a")
        opened = await anext(a_feed)            # a feed starts with a heartbeat
        prompt = tuple(range(20, 84))
        done = await worker.run(generate_request("r", prompt, 2, ns=ns), 0, "router-a")
        b.apply("w0", done.events)              # B applied it; A lost it
        last = done.events[-1].seq
        before = (a.stale_workers(), a.router.index_counters().sequence_gaps, a.feed_after("w0"))
        b_feed = worker.events(b.feed_after("w0"), "router-b")
        b_opened = await anext(b_feed)
        worker.heartbeat()
        beats = (await anext(a_feed), await anext(b_feed))
        a.heard("w0", beats[0])
        b.heard("w0", beats[1])
        stale = (a.stale_workers(), a.router.index_counters().sequence_gaps, b.stale_workers())
        a.rebuild("w0", await worker.holdings())
        probe = prompt + (1,)
        matched = a.router.route(ns, hash_blocks(probe, BLOCK, ns), len(probe))
        after = (a.stale_workers(), a.feed_after("w0"), matched.expected_cached_tokens)
        for feed in (a_feed, b_feed):
            await feed.aclose()
        await worker.close()
        return opened, last, before, b_opened, beats, stale, after

    opened, last, before, b_opened, beats, stale, after = asyncio.run(scenario())
    assert opened == FeedHeartbeat(0) and last == 1   # the prompt's 4 blocks, in one batch
    assert before == ([], 0, 0)                # nothing seen: no later batch to show a gap
    assert b_opened == FeedHeartbeat(1)
    assert beats == (FeedHeartbeat(1), FeedHeartbeat(1))
    assert stale == (["w0"], 1, [])
    assert after == ([], last, 64)


def test_the_heartbeat_timer_beats_only_after_a_look_with_no_new_batch():
    watch = QuietWatch(3)
    assert [watch.quiet(seq) for seq in (3, 4, 4, 4, 9, 9)] == [
        True, False, True, True, False, True]


def test_spans_wait_after_the_results_and_close_draws_those_still_waiting(tmp_path):
    """Finished requests' spans are drawn off the path back (``spans_after_s`` later, here
    never by the timer): a worker closed before that still draws every one, once."""
    from cluster.telemetry.otlp_json import read_spans
    from cluster.telemetry.setup import SERVICE_FRONTEND, TelemetrySettings, request_context
    from cluster.telemetry.setup import setup_telemetry

    frontend = setup_telemetry(TelemetrySettings(SERVICE_FRONTEND, tmp_path))

    async def scenario():
        worker = EngineWorker("w4", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              telemetry=TelemetrySettings("orchard", tmp_path),
                              spans_after_s=3600.0)
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        roots = []
        for rid in ("a", "b"):
            with frontend.tracer.start_as_current_span(f"chat {rid}") as root:
                done = await worker.run(GenerateRequest(rid, ns, tuple(range(30, 70)),
                                                        SamplingParams(max_tokens=2),
                                                        trace_context=request_context()))
            assert done.traced
            roots.append(format(root.get_span_context().trace_id, "032x"))
        await worker.close()
        return roots

    roots = asyncio.run(scenario())
    frontend.shutdown()
    spans = [s for s in read_spans(tmp_path / "traces").spans if s.service == "orchard-worker"]
    for trace_id in roots:
        names = sorted(s.name for s in spans if s.trace_id == trace_id)
        assert names == ["orchard.cache.lookup", "orchard.decode", "orchard.prefill",
                         "orchard.worker.generate"]
    assert len(spans) == 8
