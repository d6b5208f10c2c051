"""Pulls in the simulator: a prefix pulled from a peer's store, as ``cluster.backend.pull``
moves it between workers, on one link rate for every pair (``--link-gbps``).

The decision is orchard's own: the simulated ``Router`` is given ``PeerLinks`` at the link's
rate (``router.policy.with_pull``), and each simulated worker reports its prefill rate with
its block events, as a real worker does. Serving a planned pull (the linear service model)::

    arrival ─► the plan's blocks the source holds (memory or disk), past those the receiver
               holds in memory, at fixed_s + bytes / link ─► stored on the receiver
           ─► the receiver's FIFO prefill queue, as any request

The source's own requests are not slowed: serving a pull costs a holder one window's
encoding per engine step (its measured cost: ``orchard bench pull``'s
``holder_tpot_during_pull_over_alone``), and the router plans at most
``MAX_PULLS_PER_SOURCE`` from one holder at a time (``router.pull_cost``), which bounds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router.kv.key import BlockHash
from router.kv.tiers import TieredLedger
from router.pull_cost import LinkRate


@dataclass(frozen=True, slots=True)
class SimPull:
    blocks: int      # the prompt's leading blocks the receiver holds after the pull
    tokens: int      # tokens pulled
    seconds: float


def pull_between(receiver: TieredLedger, source: TieredLedger, hashes: Sequence[BlockHash],
                 blocks: int, block_size: int, link: LinkRate, bytes_per_token: int
                 ) -> SimPull:
    """What a pull of ``hashes``' first ``blocks`` from ``source`` brings ``receiver``, and
    how long it takes (nothing, at no cost, when the source holds no more than it)."""
    want = hashes[:blocks]
    memory, disk = source.peek(want)
    held = memory + disk
    own, _ = receiver.peek(want)
    if held <= own:
        return SimPull(own, 0, 0.0)
    tokens = (held - own) * block_size
    return SimPull(held, tokens, link.seconds(tokens * bytes_per_token))
