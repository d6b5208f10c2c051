"""A worker's measured links from its peers: what each pull it made took.

The receiver of a pull times it (``cluster.backend.pull``'s ``PullOutcome``: the bytes it
stored from the peer over the pull's wall time, connection and checks included) and folds
it into that peer's figures by ``router.pull_cost.observed``: a pull of at least
``BANDWIDTH_PULL_BYTES`` moves the bandwidth, a smaller one the fixed cost, each a moving
average. A pull that ended early (refused, truncated, too slow) measured its failure, not the
link, and is left out, as is one that moved nothing.

The worker reports the figures with its block events: the newest ``EventBatch`` it sends a
router (with a result, or on its event feed) carries them as ``router.kv.events.LinkMeasure``s
(``cluster.backend.worker_actor``), so every router that hears the worker costs its pulls on
them; the disk tier's read bandwidth reaches the routers the same way. A pull stores blocks,
so the result of the request that pulled carries its figures.
"""
from __future__ import annotations

from cluster.backend.wire import PullOutcome
from router.kv.events import LinkMeasure
from router.pull_cost import DEFAULT_LINK, LinkRate, observed


class LinkMeter:
    """The links from each peer this worker pulled from, as its pulls measured them."""

    def __init__(self, default: LinkRate = DEFAULT_LINK) -> None:
        self._default = default
        self._links: dict[str, LinkRate] = {}
        self._report: tuple[LinkMeasure, ...] = ()

    def observe(self, outcome: PullOutcome) -> None:
        """A pull this worker made: its peer's figures follow it when it ran to its end."""
        if outcome.refused or outcome.nbytes <= 0 or outcome.seconds <= 0:
            return
        now = self._links.get(outcome.peer, self._default)
        self._links[outcome.peer] = observed(now, outcome.nbytes, outcome.seconds)
        self._report = tuple(LinkMeasure(peer, rate.bytes_s, rate.fixed_s)
                             for peer, rate in sorted(self._links.items()))

    def report(self) -> tuple[LinkMeasure, ...]:
        """Every measured link, by peer id (empty until a pull has run to its end)."""
        return self._report
