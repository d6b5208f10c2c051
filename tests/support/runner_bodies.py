"""Stored request bodies for the job runner's tests: ``{"prompt": [...], "max_tokens": n}``,
and the wait for a job's own task to end."""
from __future__ import annotations

import asyncio
import json

from cluster.jobs.store import NewRequest, StagedRequest
from tests.support.bounded import wait_until
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


async def job_task_ended(job_id: str, what: str) -> None:
    """Until the job's own task (named after it) has ended. A job whose task ended unfinished
    is then a failed check, at once, rather than a wait for a job nothing will finish."""
    await wait_until(lambda: job_id not in {t.get_name() for t in asyncio.all_tasks()},
                     f"{what}: the job's task to end", timeout_s=5.0)
