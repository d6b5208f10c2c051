"""``GET /metrics``: the frontend's Prometheus scrape endpoint, in two places.

    GET /metrics on the HTTP API's port    an admin key (``Authorization: Bearer``), as the
                                           Admin calls: the figures name every tenant
    GET /metrics on [metrics] port         no key, bound to loopback only (``cluster.config``
                                           refuses any other host); ``[metrics] dedicated``

Each scrape gathers a ``cluster.telemetry.prometheus.ScrapeState`` on the frontend's loop
(the runner's counts, the job store's jobs by state, ``backend.workers()``) and renders it
with the counters requests pushed (``ServingMetrics.render``), in the format the scraper's
``Accept`` asks for (Prometheus text, or OpenMetrics).
"""
from __future__ import annotations

from typing import Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cluster.api.edge import Authenticator, Unauthenticated, bearer_token
from cluster.api.http_errors import EXCEPTION_HANDLERS, openai_errors
from cluster.api.http_guard import BodyCap, HttpLimits, RequestGuard
from cluster.backend.protocol import Backend, WorkerInfo
from cluster.jobs.runner import JobRunner
from cluster.jobs.store import JobStore
from cluster.telemetry.prometheus import ScrapeState, ServingMetrics, TierUsage, WorkerSnapshot

PATH = "/metrics"


def snapshot_of(info: WorkerInfo) -> WorkerSnapshot:
    disk = info.disk
    return WorkerSnapshot(
        worker=info.worker_id, running=info.running,
        memory=TierUsage(info.cache_bytes, info.cache_blocks, info.cache_capacity_bytes,
                         info.evictions),
        disk=None if disk is None else TierUsage(disk.bytes, disk.blocks, disk.capacity_bytes,
                                                 disk.evictions),
        expirations=info.expirations)


class MetricsEndpoint:
    """The scrape over the frontend's owners; ``route(auth)`` serves it with or without a key."""

    def __init__(self, metrics: ServingMetrics, runner: JobRunner, store: JobStore,
                 backend: Backend, tenants: Sequence[str]) -> None:
        self._metrics = metrics
        self._runner = runner
        self._store = store
        self._backend = backend
        self._tenants = tuple(tenants)

    def route(self, auth: Authenticator | None) -> Route:
        """``GET /metrics``, asking for an admin key when ``auth`` is given."""
        async def scrape(request: Request) -> Response:
            if auth is not None:
                header = request.headers.get("authorization")
                if not header:
                    raise Unauthenticated("authorization: missing; /metrics on the HTTP port "
                                          "needs 'Authorization: Bearer <admin key>'")
                auth.admin_of(bearer_token(header))
            body, content_type = self._metrics.render(await self.state(),
                                                      request.headers.get("accept"))
            return Response(body, media_type=content_type)
        return Route(PATH, openai_errors(scrape), methods=["GET"])

    async def state(self) -> ScrapeState:
        workers = await self._backend.workers()
        return ScrapeState(
            queue_depth=self._runner.pending(), running=self._runner.slots_in_use(),
            jobs={state.value: n for state, n in self._store.jobs_by_state().items()},
            workers=[snapshot_of(w) for w in workers if w.state != "dead"],
            tenants=self._tenants)


def dedicated_app(endpoint: MetricsEndpoint, limits: HttpLimits) -> RequestGuard:
    """The dedicated port's app: ``GET /metrics`` alone, without a key."""
    app = Starlette(routes=[endpoint.route(None)], exception_handlers=EXCEPTION_HANDLERS)
    return RequestGuard(app, BodyCap(limits.max_body_bytes, "[http] max_body_bytes",
                                     "a scrape has no body"), limits.body_timeout_s, {})
