"""The frontend: one ``grpc.aio`` server serving orchard.v1 over a Backend, and beside it, on
the same event loop, the OpenAI-compatible HTTP API (``cluster.api.http_app``).

    serve(config, backend) ─► Frontend(server, port)       (backend already started)
        Jobs, Generate      tenant API keys       cluster.api.servicer
        Admin               admin keys            cluster.api.servicer_admin
        grpc.health.v1      no key                standard health checking
        reflection          no key                standard server reflection
        HTTP /v1/...        tenant API keys       cluster.api.http_app (own port)
        HTTP /metrics       admin keys            cluster.api.http_metrics (Prometheus)
        /metrics            no key, loopback      [metrics] dedicated: a port of its own

Both bind ``[frontend] host``: loopback as it is, any other address with TLS only
(``cluster.tls``).

``serve`` opens the job store in the run directory, binds, takes its job lease
(``cluster.jobs.lease``: the unfinished jobs nobody runs, its own after a restart, a dead
frontend's) and writes ``frontends/ID.json`` (address, pid, tls, http_address,
metrics_address) there, and ``frontend.json`` too unless another live frontend wrote it, so
that clients on this machine find it. Several frontends serve one run directory: each its own
ports and router, all one job store; each job runs in the one whose lease holds it.
``orchard up`` calls it with a RayBackend; tests and ``python -m cluster.api.frontend`` with a
``LocalBackend``. ``Frontend.stop`` stops serving, then the job runner, then releases the
lease (its unfinished jobs go to the next frontend that ticks); the backend belongs to the
caller.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.backend.protocol import Backend, ModelInfo, NoWorkerAvailable
from cluster.api.chat import ChatTokenizer
from cluster.config import (ADDRESS_NAME, CONFIG_NAME, Config, load_config,
                            write_default_config)
from cluster.api.edge import Authenticator, DecodeGuard, status_of
from cluster.api.intake import JobIntakeService, prepare
from cluster.api.keys import KeyStore
from cluster.jobs.lease import FrontendLease
from cluster.jobs.store import JobStore
from cluster.jobs.takeover import LeaseKeeper
from cluster.rundir import make_private
from cluster.telemetry.job_tracing import frontend_tracing
from cluster.jobs.quotas import QuotaFile, Quotas
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.api.servicer import GenerateServicer, JobsServicer
from cluster.api.batch_store import BatchStore
from cluster.api.http_app import HttpApi, HttpServer, start_http
from cluster.api.http_batches import Batches
from cluster.api.http_message_batches import MessageBatches
from cluster.api.http_guard import HttpLimits
from cluster.api.http_metrics import MetricsEndpoint, dedicated_app
from cluster.api.servicer_admin import AdminServicer
from cluster.api.tool_calls import ToolFormat
from cluster.tls import TlsFiles, check_binding, server_credentials
from cluster.api.work import Work
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from router.kv.key import Namespace

log = logging.getLogger(__name__)

SERVICES = tuple(f"orchard.v1.{name}" for name in pb.DESCRIPTOR.services_by_name)


@dataclass(slots=True)
class Frontend:
    server: grpc.aio.Server
    port: int
    store: JobStore
    runner: JobRunner
    health: health.HealthServicer
    address_paths: tuple[Path, ...]   # frontends/ID.json, and frontend.json when it is ours
    keeper: LeaseKeeper
    host: str = "127.0.0.1"
    http: HttpServer | None = None
    batches: BatchStore | None = None
    metrics: HttpServer | None = None   # the dedicated /metrics port ([metrics] dedicated)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, then stop the runner (unfinished requests resume on the next start)."""
        self.health.enter_graceful_shutdown()
        for http in (self.http, self.metrics):
            if http is not None:
                await http.stop(grace_s)
        await self.server.stop(grace_s)
        await self.keeper.stop()
        await self.runner.close()
        self.keeper.release()   # after the runner: none of its jobs runs here any more
        self.store.close()
        if self.batches is not None:
            self.batches.close()
        for path in self.address_paths:
            if path.exists() and _owner_pid(path) == os.getpid():
                path.unlink()

    @property
    def frontend_id(self) -> str:
        return self.keeper.lease.frontend_id


def write_addresses(run_dir: Path, frontend_id: str, record: dict) -> tuple[Path, ...]:
    """``frontends/ID.json`` for this frontend, and ``frontend.json`` (what clients read by
    default) unless a live frontend other than this process wrote it."""
    own = run_dir / "frontends" / f"{frontend_id}.json"
    own.parent.mkdir(mode=0o700, exist_ok=True)
    for other in own.parent.glob("*.json"):   # the files of frontends that were killed
        pid = _owner_pid(other)
        if pid is None or not _alive(pid):
            other.unlink(missing_ok=True)
    _write_json(own, record)
    return (own, *claim_shared_address(run_dir, record))


