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

The workers know each frontend's router by its id (``EngineWorker.events(after,
router_id)``), so the two routers are fed apart and converge on the same belief. Workers the
owner starts later (a scale-up, a replacement) are attached at the next check; a worker that
died is forgotten here and replaced there. Ray ends an actor with the driver that created it,
and ``orchard up``'s embedded Ray cluster with its process: when the owner stops, so do the
workers, and an attached frontend then has none (``NoWorkerAvailable``) until it is started
again over a new owner.
"""
from __future__ import annotations

import asyncio
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
from cluster.backend.ray_pool import START_TIMEOUT_S, RayWorker
from cluster.backend.routing import FrontendRouter
from workers.engine.config import EngineConfig

log = logging.getLogger(__name__)

DIRECTORY_NAME = "workers.json"


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


class RayAttacher:
    """The pool's launcher over another frontend's worker actors (``Launcher``, following)."""

    prefix = "w"
    replace_dead = False   # the owner replaces them
    watch = True           # pings, rebuilt views, and ``discover`` at each check
    pulls = True           # the workers pull from each other as they do for the owner

    def __init__(self, directory: WorkerDirectory, model_dir: str,
                 engine: EngineConfig) -> None:
        self.model_dir = model_dir
        self.engine = engine
        self.owner = f"orchard up (pid {directory.owner_pid}, frontend {directory.owner})"
        self._directory = directory
        self._secret = bytes.fromhex(directory.secret)
        self._router_id = secrets.token_hex(6)   # names this frontend's router to workers
        self._joined = False

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
        raise NotOwned(f"workers: this frontend attaches to the workers of {self.owner}; "
                       "scale them through that frontend")

    async def discover(self) -> set[str]:
        """The ids of the owner's workers that Ray knows now."""
        names = await asyncio.to_thread(ray.util.list_named_actors)
        prefix = self._directory.names
        return {name[len(prefix):] for name in names if name.startswith(prefix)}

    async def launch(self, worker_id: str) -> tuple[RayWorker, WorkerHello]:
        """Attach to a worker that listens; ``RuntimeError`` when it cannot be (still
        starting, gone, or not on this directory's secret)."""
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
        return RayWorker(worker_id, actor, link, (host, port), owned=False), hello

    async def close(self, handles: Sequence[RayWorker]) -> None:
        await asyncio.gather(*(h.close() for h in handles))
        if self._joined:   # disconnects: the cluster is the owner's
            bootstrap.shutdown()
            self._joined = False
