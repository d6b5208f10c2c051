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
        memory=TierUsage(info.cache_bytes, info.cache_blocks, info.cache_capacity_bytes),
        disk=None if disk is None else TierUsage(disk.bytes, disk.blocks, disk.capacity_bytes),
        evictions=info.evictions, expirations=info.expirations)


class MetricsEndpoint:
    """The scrape handler over the frontend's owners; ``auth`` None: no key asked."""

    def __init__(self, metrics: ServingMetrics, runner: JobRunner, store: JobStore,
                 backend: Backend, tenants: Sequence[str],
                 auth: Authenticator | None) -> None:
        self._metrics = metrics
        self._runner = runner
        self._store = store
        self._backend = backend
        self._tenants = tuple(tenants)
        self._auth = auth

    def with_auth(self, auth: Authenticator | None) -> MetricsEndpoint:
        return MetricsEndpoint(self._metrics, self._runner, self._store, self._backend,
                               self._tenants, auth)

    def route(self) -> Route:
        return Route(PATH, openai_errors(self.scrape), methods=["GET"])

    async def state(self) -> ScrapeState:
        workers = await self._backend.workers()
        return ScrapeState(
            queue_depth=self._runner.pending(), running=self._runner.slots_in_use(),
            jobs={state.value: n for state, n in self._store.jobs_by_state().items()},
            workers=[snapshot_of(w) for w in workers if w.state != "dead"],
            tenants=self._tenants)

    async def scrape(self, request: Request) -> Response:
        if self._auth is not None:
            header = request.headers.get("authorization")
            if not header:
                raise Unauthenticated("authorization: missing; /metrics on the HTTP port "
                                      "needs 'Authorization: Bearer <admin key>'")
            self._auth.admin_of(bearer_token(header))
        body, content_type = self._metrics.render(await self.state(),
                                                  request.headers.get("accept"))
        return Response(body, media_type=content_type)


def dedicated_app(endpoint: MetricsEndpoint, limits: HttpLimits) -> RequestGuard:
    """The dedicated port's app: ``GET /metrics`` alone, without a key."""
    app = Starlette(routes=[endpoint.with_auth(None).route()],
                    exception_handlers=EXCEPTION_HANDLERS)
    return RequestGuard(app, BodyCap(limits.max_body_bytes, "[http] max_body_bytes",
                                     "a scrape has no body"), limits.body_timeout_s, {})
