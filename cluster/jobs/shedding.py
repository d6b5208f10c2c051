"""Load shedding: an interactive request that would start too late is refused at once.

A request outside any job is checked before it is tokenized (``cluster.jobs.direct``). Its
time to first token is predicted from the queue in front of it and from what the cluster
measured, both moving averages (``workers.rates.moving_average``, the one the engine's step
budget uses):

    slot_s   how long a request holds one of the runner's slots (dispatch to its end), over
             every request, jobs' included: the slots free at ``capacity / slot_s`` a second,
             ``capacity`` the slots interactive requests take turns on (all of them, less the
             batch floor while batch requests wait: ``cluster.jobs.slots``)
    ttft_s   an interactive request's time to first token on its worker (``ttft_s`` of the
             engine's result: the engine's queue, the prefill budget and the prefill itself)
    dev_s    the mean deviation of those TTFTs from their average (as TCP estimates its
             retransmission timeout from the round trip's mean and deviation, RFC 6298)

    wait      = 0                                   a slot is free and nobody waits for one
              = (ahead + 1) x slot_s / capacity     else: the interactive requests ``ahead``
                                                    (admitted, no slot yet: being tokenized
                                                    or waiting) take the next freed slots
    predicted = wait + ttft_s + SPREAD x dev_s

``SPREAD`` is 2: the target is that 95% of accepted requests meet their deadline, so the
prediction aims near the 95th percentile of the TTFT (two deviations above the mean of a
normal spread), not at its mean, which half of them would miss. The wait is a sum over many
requests ahead, so its mean is what it takes.

The bound is the earlier of the caller's deadline (``remaining_s``) and the configured
``[limits] max_ttft_s`` (0: none). A request whose prediction exceeds it is refused with
``Shed`` (``RESOURCE_EXHAUSTED``, HTTP 429) and a ``Retry-After`` of the seconds the queue needs
to drain until the prediction fits, ``predicted - bound``, at most ``wait`` (past that the queue
is empty and retrying sooner or later changes nothing), rounded up to whole seconds and at
least 1. Until both averages have a measurement nothing is predicted and nothing is shed.

**The bound holds after admission too.** A prediction can be wrong (a slot frees later than
its average, a batch prompt's prefill runs long), and a request served past its bound is what
shedding exists to avoid. So under ``max_ttft_s`` an admitted request (its ``first_token_by``: its
admission plus the bound) is refused with ``Late`` (a ``Shed``, the same status and
``Retry-After``) instead of served late: when it gets its slot with less time left than its
worker's predicted TTFT (``ttft_s + SPREAD x dev_s``), or when its first token has not come
by that time (the request is aborted on its worker). Its client has waited, but it learns at
the bound, not after it, and no worker spends more on it. A caller's own deadline stays what
it was: the call's timeout (``DEADLINE_EXCEEDED``).

Batch work (jobs) is never shed: it is only slowed, by the slots' and the engine's priority.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.jobs.admission import RetryLater
from workers.rates import moving_average

SPREAD = 2.0  # deviations of the TTFT above its mean that the prediction takes


class Shed(RetryLater):
    """An interactive request refused because it would start after its deadline."""


class Late(Shed):
    """An admitted interactive request refused because its first token would come, or has
    not come, by its bound."""


@dataclass(frozen=True, slots=True)
class QueueState:
    """The runner's slots as a new interactive request finds them."""

    capacity: int   # slots interactive requests take turns on (the batch floor aside)
    in_use: int     # slots held now
    ahead: int      # interactive requests admitted without a slot yet (tokenizing, waiting)


@dataclass(frozen=True, slots=True)
class Prediction:
    wait_s: float   # until the request holds a slot
    ttft_s: float   # wait and the worker's time to first token

    def retry_after_s(self, bound_s: float) -> int:
        """Whole seconds until the queue has drained enough for ``bound_s`` to be met."""
        return max(1, math.ceil(min(self.ttft_s - bound_s, self.wait_s)))


class LoadShedder:
    """What the runner measured of its requests, and the check every interactive request
    passes. ``max_ttft_s``: the configured bound (0: only callers' deadlines)."""

    def __init__(self, max_ttft_s: float = 0.0):
        if max_ttft_s < 0:
            raise ValueError(f"max_ttft_s must be >= 0 (0: no bound), got {max_ttft_s}")
        self._max_ttft_s = max_ttft_s
        self._slot_s = 0.0   # 0.0: not measured yet
        self._ttft_s = 0.0
        self._dev_s = 0.0

    def observe_slot(self, seconds: float) -> None:
        """A request (of a job or not) held its slot ``seconds``."""
        if seconds > 0:
            self._slot_s = moving_average(self._slot_s, seconds)

    def observe_ttft(self, seconds: float) -> None:
        """An interactive request's first token came ``seconds`` after its worker got it."""
        if seconds > 0:
            if self._ttft_s:  # the deviation from the average before this measurement
                self._dev_s = moving_average(self._dev_s, abs(seconds - self._ttft_s))
            self._ttft_s = moving_average(self._ttft_s, seconds)

    @property
    def max_ttft_s(self) -> float:
        """The configured bound (0: none)."""
        return self._max_ttft_s

    @property
    def slot_s(self) -> float | None:
        """How long a request holds a slot (moving average), None before the first."""
        return self._slot_s or None

    def predict(self, queue: QueueState) -> Prediction | None:
        """A new interactive request's predicted wait and TTFT (None: not measured yet)."""
        if not (self._slot_s and self._ttft_s):
            return None
        free = queue.in_use < queue.capacity and queue.ahead == 0
        wait = 0.0 if free else (queue.ahead + 1) * self._slot_s / queue.capacity
        return Prediction(wait, wait + self._ttft_s + SPREAD * self._dev_s)

    def bound(self, remaining_s: float | None) -> float | None:
        """The TTFT a new request must meet: its deadline or the configured bound."""
        bounds = [b for b in (remaining_s, self._max_ttft_s or None) if b is not None]
        return min(bounds) if bounds else None

    def worker_ttft_s(self) -> float | None:
        """A request's predicted time to first token once it holds a slot (None: not
        measured yet)."""
        return self._ttft_s + SPREAD * self._dev_s if self._ttft_s else None

    def late(self, queue: QueueState, bound_s: float, started: bool) -> Late:
        """The refusal of an admitted request that cannot meet, or has not met, ``bound_s``
        (``started``: it was running on its worker and was aborted)."""
        prediction = self.predict(queue)
        retry = prediction.retry_after_s(bound_s) if prediction else 1
        where = ("its first token had not come" if started else
                 "it got its slot too late for its first token to come")
        return Late(f"overloaded: {where} within its {bound_s:.2f} s bound; retry after "
                    f"{retry} s, or submit the work as a batch job, which is never refused",
                    retry)

    def check(self, queue: QueueState, remaining_s: float | None) -> None:
        """Raise ``Shed`` when a new interactive request would miss its bound."""
        bound = self.bound(remaining_s)
        prediction = self.predict(queue)
        if bound is None or prediction is None or prediction.ttft_s <= bound:
            return
        retry = prediction.retry_after_s(bound)
        raise Shed(f"overloaded: a new interactive request would get its first token in about "
                   f"{prediction.ttft_s:.2f} s ({queue.ahead} waiting ahead of it for "
                   f"{queue.capacity} slots), past its {bound:.2f} s bound; retry after "
                   f"{retry} s, or submit the work as a batch job, which is never refused",
                   retry)
