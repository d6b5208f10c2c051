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

``orchard up`` writes where its workers are (``directory``: ``RUN/workers.json``);
``RayBackend.attach`` is a backend over those same actors for another frontend on that run
directory, which never starts, scales or stops them (``cluster.backend.ray_attach``).

``policy="round_robin"`` skips the router and cycles through ready workers: the baseline of
``orchard bench cluster``. Ray is started (embedded, loopback only) or joined by ``start``
through ``cluster.backend.bootstrap``; ``close`` stops what it started.
"""
from __future__ import annotations

import os
from pathlib import Path

import ray

from cluster.backend.backend import POLICIES, Backend
from cluster.backend.bootstrap import Placement, auth_mode
from cluster.backend.ray_attach import RayAttacher, WorkerDirectory
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
        self._ray_launcher = launcher
        super().__init__(launcher, workers, policy, index_bytes=index_bytes)

    def directory(self, frontend_address: str) -> WorkerDirectory:
        """Where this backend's workers are, for frontends that attach to them (once
        started)."""
        launcher = self._ray_launcher
        return WorkerDirectory(ray.get_runtime_context().gcs_address, launcher.names,
                               launcher.secret().hex(), os.getpid(), frontend_address,
                               auth_mode(), launcher.detached,
                               launcher.placement.cpus_per_worker,
                               launcher.placement.workers_per_node)

    @staticmethod
    def attach(config, run_dir: Path | str) -> Backend:
        """A backend over the workers ``orchard up`` serves from ``run_dir`` with (found by
        name; never started, scaled or stopped by it)."""
        from workers.model.default_model import ensure_default_model

        directory = WorkerDirectory.read(Path(run_dir))
        model_dir = config.model_dir or str(ensure_default_model())
        return Backend(RayAttacher(directory, model_dir, engine_config(config), Path(run_dir),
                                   settings_from_config(config, "orchard")),
                       index_bytes=config.router.index_bytes)

    @classmethod
    def from_config(cls, config, workers: int = 1, address: str | None = None,
                    placement: Placement = Placement(), policy: str = "orchard") -> RayBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.model.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        return cls(model_dir, workers, engine_config(config), placement, address, policy,
                   telemetry=settings_from_config(config, "orchard"),
                   index_bytes=config.router.index_bytes)
