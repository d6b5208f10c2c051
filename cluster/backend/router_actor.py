"""The router actor the cluster runs: ``router.actor.AsyncRouter`` plus its process's telemetry.

``router`` never imports OpenTelemetry, so tracing the routing decision lives here, in the
control plane, as a thin subclass. The actor sets up telemetry in its own process (service
``orchard-router``, its node as resource attributes) and draws one ``orchard.route`` span per
decision, as a child of the context the call carries (``GenerateRequest.trace_context``)::

    RayBackend ─► route_and_start(rid, namespace, hashes, n, trace_context)
                    ├─ Router.route + started       (the decision, as before)
                    └─ orchard.route span            (candidates as events, choice, reason)

The span covers the decision only (not the Ray hops around it); a request rerouted after its
worker left shows one span per decision. ``tracing`` says whether spans are drawn here, so the
frontend knows not to draw the routing span again. A tracing failure is logged once and never
fails a routing call.
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import ray

from cluster.telemetry import spans
from cluster.telemetry.setup import (SERVICE_ROUTER, TelemetrySettings, process_settings,
                               process_telemetry)
from router.actor import AsyncRouter
from router.key import BlockHash, Namespace
from router.policy import PolicyConfig, RoutingDecision


class TracedRouter(AsyncRouter):
    """``AsyncRouter`` whose routing decisions are traced in the router's own process."""

    def __init__(self, block_size: int, telemetry: TelemetrySettings | None = None,
                 config: PolicyConfig = PolicyConfig(), seed: int = 0) -> None:
        super().__init__(block_size, config, seed)
        self._tel = process_telemetry(process_settings(
            telemetry, SERVICE_ROUTER, (), *_node()))

    async def tracing(self) -> bool:
        """Whether this actor draws the routing spans."""
        return self._tel.enabled

    async def route_and_start(self, request_id: str, namespace: Namespace,
                              block_hashes: Sequence[BlockHash], prompt_tokens: int,
                              trace_context: Sequence[tuple[str, str]] = ()
                              ) -> RoutingDecision:
        """``AsyncRouter.route_and_start``, traced under ``trace_context``."""
        start_ns = time.time_ns()
        decision = await super().route_and_start(request_id, namespace, block_hashes,
                                                 prompt_tokens)
        if self._tel.enabled and trace_context:  # an untraced request: no orphan trace
            spans.record_routing(self._tel, decision, start_ns, time.time_ns(),
                                 tuple(trace_context))
        return decision

    async def flush(self) -> None:
        """Export the spans drawn so far (before the actor is stopped)."""
        await asyncio.to_thread(self._tel.flush)


def _node() -> tuple[str, str]:
    if not ray.is_initialized():
        return "local", "local"
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


TracedRouterActor = ray.remote(num_cpus=0)(TracedRouter)
