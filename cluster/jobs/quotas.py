"""Per-tenant quotas on interactive requests, read from ``orchard.toml`` and reloaded live.

    [quotas.acme]
    requests_in_flight = 8        # acme's requests outside jobs accepted and not finished
    tokens_per_minute = 200000    # prompt + max_tokens of those accepted in the last 60 s

A tenant without a table, or a quota of 0, has no limit. Quotas apply to requests outside
jobs (``Generate``, the HTTP completions): a batch job is never refused for them, only slowed
by the slots' priority. A refusal is ``QuotaExceeded`` (``RESOURCE_EXHAUSTED``, HTTP 429) with
a ``Retry-After``: for tokens, the seconds until enough of the minute's tokens have aged out for
the request to fit; for requests in flight, one request's time in its slot (the shedder's
average, ``cluster.jobs.shedding``), at least 1 s.

The quotas are not part of the frozen ``Config``: ``QuotaFile`` reads ``[quotas]`` when the
frontend starts (a bad table stops it, naming the key) and again whenever the file's
modification time or size changes (one ``stat`` per request, as ``cluster.api.keys`` does for
managed keys), so an operator edits the file and the next request sees the new quotas. An
edit that does not parse is logged and the quotas before it stay; while the file is missing,
the quotas last read stay (none, if it never existed).
"""
from __future__ import annotations

import contextlib
import logging
import math
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from cluster.jobs.admission import RetryLater

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # tokens_per_minute counts the requests accepted in the last minute


class QuotaExceeded(RetryLater):
    """A tenant past one of its quotas; ``reason`` names the quota."""

    def __init__(self, message: str, reason: str, retry_after_s: int):
        super().__init__(message, retry_after_s)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TenantQuota:
    requests_in_flight: int = 0  # 0: no limit
    tokens_per_minute: int = 0   # 0: no limit


def parse_quotas(data: Mapping, path: Path) -> dict[str, TenantQuota]:
    """``[quotas.<tenant>]`` tables of a parsed ``orchard.toml``; ``ValueError`` naming the key."""
    section = data.get("quotas", {})
    if not isinstance(section, dict):
        raise ValueError(f"{path}: [quotas] must be a table of [quotas.<tenant>] tables")
    quotas = {}
    known = set(TenantQuota.__dataclass_fields__)
    for tenant, table in section.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [quotas.{tenant}] must be a table")
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} in "
                             f"[quotas.{tenant}]; known: {', '.join(sorted(known))}")
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{path}: [quotas.{tenant}] {key} must be an integer >= 0 "
                                 f"(0: no limit), got {value!r}")
        quotas[tenant] = TenantQuota(**table)
    return quotas


class QuotaFile:
    """The ``[quotas]`` of one ``orchard.toml``, read again when the file changes."""

    def __init__(self, path: Path):
        self._path = Path(path)
        self._seen: tuple[int, int] | None = None
        self._quotas: dict[str, TenantQuota] = {}
        self._read(strict=True)

    def current(self) -> Mapping[str, TenantQuota]:
        self._read(strict=False)
        return self._quotas

    def _read(self, strict: bool) -> None:
        try:
            st = self._path.stat()
        except FileNotFoundError:  # none yet (a config built in code), or being replaced
            return
        if self._seen == (st.st_mtime_ns, st.st_size):
            return
        try:
            quotas = parse_quotas(tomllib.loads(self._path.read_text()), self._path)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            if strict:
                raise ValueError(str(exc)) from None
            log.error("%s: quotas not reloaded, the ones before stay: %s", self._path, exc)
            quotas = self._quotas
        self._seen = (st.st_mtime_ns, st.st_size)
        self._quotas = quotas


class Quotas:
    """Enforces the current quotas: requests in flight per tenant, and a one-minute window of
    tokens per tenant on the injected ``clock`` (seconds)."""

    def __init__(self, current: Callable[[], Mapping[str, TenantQuota]],
                 clock: Callable[[], float]):
        self._current = current
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._window: dict[str, deque[tuple[float, int]]] = {}

    def quota(self, tenant: str) -> TenantQuota:
        return self._current().get(tenant, TenantQuota())

    @contextlib.contextmanager
    def in_flight(self, tenant: str, retry_after_s: int) -> Iterator[None]:
        """One more request of ``tenant`` in flight while the block runs, or
        ``QuotaExceeded`` (nothing counted)."""
        limit = self.quota(tenant).requests_in_flight
        mine = self._in_flight.get(tenant, 0)
        if limit and mine >= limit:
            raise QuotaExceeded(f"quota: tenant {tenant!r} has {mine} requests in flight and "
                                f"its requests_in_flight quota is {limit}; retry after "
                                f"{retry_after_s} s", "requests_in_flight", retry_after_s)
        self._in_flight[tenant] = mine + 1
        try:
            yield
        finally:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` (prompt + max_tokens) against ``tenant``'s minute, or raise
        ``QuotaExceeded`` (nothing counted) with the seconds until they would fit."""
        limit = self.quota(tenant).tokens_per_minute
        if not limit:
            return
        now = self._clock()
        window = self._window.setdefault(tenant, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        used = sum(n for _, n in window)
        if used + tokens > limit:
            retry = self._fits_after(window, used + tokens - limit, now, tokens > limit)
            raise QuotaExceeded(f"quota: tenant {tenant!r} used {used} of its "
                                f"tokens_per_minute quota of {limit} in the last minute and "
                                f"this request needs {tokens} (prompt + max_tokens); retry "
                                f"after {retry} s", "tokens_per_minute", retry)
        window.append((now, tokens))

    @staticmethod
    def _fits_after(window: deque[tuple[float, int]], excess: int, now: float,
                    never: bool) -> int:
        """Seconds until the oldest entries summing to ``excess`` have left the window (a
        request larger than the whole quota: the full window)."""
        if never:
            return math.ceil(WINDOW_S)
        freed = 0
        for at, n in window:
            freed += n
            if freed >= excess:
                return max(1, math.ceil(at + WINDOW_S - now))
        return math.ceil(WINDOW_S)
