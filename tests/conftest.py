"""Shared pytest set-up: OpenBLAS before any MLX import, the test clock, the eviction policies.

``Clock`` is the one clock tests hand to stores, ledgers, routers and tracers: it reads
``clock.now``, which the test sets. The ``eviction`` fixture runs a test once per eviction
policy (``router.kv.ledger.Eviction``).
"""
from __future__ import annotations

import json
import os

import pytest

import workers  # noqa: F401  (loads OpenBLAS before mlx on Linux)
from router.kv.ledger import Eviction


def pytest_collection_modifyitems(config, items):
    """Under mutmut, a mutant's tests run fastest first, as mutmut's own fork mode runs them
    (its fork server runs them in set order), so the test that kills it soonest runs first."""
    if os.environ.get("MUTANT_UNDER_TEST", "") in ("", "stats", "fail"):
        return
    try:
        with open("mutmut-stats.json", encoding="utf-8") as stats:
            durations = json.load(stats)["duration_by_test"]
    except OSError:
        return
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))


class Clock:
    """Time that moves only when the test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bounded(request):
    """The test fails after ``tests.bounded.WALL_CLOCK_LIMIT_S`` of wall-clock time."""
    from tests.support.bounded import wall_clock_limit
    with wall_clock_limit(request.node.nodeid):
        yield


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=list(Eviction), ids=[e.value for e in Eviction])
def eviction(request) -> Eviction:
    """Each eviction policy in turn: store behaviour that does not depend on it holds under both."""
    return request.param