def claim_shared_address(run_dir: Path, record: dict) -> tuple[Path, ...]:
    """Write ``frontend.json`` when no other live process holds it (none yet, or its frontend
    died): clients that read it reach a frontend that serves. At start and at every lease
    tick."""
    shared = run_dir / ADDRESS_NAME
    holder = _owner_pid(shared)
    if holder == os.getpid():
        return (shared,)
    if holder is not None and _alive(holder):
        return ()
    _write_json(shared, record)
    return (shared,)


def _write_json(path: Path, record: dict) -> None:
    """Whole or not at all: a client reading the file never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text()).get("pid", 0))
    except (OSError, ValueError):
        return None


def namespace_for(model: ModelInfo) -> Callable[[str], Namespace]:
    return model.namespace


async def serve(config: Config, backend: Backend, tokenizer: ChatTokenizer | None = None,
                clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> Frontend:
    """Start the frontend over a started ``backend``; returns once it accepts calls."""
    make_private(config.run_dir)  # 0700, files 0600, or a refusal saying how to fix it
    model = backend.model_info()
    tokenizer = tokenizer or await asyncio.to_thread(ChatTokenizer, model.model_dir)
    limits = config.limits
    namespace = namespace_for(model)
    frontend_id = f"fe-{os.getpid()}-{secrets.token_hex(3)}"
    store = JobStore(config.db_path, clock_ms, owner=frontend_id)
    tracing = frontend_tracing(config, model, len(await backend.workers()), tokenizer.decode,
                               tokenizer.render, _status_name)
    runner = JobRunner(store, backend,
                       functools.partial(prepare, model=model, render=tokenizer.render,
                                         max_prompt_bytes=limits.max_prompt_bytes),
                       RunnerLimits(limits.max_concurrent, limits.max_pending_per_tenant,
                                    limits.max_pending_total, limits.request_timeout_s,
                                    limits.max_ttft_s),
                       namespace=namespace, block_size=model.block_size, tracing=tracing,
                       quotas=Quotas(QuotaFile(config.run_dir / CONFIG_NAME).current,
                                     time.monotonic))
    tenants = config.tenants()
    tracing.watch(backend, lambda: {t: runner.pending().get(t, 0) for t in tenants})  # gauges
    tracing.watch_slots(runner.slot_gauges)
    auth = Authenticator(config.tenant_keys, config.admin_keys, KeyStore(config.run_dir, clock_ms))
    server = grpc.aio.server(interceptors=[DecodeGuard()],
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.so_reuseport", 0)])
    intake = JobIntakeService(store, runner, model, limits.max_requests_per_job,
                              limits.max_prompt_bytes)
    tool_format = await asyncio.to_thread(ToolFormat.of, model.model_dir, model.model_id)
    work = Work(runner.direct, model, tokenizer, intake, limits.max_prompt_bytes, tool_format)
    pb_grpc.add_JobsServicer_to_server(JobsServicer(auth, store, runner, work), server)
    pb_grpc.add_GenerateServicer_to_server(GenerateServicer(auth, work), server)
    pb_grpc.add_AdminServicer_to_server(
        AdminServicer(auth, backend, model, tokenizer, config.tenants(), namespace,
                      tracing.invalidated),
        server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    tls = config.tls_files()
    port = _bind(server, config, tls)
    await server.start()
    http, batches, metrics_http = None, None, None
    scrape = MetricsEndpoint(tracing.metrics, runner, store, backend, tenants)
    try:
        if config.http.enabled:
            http, batches = await _serve_http(config, auth, work, store, runner,
                                              tokenizer.encode, clock_ms,
                                              scrape if config.metrics.http else None)
        if config.metrics.dedicated:
            metrics_http = await start_http(dedicated_app(scrape, _http_limits(config)),
                                            config.metrics.host, config.metrics.port, None,
                                            _http_limits(config), "[metrics] port")
    except BaseException:
        if http is not None:
            await http.stop(0)
            batches.close()
        await server.stop(0)
        raise
    address = (f"[{config.host}]:{port}" if ":" in config.host else f"{config.host}:{port}")
    record = {"address": address, "pid": os.getpid(), "tls": tls is not None,
              "http_address": http.address if http is not None else "",
              "metrics_address": metrics_http.address if metrics_http is not None else "",
              "frontend_id": frontend_id}

    def on_tick() -> None:   # frontend.json again if the frontend that held it died
        if paths := claim_shared_address(config.run_dir, record):
            frontend.address_paths = tuple(dict.fromkeys((*frontend.address_paths, *paths)))
    lease = FrontendLease(config.db_path, frontend_id, clock_ms, round(config.lease_s * 1000),
                          address)
    frontend = Frontend(server, port, store, runner, health_servicer, (),
                        LeaseKeeper(lease, runner, on_tick), config.host, http, batches,
                        metrics_http)
    first = await frontend.keeper.start()
    if first.taken:
        log.info("resumed %d unfinished job(s): %s", len(first.taken),
                 ", ".join(job.job_id for job in first.taken))
    for name in ("", *SERVICES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    frontend.address_paths = write_addresses(config.run_dir, frontend_id, record)
    return frontend


def _status_name(exc: BaseException) -> str:
    """The gRPC status name a request ends with when ``exc`` stops it (for the metrics)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    return (status_of(exc) or grpc.StatusCode.INTERNAL).name


