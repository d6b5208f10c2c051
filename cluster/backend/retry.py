"""The cluster's one retry policy, used by every backend (and the job runner's backoff).

A request whose worker dies under it runs again on another worker::

    attempt 1 on the routed worker ─► WorkerFailed (its engine broke, its actor or node died)
      ├─ nothing sent to the caller yet, attempts left ─► routed again (the dead worker is
      │                                                    already out of the router)
      └─ chunks already sent (they cannot be taken back), or MAX_ATTEMPTS spent
                                                       ─► NoWorkerAvailable ("retry it")

No worker to route to at all (``NoWorkerAvailable`` from routing) is not retried here: the job
runner waits ``NO_WORKER_BACKOFF_S`` between tries while the request's deadline allows
(workers may be scaling or restarting); a streamed ``Generate`` reports it at once.
"""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Callable, TypeVar

from cluster.backend.protocol import NoWorkerAvailable
from workers.messages import WorkerFailed

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3   # workers tried per request: two deaths in a row are survived
NO_WORKER_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)

T = TypeVar("T")


async def retried(request_id: str, attempt: Callable[[int], AsyncIterator[T]],
                  is_final: Callable[[T], bool]) -> AsyncIterator[T]:
    """Items of ``attempt(1)``, or of the next attempt while its worker failed early.

    ``attempt(n)`` raises ``WorkerFailed`` when its worker dies; ``is_final`` tells the
    result from chunks (a result may be retried over, a chunk already sent may not).
    """
    for n in range(1, MAX_ATTEMPTS + 1):
        sent = False
        try:
            async with contextlib.aclosing(attempt(n)) as items:
                async for item in items:
                    sent = sent or not is_final(item)
                    yield item
            return
        except WorkerFailed as exc:
            if sent or n == MAX_ATTEMPTS:
                raise NoWorkerAvailable(
                    f"request {request_id}: {exc} (attempt {n} of {MAX_ATTEMPTS}); "
                    "retry the request") from None
            log.info("request %s: retrying after %s", request_id, exc)
