"""Small simulator traces shared by the simulator's tests and ``orchard simulate``'s.

``HOT``: a 4,096-token document (8 blocks of ``BS`` tokens) and one question block each, 20
requests a second for 3 s: the second worker it reaches pulls the document when a link is
fast enough.
"""
from __future__ import annotations

from router.sim.trace import TraceRequest

BS = 512
# a 4,096-token document (8 blocks) and one question block each, 20 requests a second
HOT = [TraceRequest(i * 0.05, 9 * BS, 4, tuple(range(1, 9)) + (1000 + i,)) for i in range(60)]
