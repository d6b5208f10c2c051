"""A frontend beside ``orchard up``'s, on the same Ray worker actors: found by name, never
started, scaled, drained or stopped here.

    orchard up (RayLauncher)  ─► names each actor ``orchard-TAG-`` + its worker id and writes
                                 RUN/workers.json (private: the Ray address, the name prefix,
                                 the workers' stream secret, the owner)
    python -m cluster.api.frontend --run-dir RUN --attach
      RayAttacher.start       ─► joins that Ray cluster
      discover (at start and  ─► the named actors of that prefix: each new one that listens is
        every pool check)        attached (its stream opened with the secret under this
                                 frontend's own router id, its feed followed, the router's
                                 view built from its holdings); those gone are forgotten
      scale / drain           ─► ``NotOwned``: the owner's frontend does them
      close                   ─► this frontend's streams closed; the workers go on serving
    the owner killed          ─► (detached actors: ``orchard up --address``) the owner's lock
                                 on RUN/workers.lock is free: the first attached frontend to
                                 take it takes the workers over (it scales, drains, replaces
                                 and at last stops them) and writes workers.json as their owner

The workers know each frontend's router by its id (``EngineWorker.events(after,
router_id)``), so the two routers are fed apart and converge on the same belief. Workers the
owner starts later (a scale-up, a replacement) are attached at the next check; a worker that
died is forgotten here and replaced there. Ray ends an actor with the driver that created it,
and ``orchard up``'s embedded Ray cluster with its process: there, when the owner stops, so
do the workers, and an attached frontend then has none (``NoWorkerAvailable``) until it is
started again over a new owner. On a Ray cluster of its own (``orchard up --address``) the
owner's actors are detached and outlive it: a frontend attached to them serves on, takes them
over, and its lease keeper resumes the dead owner's jobs (``cluster.jobs.takeover``).
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import ray

from cluster.backend import bootstrap
from cluster.backend.handle import WorkerHello
from cluster.backend.link import WorkerLink
from cluster.backend.protocol import NotOwned
from cluster.backend.bootstrap import Placement
from cluster.backend.ray_pool import START_TIMEOUT_S, RayLauncher, RayWorker
from cluster.backend.routing import FrontendRouter
from cluster.telemetry.setup import TelemetrySettings
from workers.engine.config import EngineConfig

log = logging.getLogger(__name__)

DIRECTORY_NAME = "workers.json"
LOCK_NAME = "workers.lock"   # held by the workers' owner for as long as it lives


@dataclass(frozen=True, slots=True)
class WorkerDirectory:
    """Where ``orchard up``'s workers are and how to reach them (``RUN/workers.json``,
    readable by the run directory's owner only: it holds the stream secret)."""

    ray_address: str   # the Ray cluster's GCS address
    names: str         # the worker actors' name prefix (the name is this + the worker id)
    secret: str        # the workers' stream secret, hex
    owner_pid: int     # the process that started them
    owner: str         # its frontend's address
    ray_auth_mode: str = ""   # the cluster's RAY_AUTH_MODE ("token": Ray's own token, which
                              # Ray keeps in the user's ~/.ray); "" when unset
    detached: bool = False    # the actors outlive their owner (a Ray cluster it joined)
    cpus_per_worker: float = 1.0   # their placement, for workers started after a takeover
    workers_per_node: int = 1

    @classmethod
    def read(cls, run_dir: Path) -> WorkerDirectory:
        path = Path(run_dir) / DIRECTORY_NAME
        try:
            record = json.loads(path.read_text())
            directory = cls(**record)
            bytes.fromhex(directory.secret)
        except FileNotFoundError:
            raise ValueError(f"no Ray workers to attach to in {run_dir} (no {DIRECTORY_NAME}): "
                             "start them with `orchard up --detach --run-dir "
                             f"{run_dir}`") from None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a worker directory ({exc}); `orchard up` "
                             "writes it anew when it starts") from None
        return directory

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / DIRECTORY_NAME
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out)
        tmp.replace(path)
        return path

    @staticmethod
    def forget(run_dir: Path) -> None:
        (Path(run_dir) / DIRECTORY_NAME).unlink(missing_ok=True)


