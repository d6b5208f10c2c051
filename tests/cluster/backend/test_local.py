"""``LocalBackend``, the one ``Backend`` over in-process engines: what the pool does with its
workers' lives. A router view that missed a batch is rebuilt from the worker's holdings by the
pool's check. A worker whose engine breaks under a request: ``test_backend.py``."""
from __future__ import annotations

from cluster.backend.local import LocalBackend
from router.kv.events import BlockRemoved, EventBatch, Tier
from router.kv.key import hash_blocks
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.requests import routed_request
from workers.engine.engine import EngineConfig

BLOCK = 16
PROMPT = tuple(range(40, 40 + 6 * BLOCK + 5))   # 6 full blocks and 5 tokens


def test_a_view_that_missed_a_batch_is_rebuilt_from_the_workers_holdings():
    async def scenario():
        backend = LocalBackend(tiny_model(), workers=2, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        try:
            home = (await backend.generate(*routed_request(backend, "a", PROMPT, 2))).worker_id
            routes = backend.pool.routes
            held = await backend.pool.get(home).handle.holdings()
            ns = backend.model_info().namespace("t")
            # a batch that arrives after a lost one and says the blocks went: the view is
            # wrong, and the gap in the sequence marks it stale
            lost = EventBatch(home, routes.feed_after(home) + 2,
                              tuple(BlockRemoved(h, ns.label(), Tier.MEMORY) for h in held.blocks))
            routes.apply(home, [lost])
            stale = routes.stale_workers()
            before = {s.worker_id: s.blocks_held for s in routes.router.workers()}
            await backend.pool.check()
            after = {s.worker_id: s.blocks_held for s in routes.router.workers()}
            probe = PROMPT[:6 * BLOCK] + (7,)
            decision = routes.router.route(ns, hash_blocks(probe, BLOCK, ns), len(probe))
            return home, len(held.blocks), stale, before, after, routes.stale_workers(), decision
        finally:
            await backend.close()

    home, blocks, stale, before, after, stale_after, decision = run_bounded(
        scenario(), 60, "a rebuild")
    (other,) = {"local-0", "local-1"} - {home}
    assert blocks == 6 and stale == [home]
    assert before == {home: 0, other: 0} and after == {home: 6, other: 0}
    assert stale_after == []
    assert (decision.worker_id, decision.reason.value, decision.expected_cached_tokens) == (
        home, "prefix_match", 6 * BLOCK)
