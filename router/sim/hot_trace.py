"""A hot-document trace: a few long shared documents, many short questions on them, at an
arrival rate above what one holder of a document can serve.

What a pull between workers is for (``router.sim.pulls``): a document's holder saturates,
and the router must choose between its queue, recomputing the document elsewhere, and pulling
it. Each request is a document (``document_blocks`` blocks of 512 tokens) and one question
block, with a short answer; the documents' popularity is Zipf-like (document ``k`` drawn with
weight ``1 / (k + 1)``), arrivals Poisson at ``rate_per_s``. At the defaults the hottest
document alone gets about 48% of 60 requests/s, 29 a second, while a holder at the
simulator's 6,000 prefill tokens/s serves at most about 23 questions a second (256 new tokens
each on average) with nothing else to do: one holder of it is not enough.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from router.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class HotShape:
    requests: int = 6000
    rate_per_s: float = 60.0
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
