"""Request factories the tests share: an engine request, a routed one, a planned one.

Each test file used to carry its own ``_request``; these are the shapes they had in common.
"""
from __future__ import annotations

from router.forecast import PlannedRequest
from router.kv.key import BlockHash, Namespace, hash_blocks
from workers.messages import GenerateRequest, SamplingParams

TINY_NS = Namespace("t", "tiny")


def generate_request(rid: str, prompt: tuple[int, ...], max_tokens: int = 4,
                     ns: Namespace = TINY_NS,
                     carrier: tuple[tuple[str, str], ...] = ()) -> GenerateRequest:
    """A greedy request for ``max_tokens`` tokens of ``prompt`` in namespace ``ns``."""
    return GenerateRequest(rid, ns, prompt, SamplingParams(max_tokens=max_tokens), carrier)


def routed_request(backend, rid: str, prompt: tuple[int, ...], max_tokens: int = 4,
                   tenant: str = "t", block: int = 16):
    """``(request, block hashes)`` for ``backend.generate``, in the namespace of its model."""
    info = backend.model_info()
    ns = Namespace(tenant, info.model_id, info.revision)
    return generate_request(rid, prompt, max_tokens, ns), hash_blocks(prompt, block, ns)


def planned_request(blocks, tokens: int, at: float, service: float = 0.0,
                    output: int = 1) -> PlannedRequest:
    """A request as the forecast sees it, its block hashes given as small integers."""
    return PlannedRequest(tuple(BlockHash(b) for b in blocks), tokens, at, service, output)
