"""Stored request bodies for the job runner's tests: ``{"prompt": [...], "max_tokens": n}``."""
from __future__ import annotations

import json

from cluster.jobs.store import NewRequest, StagedRequest
from workers.messages import SamplingParams


def prepare_body(body: bytes) -> NewRequest:
    """A stored body as a request; a prompt token < 0 is refused."""
    spec = json.loads(body)
    if any(t < 0 for t in spec["prompt"]):
        raise ValueError("prompt: token ids must be >= 0")
    return NewRequest(custom_id="", prompt=tuple(spec["prompt"]),
                      sampling=SamplingParams(max_tokens=spec["max_tokens"]))


def staged_requests(*specs: tuple[list[int], int]) -> list[StagedRequest]:
    """One staged request per ``(prompt, max_tokens)``, custom ids r0, r1, ..."""
    return [StagedRequest(i, f"r{i}", b"", json.dumps({"prompt": p, "max_tokens": n}).encode())
            for i, (p, n) in enumerate(specs)]