def _http_limits(config: Config) -> HttpLimits:
    settings = config.http
    return HttpLimits(settings.max_body_bytes, settings.header_timeout_s,
                      settings.body_timeout_s, settings.max_connections_per_client)


async def _serve_http(config: Config, auth: Authenticator, work: Work, store: JobStore,
                      runner: JobRunner, encode: Callable[[str], list[int]],
                      clock_ms: Callable[[], int], metrics: MetricsEndpoint | None
                      ) -> tuple[HttpServer, BatchStore]:
    """The OpenAI-compatible HTTP API on its own port, held to ``[http]``'s limits."""
    batches = BatchStore(config.run_dir, lambda: clock_ms() // 1000)
    api = HttpApi(auth, work, encode, Batches(auth, work, store, runner, batches, encode),
                  lambda: clock_ms() / 1000, metrics, MessageBatches(auth, work, store, runner))
    limits = _http_limits(config)
    try:
        http = await start_http(api.app(limits), config.host, config.http.port,
                                config.tls_files(), limits)
    except BaseException:
        batches.close()
        raise
    return http, batches


def _bind(server: grpc.aio.Server, config: Config, tls: TlsFiles | None) -> int:
    """Add the gRPC port (TLS when configured, the LAN rule checked); the port bound."""
    warning = check_binding(config.host, tls, config.tls.allow_plaintext_lan)
    if warning:
        log.warning(warning)
    host = f"[{config.host}]" if ":" in config.host else config.host
    if tls is None:
        port = server.add_insecure_port(f"{host}:{config.port}")
    else:
        port = server.add_secure_port(f"{host}:{config.port}", server_credentials(tls))
    if port == 0:
        raise ValueError(f"cannot bind {config.host}:{config.port}: the port is in use; set "
                         "[frontend] port = 0 to pick a free one")
    return port


async def _main(run_dir: Path, workers: int | None, port: int | None, http_port: int | None,
                attach: bool = False) -> None:
    import workers as _blas  # noqa: F401  (OpenBLAS before mlx)

    config = load_config(run_dir)
    if port is not None:
        config = dataclasses.replace(config, port=port)
    if http_port is not None:
        config = dataclasses.replace(config, http=dataclasses.replace(config.http,
                                                                      port=http_port))
    if attach:   # orchard up's Ray workers (cluster.backend.ray_attach)
        from cluster.backend.ray_backend import RayBackend

        backend = RayBackend.attach(config, run_dir)
    else:
        from cluster.backend.local import LocalBackend

        backend = LocalBackend.from_config(config, workers=workers or 1)
    await backend.start()
    frontend = await serve(config, backend)
    print(f"orchard frontend {frontend.frontend_id} listening on {frontend.address}"
          + (f", HTTP API on {frontend.http.address}" if frontend.http else ""), flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    await stopped.wait()
    await frontend.stop()
    await backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.api.frontend",
        description="Run the gRPC frontend over in-process workers (LocalBackend, no Ray), "
                    "or over the Ray workers `orchard up` serves the run directory with "
                    "(--attach).")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=None,
                        help="in-process workers to start (default 1)")
    parser.add_argument("--attach", action="store_true",
                        help="serve with the Ray workers of the run directory's `orchard up` "
                             "(they stay its own: this frontend never scales or stops them)")
    parser.add_argument("--port", type=_port, default=None,
                        help="the gRPC port, in place of [frontend] port (0: a free one); "
                             "each frontend of a run directory needs its own")
    parser.add_argument("--http-port", type=_port, default=None,
                        help="the HTTP API's port, in place of [http] port (0: a free one)")
    parser.add_argument("--init", action="store_true",
                        help="write a default orchard.toml (fresh keys) if the run dir has none")
    args = parser.parse_args(argv)
    if args.attach and args.workers is not None:
        parser.error("--attach serves with orchard up's workers: --workers starts in-process "
                     "ones; give one of the two")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        if args.init:
            write_default_config(args.run_dir)
        asyncio.run(_main(args.run_dir, args.workers, args.port, args.http_port,
                          args.attach))
    except (ValueError, FileNotFoundError, NoWorkerAvailable) as exc:
        print(f"orchard frontend: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


if __name__ == "__main__":
    raise SystemExit(main())
