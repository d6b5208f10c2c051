"""Admission (backpressure): the requests accepted and not yet finished, per tenant.

A job's requests count from their acceptance until each has a result; a request outside any
job (``cluster.jobs.direct``) from before it is tokenized until its stream ends. An ``admit``
that would take a tenant past ``max_per_tenant``, or the cluster past ``max_total``, raises
``Overloaded`` (``RESOURCE_EXHAUSTED`` at the edge) and counts nothing. On start the counts come
back from the job store (``reset``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping


class Overloaded(RuntimeError):
    """Too many requests pending: the caller should retry later."""


class Admission:
    def __init__(self, max_per_tenant: int, max_total: int):
        self._max_tenant = max_per_tenant
        self._max_total = max_total
        self._pending: dict[str, int] = {}

    def admit(self, tenant: str, n: int) -> None:
        """Count ``n`` more pending requests for ``tenant``, or raise ``Overloaded``."""
        mine = self._pending.get(tenant, 0)
        total = sum(self._pending.values())
        if mine + n > self._max_tenant:
            raise Overloaded(f"requests: tenant {tenant!r} has {mine} requests pending and the "
                             f"limit is {self._max_tenant}; wait for jobs to finish and retry")
        if total + n > self._max_total:
            raise Overloaded(f"requests: the cluster has {total} requests pending and the limit "
                             f"is {self._max_total}; retry later")
        self._pending[tenant] = mine + n

    def add(self, tenant: str, n: int) -> None:
        """Count ``n`` requests accepted already (a job taken over from another frontend):
        they were admitted once, where they were accepted, and are not refused again."""
        if n:
            self._pending[tenant] = self._pending.get(tenant, 0) + n

    def release(self, tenant: str, n: int) -> None:
        left = self._pending.get(tenant, 0) - n
        if left < 0:
            raise RuntimeError(f"pending count for {tenant!r} went negative ({left})")
        if left:
            self._pending[tenant] = left
        else:
            self._pending.pop(tenant, None)

    @contextlib.contextmanager
    def admitted(self, tenant: str, n: int = 1) -> Iterator[None]:
        """``n`` requests counted for as long as the block runs."""
        self.admit(tenant, n)
        try:
            yield
        finally:
            self.release(tenant, n)

    def pending(self) -> dict[str, int]:
        """Requests accepted and not finished, per tenant (the queue depth)."""
        return dict(self._pending)

    def reset(self, counts: Mapping[str, int]) -> None:
        """Start again from ``counts`` (the job store's unfinished requests, after a restart)."""
        self._pending = dict(counts)
