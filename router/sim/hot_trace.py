"""A hot-document trace: a few long shared documents, many short questions on them, at an
arrival rate above what one holder of a document can serve.

What a pull between workers is for (``router.sim.pulls``): a document's holder saturates,
and the router must choose between its queue, recomputing the document elsewhere, and pulling
it. Each request is a document (``document_blocks`` blocks of 512 tokens) and one question
block, with a short answer; the documents' popularity is Zipf-like (document ``k`` drawn with
weight ``1 / (k + 1)``), arrivals Poisson at ``rate_per_s``.

The rate, by a stated rule: the hottest document's arrivals are ``HOLDER_LOAD = 2`` times what
one holder of it serves (``holder_rate``: measured in the simulator's linear step model, a
burst of questions on a held document, decodes beside them, nothing else to do). At the
defaults one holder serves 18.5 questions a second (256 new tokens each on average, at 6,000
prefill tokens/s slowed 1% per running decode) and the hottest document gets 48% of the
arrivals (``hottest_share``), so ``rate_per_s = 2 x 18.5 / 0.48 = 77`` requests a second, 37
of them on the hottest document; 8 workers serve about 148 a second, so the cluster as a
whole is not overloaded, only one holder is. (Until this rule the rate was 60 a second: the
hottest document's 29 were 1.6 times one holder's 18.5.)
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from router.kv.key import Namespace
from router.sim.linear import SimWorker, serve_linear
from router.sim.simulator import SimConfig, to_requests
from router.sim.trace import TraceRequest

HOLDER_LOAD = 2.0   # the hottest document's arrivals over one holder's service rate


@dataclass(frozen=True, slots=True)
class HotShape:
    requests: int = 6000
    rate_per_s: float = 77.0      # HOLDER_LOAD x holder_rate / hottest_share, rounded
    documents: int = 4
    document_blocks: int = 16      # 8,192 tokens at 512 a block
    output: tuple[int, int] = (16, 64)
    block_size: int = 512

    def __post_init__(self) -> None:
        if min(self.requests, self.documents, self.document_blocks, self.block_size) < 1:
            raise ValueError("a hot-document trace needs at least one request, document, "
                             "document block and token per block")
        if self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be positive, got {self.rate_per_s}")


def hot_documents(shape: HotShape, seed: int) -> list[TraceRequest]:
    """The trace: each request a document's blocks and a question block of its own."""
    rng = random.Random(seed)
    docs = [tuple(range(d * shape.document_blocks, (d + 1) * shape.document_blocks))
            for d in range(shape.documents)]
    weights = [1.0 / (k + 1) for k in range(shape.documents)]
    question = shape.documents * shape.document_blocks   # the next unused block id
    out, now = [], 0.0
    for _ in range(shape.requests):
        now += rng.expovariate(shape.rate_per_s)
        doc = rng.choices(docs, weights)[0]
        tail = rng.randint(1, shape.block_size)
        length = len(doc) * shape.block_size + tail
        out.append(TraceRequest(round(now, 3), length, rng.randint(*shape.output),
                                doc + (question,)))
        question += 1
    return out


def hottest_share(shape: HotShape) -> float:
    """The share of the arrivals that ask about the hottest document."""
    return 1.0 / sum(1.0 / (k + 1) for k in range(shape.documents))


def holder_rate(shape: HotShape, config: SimConfig = SimConfig(), questions: int = 2000
                ) -> float:
    """Questions a second that one worker holding a document serves, in the simulator's
    linear step model (``router.sim.linear``): ``questions`` of them arrive at once on a
    document it holds, and the rate is their number over the time to the last one's first
    token."""
    burst = replace(shape, requests=questions + 1, documents=1, rate_per_s=1e9)
    requests = to_requests(hot_documents(burst, seed=0), config.block_size, shape.block_size)
    worker = SimWorker("holder", config, Namespace("trace", "trace").root())
    service = config.service()
    held = serve_linear(worker, requests[0], 0.0, config, service)   # it holds the document
    last = held
    for req in requests[1:]:
        last = serve_linear(worker, req, held.first, config, service)
    return questions / (last.first - held.first)
