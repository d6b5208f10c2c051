"""Requests for a lone ``Engine`` the engine's tests share: a request in one of its tenants'
namespaces (each with an id of its own), a seeded random prompt, and one request run whole."""
from __future__ import annotations

import random

from workers.engine.engine import Engine
from workers.messages import GenerateRequest, GenerateResult, SamplingParams

_ids = iter(range(10**9))


def req(engine: Engine, prompt, max_tokens: int = 6, tenant: str = "t", **sampling
        ) -> GenerateRequest:
    return GenerateRequest(f"r{next(_ids)}", engine.namespace(tenant), tuple(prompt),
                           SamplingParams(max_tokens=max_tokens, **sampling))


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def run_one(engine: Engine, request: GenerateRequest) -> GenerateResult:
    (result,) = engine.generate([request])
    assert isinstance(result, GenerateResult), result
    return result