def owner_lock(run_dir: Path, wait: bool = True) -> int | None:
    """Hold the workers' owner lock (``RUN/workers.lock``) for as long as the returned
    descriptor is open (the process's life, however it ends). ``wait=False``: None at once
    when another process holds it (their owner lives)."""
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class RayAttacher:
    """The pool's launcher over another frontend's worker actors (``Launcher``, following),
    until it takes them over (then it starts and stops them as their ``RayLauncher``)."""

    prefix = "w"
    watch = True           # pings, rebuilt views, and ``discover`` at each check
    pulls = True           # the workers pull from each other as they do for the owner

    def __init__(self, directory: WorkerDirectory, model_dir: str, engine: EngineConfig,
                 run_dir: Path | None = None, telemetry: TelemetrySettings | None = None
                 ) -> None:
        """``run_dir``: where the owner's lock is, for a takeover of detached workers (None:
        never taken over)."""
        self.model_dir = model_dir
        self.engine = engine
        self.owner = f"orchard up (pid {directory.owner_pid}, frontend {directory.owner})"
        self.replace_dead = False   # the owner replaces them (until a takeover)
        self._directory = directory
        self._run_dir = run_dir
        self._telemetry = telemetry
        self._secret = bytes.fromhex(directory.secret)
        self._router_id = secrets.token_hex(6)   # names this frontend's router to workers
        self._joined = False
        self._handles: list[RayWorker] = []
        self._own: RayLauncher | None = None    # once taken over
        self._lock: int | None = None

    async def start(self, routes: FrontendRouter) -> None:
        if ray.is_initialized():
            return
        host = self._directory.ray_address.rpartition(":")[0]
        if host in ("127.0.0.1", "localhost", "[::1]"):
            bootstrap.loopback_only()   # as the embedded cluster's own processes are
        bootstrap.use_auth_mode(self._directory.ray_auth_mode)
        await asyncio.to_thread(bootstrap.join, self._directory.ray_address)
        self._joined = True

    async def check_room(self, missing: int, in_use: int) -> None:
        if self._own is None:
            raise NotOwned(f"workers: this frontend attaches to the workers of {self.owner}; "
                           "scale them through that frontend")
        await self._own.check_room(missing, in_use)

    async def discover(self) -> set[str]:
        """The ids of the owner's workers that Ray knows now; the workers are taken over
        first when their owner is gone (detached ones only)."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        prefix = self._directory.names
        found = {name[len(prefix):] for name in names if name.startswith(prefix)}
        if self._directory.detached and self._run_dir is not None and self._own is None:
            self._lock = owner_lock(self._run_dir, wait=False)
            if self._lock is not None:
                self._take_over()
        return found

    def _take_over(self) -> None:
        """The owner died (its lock is free): this frontend owns its workers from now on."""
        d = self._directory
        log.warning("the owner of the workers %s* (%s) is gone: this frontend takes them "
                    "over", d.names, self.owner)
        self._own = RayLauncher(self.model_dir, self.engine,
                                Placement(d.cpus_per_worker, d.workers_per_node),
                                d.ray_address, telemetry=self._telemetry, names=d.names,
                                secret=self._secret, router_id=self._router_id)
        for handle in self._handles:
            handle.own()
        self.owner, self.replace_dead = "", True
        self._directory = WorkerDirectory(d.ray_address, d.names, d.secret, os.getpid(),
                                          f"frontend pid {os.getpid()}", d.ray_auth_mode,
                                          d.detached, d.cpus_per_worker, d.workers_per_node)
        self._directory.write(self._run_dir)

    async def launch(self, worker_id: str) -> tuple[RayWorker, WorkerHello]:
        """Attach to a worker that listens (start one, once taken over); ``RuntimeError``
        when it cannot be (still starting, gone, or not on this directory's secret)."""
        if self._own is not None:
            return await self._own.launch(worker_id)
        try:
            actor = await asyncio.to_thread(ray.get_actor, self._directory.names + worker_id)
            answer = await asyncio.wait_for(actor.attach.remote(self._secret), START_TIMEOUT_S)
        except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            raise RuntimeError(f"worker {worker_id}: cannot attach ({exc})") from None
        if answer is None:
            raise RuntimeError(f"worker {worker_id}: still starting")
        hello, (host, port) = answer
        try:
            link = await WorkerLink.connect(worker_id, host, port, self._secret,
                                            self._router_id)
        except OSError as exc:
            raise RuntimeError(f"worker {worker_id}: its stream at {host}:{port} refused "
                               f"({exc})") from None
        handle = RayWorker(worker_id, actor, link, (host, port), owned=False)
        self._handles.append(handle)
        return handle, hello

    async def close(self, handles: Sequence[RayWorker]) -> None:
        await asyncio.gather(*(h.close() for h in handles))   # stopped, once taken over
        if self._own is not None and self._run_dir is not None:
            WorkerDirectory.forget(self._run_dir)   # none left to attach to
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if self._joined:   # disconnects: the cluster is the owner's
            bootstrap.shutdown()
            self._joined = False
