"""A mixed batch for speculation's tests: six requests, three at a time, stepped to the end.

Engines here run on an injected clock that never moves (``now_ns`` returns 0), so the step's
cost model has nothing measured and every proposed draft is verified: the tests exercise the
verify pass, never the machine's speed. Even requests have something to copy (a passage and
its first 10 tokens again), odd ones are random.
"""
from __future__ import annotations

import random

from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def copying_prompt(i: int) -> list[int]:
    """Even ``i``: a passage and its first 10 tokens again (something to copy); odd: random."""
    base = prompt_of(20 + 5 * i, seed=i)
    return base + base[:10] if i % 2 == 0 else base


def engine(speculate: bool, **config) -> Engine:
    config = {"block_size": 16, "max_batch": 3, **config}
    return Engine.open(tiny_model("llama"), EngineConfig(speculate=speculate, **config),
                       clock=Clock(), now_ns=lambda: 0)


def requests(eng: Engine, tag: str, **sampling) -> list[GenerateRequest]:
    """Six requests, three at a time (max_batch 3): later ones join as earlier ones leave,
    while the others are in the middle of their drafts."""
    return [GenerateRequest(f"{tag}{i}", eng.namespace("t"), tuple(copying_prompt(i)),
                            SamplingParams(**{"max_tokens": 30 + 7 * i, **sampling}))
            for i in range(6)]


def drive(eng: Engine, reqs: list[GenerateRequest], abort: tuple[str, int] | None = None
          ) -> tuple[dict[str, list[list[int]]], dict[str, GenerateResult]]:
    """Step to completion; each request's tokens grouped by step. ``abort=(id, n)``: abort
    ``id`` once it has at least n tokens."""
    for r in reqs:
        eng.submit(r)
    steps: dict[str, list[list[int]]] = {r.request_id: [] for r in reqs}
    done: dict[str, GenerateResult] = {}
    while eng.busy:
        if abort and sum(map(len, steps[abort[0]])) >= abort[1]:
            assert eng.abort(abort[0])
            abort = None
        out = eng.step()
        grouped: dict[str, list[int]] = {}
        for d in out.deltas:
            grouped.setdefault(d.request_id, []).append(d.token)
        for rid, tokens in grouped.items():
            steps[rid].append(tokens)
        done.update({f.request_id: f for f in out.finished})
    return steps, done


def flat(steps: list[list[int]]) -> list[int]:
    return [t for group in steps for t in group]
