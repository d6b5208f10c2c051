"""A streamed request's items through a ``Feed`` (``cluster.api.http_feed``): handed over in
order and ended, an error raised where it happened, and a cancelled feed running its source's
own cleanup. Every scenario runs under a wall-clock bound (tests/support/bounded.py)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.api.http_feed import Feed
from tests.support.bounded import run_bounded


async def _drain(feed: Feed) -> list:
    items = []
    while True:
        try:
            items.append(await feed.next())
        except StopAsyncIteration:
            return items


class TestItems:
    def test_items_come_in_order_then_the_feed_ends(self):
        async def source():
            for i in range(3):
                yield i

        async def scenario():
            return await _drain(Feed(source()))

        assert run_bounded(scenario(), 10, "a feed of three items") == [0, 1, 2]

    def test_an_error_in_the_source_is_raised_after_the_items_before_it(self):
        async def source():
            yield "a"
            raise ValueError("the backend went away")

        async def scenario():
            feed = Feed(source())
            first = await feed.next()
            with pytest.raises(ValueError, match="^the backend went away$"):
                await feed.next()
            return first, await _drain(feed)

        assert run_bounded(scenario(), 10, "a feed whose source fails") == ("a", [])


class TestCancel:
    def test_a_cancelled_feed_ends_and_its_source_cleans_up(self):
        cleaned: list[str] = []

        async def source():
            try:
                yield "first"
                await asyncio.Event().wait()  # never set: only a cancel ends it
                yield "never"
            finally:
                cleaned.append("closed")

        async def scenario():
            feed = Feed(source())
            first = await feed.next()
            feed.cancel()
            return first, await _drain(feed), list(cleaned)

        assert run_bounded(scenario(), 10, "a cancelled feed") == ("first", [], ["closed"])
