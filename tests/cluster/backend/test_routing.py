"""``cluster.backend.routing.FrontendRouter``: a worker's feed followed, batches applied once
in order, and the feed's heartbeat telling a lost last batch from an applied one."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from cluster.backend.routing import FeedHeartbeat, FrontendRouter
from router.kv.events import BlockStored, EventBatch
from router.kv.key import BlockHash
from tests.support.bounded import run_bounded

BLOCK = 16


def stored(seq: int, block: int) -> EventBatch:
    return EventBatch("w0", seq, (BlockStored(BlockHash(block), BlockHash(0), BLOCK, "ns"),))


class ScriptedFeed:
    """A feed that yields the given items, then waits until it is cancelled."""

    def __init__(self, items: Sequence[Sequence[EventBatch] | FeedHeartbeat]) -> None:
        self.items = list(items)
        self.asked_after: list[int] = []
        self.done = asyncio.Event()

    async def __call__(self, after: int) -> AsyncIterator[Sequence[EventBatch] | FeedHeartbeat]:
        self.asked_after.append(after)
        for item in self.items:
            yield item
        self.done.set()
        await asyncio.Event().wait()


def test_a_followed_feed_applies_its_batches_and_a_heartbeat_past_them_is_a_gap():
    async def scenario():
        routes = FrontendRouter(BLOCK)
        feed = ScriptedFeed([FeedHeartbeat(0), (stored(1, 11), stored(2, 12)),
                             FeedHeartbeat(2), FeedHeartbeat(4)])
        routes.add_worker("w0", feed)
        await feed.done.wait()
        got = (feed.asked_after, routes.feed_after("w0"), routes.stale_workers(),
               routes.router.index_counters().sequence_gaps)
        await routes.close()
        return got

    assert run_bounded(scenario(), 30, "a scripted feed") == ([0], 2, ["w0"], 1)


def test_a_heartbeat_at_or_behind_what_was_applied_changes_nothing():
    routes = FrontendRouter(BLOCK)
    routes.add_worker("w0")
    routes.apply("w0", (stored(1, 11), stored(2, 12)))
    for seq in (0, 1, 2):
        routes.heard("w0", FeedHeartbeat(seq))
    routes.heard("gone", FeedHeartbeat(9))   # a removed worker's late heartbeat
    assert (routes.stale_workers(), routes.router.index_counters().sequence_gaps) == ([], 0)
    routes.heard("w0", FeedHeartbeat(3))
    routes.apply("w0", (stored(4, 14),))    # the batch after the lost one: no second gap
    assert (routes.stale_workers(), routes.router.index_counters().sequence_gaps) == (["w0"], 1)
