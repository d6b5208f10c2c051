"""``RayBackend``: the one ``Backend`` over worker actors spread across Ray nodes.

    frontend ─► Backend.generate(request, block_hashes)   (``cluster.backend.backend``)
                 ├─ routes.router.route + started  (in this process: no Ray hop)
                 ├─ worker w's stream (``cluster.backend.link``, not a Ray call): generate
                 │      ─► Prefilled or TokenChunks ─► router.prefilled
                 │      ─► WorkerDone(result, block events) ─► apply
                 └─ router.finished ─► GenerateOutcome(result, decision, ...)

No Ray call per request: Ray places, starts, watches and drains the workers (the control
plane, ``cluster.backend.ray_pool``), while each request goes over a persistent stream the
frontend holds to its worker (a Ray call alone costs more than the path's 5 ms budget on a
small machine). The worker's block events reach this frontend's router on its results and,
between requests (evictions, TTL expiry), on a Ray feed each worker streams
(``EngineWorker.events``). Each frontend routes with its own router: none is shared.

A worker that dies under a request (its stream closes, Ray declares its actor or node dead, or
its engine broke) is removed from the router at once and replaced in the background
(``cluster.backend.pool``), and the request is routed again (``cluster.backend.retry``).

Given ``TelemetrySettings`` (``from_config`` narrows them from the cluster config) every
worker actor sets up telemetry in its own process and draws its own spans under the context
``GenerateRequest.trace_context`` carries (``cluster.backend.worker_actor``); the outcome says
so, and the frontend does not draw them again. The routing span is the frontend's.

``policy="round_robin"`` skips the router and cycles through ready workers: the baseline of
``orchard bench cluster``. Ray is started (embedded, loopback only) or joined by ``start``
through ``cluster.backend.bootstrap``; ``close`` stops what it started.
"""
from __future__ import annotations

from pathlib import Path

from cluster.backend.backend import POLICIES, Backend
from cluster.backend.bootstrap import Placement
from cluster.backend.ray_pool import RayLauncher
from cluster.backend.engine_config import engine_config
from cluster.telemetry.setup import TelemetrySettings, settings_from_config
from router.index import DEFAULT_INDEX_BYTES
from workers.engine.config import EngineConfig

__all__ = ["POLICIES", "RayBackend"]


class RayBackend(Backend):
    """``Backend`` over worker actors, Ray started or joined on ``start``."""

    def __init__(self, model_dir: Path | str, workers: int = 1,
                 engine: EngineConfig | None = None, placement: Placement = Placement(),
                 address: str | None = None, policy: str = "orchard",
                 start_timeout_s: float = 300.0,
                 telemetry: TelemetrySettings | None = None,
                 index_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        launcher = RayLauncher(str(model_dir), engine or EngineConfig(), placement, address,
                               start_timeout_s, telemetry=telemetry, initial=workers)
        super().__init__(launcher, workers, policy, index_bytes=index_bytes)

    @classmethod
    def from_config(cls, config, workers: int = 1, address: str | None = None,
                    placement: Placement = Placement(), policy: str = "orchard") -> RayBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.model.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        return cls(model_dir, workers, engine_config(config), placement, address, policy,
                   telemetry=settings_from_config(config, "orchard"),
                   index_bytes=config.router.index_bytes)
