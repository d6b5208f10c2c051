"""The frontend: one ``grpc.aio`` server serving orchard.v1 over a Backend, and beside it, on
the same event loop, the OpenAI-compatible HTTP API (``cluster.api.http_app``).

    serve(config, backend) ─► Frontend(server, port)       (backend already started)
        Jobs, Generate      tenant API keys       cluster.api.servicer
        Admin               admin keys            cluster.api.servicer_admin
        grpc.health.v1      no key                standard health checking
        reflection          no key                standard server reflection
        HTTP /v1/...        tenant API keys       cluster.api.http_app (own port)

Both bind ``[frontend] host``: loopback as it is, any other address with TLS only
(``cluster.tls``).

``serve`` opens the job store in the run directory, resumes its unfinished jobs, binds, and
writes ``frontend.json`` (address, pid, tls, http_address) there so that clients on this machine find it.
``orchard up`` calls it with a RayBackend; tests and ``python -m cluster.api.frontend`` with a
``LocalBackend``. ``Frontend.stop`` stops serving, then the job runner; the backend belongs to
the caller.
"""
from __future__ import annotations

import argparse
import asyncio
import fcntl
import functools
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.backend.protocol import Backend, ModelInfo
from cluster.api.chat import ChatTokenizer
from cluster.config import ADDRESS_NAME, Config, load_config, write_default_config
from cluster.api.edge import Authenticator, DecodeGuard
from cluster.api.intake import JobIntakeService, prepare
from cluster.api.keys import KeyStore
from cluster.jobs.store import JobStore
from cluster.rundir import make_private
from cluster.telemetry.job_tracing import frontend_tracing
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.api.servicer import GenerateServicer, JobsServicer
from cluster.api.batch_store import BatchStore
from cluster.api.http_app import HttpApi, HttpServer, start_http
from cluster.api.http_batches import Batches
from cluster.api.http_message_batches import MessageBatches
from cluster.api.http_guard import HttpLimits
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
    address_path: Path
    lock_fd: int             # holds the run directory's frontend.lock while serving
    host: str = "127.0.0.1"
    http: HttpServer | None = None
    batches: BatchStore | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, then stop the runner (unfinished requests resume on the next start)."""
        self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop(grace_s)
        await self.server.stop(grace_s)
        await self.runner.close()
        self.store.close()
        if self.batches is not None:
            self.batches.close()
        if self.address_path.exists() and _owner_pid(self.address_path) == os.getpid():
            self.address_path.unlink()
        os.close(self.lock_fd)  # releases the lock (a killed process releases it too)


def lock_run_dir(run_dir: Path) -> int:
    """Take ``run_dir/frontend.lock``: one frontend per job store, or jobs would run twice."""
    fd = os.open(run_dir / "frontend.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        owner = _owner_pid(run_dir / ADDRESS_NAME)
        raise ValueError(f"another frontend (pid {owner or 'unknown'}) is serving {run_dir}; "
                         "stop it first, or use another --run-dir") from None
    return fd


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
    lock_fd = lock_run_dir(config.run_dir)
    try:
        return await _serve_locked(config, backend, tokenizer, clock_ms, lock_fd)
    except BaseException:
        os.close(lock_fd)
        raise


async def _serve_locked(config: Config, backend: Backend, tokenizer: ChatTokenizer | None,
                        clock_ms: Callable[[], int], lock_fd: int) -> Frontend:
    model = backend.model_info()
    tokenizer = tokenizer or await asyncio.to_thread(ChatTokenizer, model.model_dir)
    limits = config.limits
    namespace = namespace_for(model)
    store = JobStore(config.db_path, clock_ms)
    tracing = frontend_tracing(config, model, len(await backend.workers()), tokenizer.decode,
                               tokenizer.render)
    runner = JobRunner(store, backend,
                       functools.partial(prepare, model=model, render=tokenizer.render,
                                         max_prompt_bytes=limits.max_prompt_bytes),
                       RunnerLimits(limits.max_concurrent, limits.max_pending_per_tenant,
                                    limits.max_pending_total, limits.request_timeout_s),
                       namespace=namespace, block_size=model.block_size, tracing=tracing)
    tenants = config.tenants()
    tracing.watch(backend, lambda: {t: runner.pending().get(t, 0) for t in tenants})  # gauges
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
    http, batches = None, None
    if config.http.enabled:
        try:
            http, batches = await _serve_http(config, auth, work, store, runner,
                                              tokenizer.encode, clock_ms)
        except BaseException:
            await server.stop(0)
            raise
    resumed = runner.resume()
    if resumed:
        log.info("resumed %d unfinished job(s): %s", len(resumed), ", ".join(resumed))
    for name in ("", *SERVICES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    frontend = Frontend(server, port, store, runner, health_servicer, config.address_path,
                        lock_fd, config.host, http, batches)
    config.address_path.write_text(json.dumps({
        "address": frontend.address, "pid": os.getpid(), "tls": tls is not None,
        "http_address": http.address if http is not None else ""}))
    return frontend


async def _serve_http(config: Config, auth: Authenticator, work: Work, store: JobStore,
                      runner: JobRunner, encode: Callable[[str], list[int]],
                      clock_ms: Callable[[], int]) -> tuple[HttpServer, BatchStore]:
    """The OpenAI-compatible HTTP API on its own port, held to ``[http]``'s limits."""
    batches = BatchStore(config.run_dir, lambda: clock_ms() // 1000)
    api = HttpApi(auth, work, encode, Batches(auth, work, store, runner, batches, encode),
                  lambda: clock_ms() / 1000, MessageBatches(auth, work, store, runner))
    settings = config.http
    limits = HttpLimits(settings.max_body_bytes, settings.header_timeout_s,
                        settings.body_timeout_s, settings.max_connections_per_client)
    try:
        http = await start_http(api.app(limits), config.host, settings.port,
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


async def _main(run_dir: Path, workers: int) -> None:
    import workers as _blas  # noqa: F401  (OpenBLAS before mlx)
    from cluster.backend.local import LocalBackend

    config = load_config(run_dir)
    backend = LocalBackend.from_config(config, workers=workers)
    await backend.start()
    frontend = await serve(config, backend)
    print(f"orchard frontend listening on {frontend.address}"
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
        description="Run the gRPC frontend over in-process workers (LocalBackend, no Ray).")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--init", action="store_true",
                        help="write a default orchard.toml (fresh keys) if the run dir has none")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        if args.init:
            write_default_config(args.run_dir)
        asyncio.run(_main(args.run_dir, args.workers))
    except (ValueError, FileNotFoundError) as exc:
        print(f"orchard frontend: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
