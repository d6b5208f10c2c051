"""A running cluster in one process: Ray (embedded or joined), the RayBackend, the frontend.

    orchard up            ─► serve_until_stopped()   in this process, until SIGINT/SIGTERM
    orchard up --detach   ─► spawn_detached()        the same, in a background process;
                                                      returns once ``cluster.json`` says ready
    orchard down          ─► stop_detached()         SIGTERM to that process, wait for it

``cluster.json`` in the run directory holds the serving process's pid, the frontend address,
the Ray address and the worker count; it exists exactly while a cluster serves from that run
directory, as does ``workers.json`` (private: where the worker actors are and their stream
secret, for frontends that attach to them: ``python -m cluster.api.frontend --attach``). The frontend's own ``frontend.json`` (address file for clients) sits beside it.
The embedded Ray cluster's processes die with the serving process, however it dies
(``cluster.backend.watchdog``).
Operators change a running cluster through the gRPC admin API (``cluster.api.client``), never by
reaching into this process.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from cluster.backend import leftovers, watchdog
from cluster.backend.bootstrap import Placement
from cluster.config import load_config, write_default_config
from cluster.rundir import make_private

log = logging.getLogger(__name__)

STATE_NAME = "cluster.json"
LOG_NAME = "cluster.log"
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ClusterState:
    pid: int
    frontend: str          # host:port of the gRPC frontend ([frontend] host)
    ray_address: str
    workers: int
    started_at: float
    http: str = ""         # the HTTP API's base address (scheme://host:port); "" when off
    metrics: str = ""      # the dedicated /metrics port's base address; "" when off

    @classmethod
    def read(cls, run_dir: Path) -> ClusterState | None:
        path = Path(run_dir) / STATE_NAME
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a cluster state file ({exc}); remove it if no "
                             "cluster runs from this directory") from None

    def write(self, run_dir: Path) -> None:
        path = Path(run_dir) / STATE_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)


@dataclass(frozen=True, slots=True)
class UpOptions:
    run_dir: Path
    workers: int = 2
    address: str | None = None          # None: an embedded local Ray cluster
    placement: Placement = Placement()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")


async def run_cluster(options: UpOptions, stop: asyncio.Event,
                      on_ready: Callable[[ClusterState], None] = lambda state: None,
                      stop_on_signals: bool = False) -> None:
    """Start everything, report ready, serve until ``stop`` is set, then stop everything.

    With ``stop_on_signals``, SIGINT and SIGTERM set ``stop``; the handlers are installed once
    Ray is up, since ``ray.init`` installs handlers of its own for them. An embedded Ray
    cluster is watched (``cluster.backend.watchdog``): its processes die with this one,
    however this one dies.
    """
    make_private(options.run_dir)  # before Ray starts: its processes inherit the umask
    write_default_config(options.run_dir)
    config = load_config(options.run_dir)
    _refuse_if_running(options.run_dir)
    _clean_leftovers(options.run_dir)
    guard = watchdog.start() if options.address is None else None
    try:
        await _serve(options, config, stop, on_ready, stop_on_signals)
    finally:
        if guard is not None:
            await asyncio.to_thread(guard.close)


async def _serve(options: UpOptions, config, stop: asyncio.Event,
                 on_ready: Callable[[ClusterState], None], stop_on_signals: bool) -> None:
    import workers  # noqa: F401  (OpenBLAS before mlx in this process too)
    from cluster.api.frontend import serve
    from cluster.backend.ray_attach import WorkerDirectory, owner_lock
    from cluster.backend.ray_backend import RayBackend

    lock = owner_lock(options.run_dir, wait=False)   # held while this process lives
    if lock is None:
        try:
            holder = WorkerDirectory.read(options.run_dir).owner
        except ValueError:
            holder = "another process"
        raise ValueError(f"the workers of {options.run_dir} are owned by {holder}, which took "
                         "them over from a stopped cluster; stop that frontend first")
    backend = RayBackend.from_config(config, options.workers, options.address,
                                     options.placement)
    try:
        await backend.start()
        leftovers.record(options.run_dir)  # what a kill -9 of this and the watchdog would leave
        frontend = await serve(config, backend)
    except BaseException:
        await backend.close()
        leftovers.forget(options.run_dir)
        os.close(lock)
        raise
    import ray

    state = ClusterState(os.getpid(), frontend.address, ray.get_runtime_context().gcs_address,
                         options.workers, time.time(),
                         frontend.http.address if frontend.http is not None else "",
                         frontend.metrics.address if frontend.metrics is not None else "")
    if stop_on_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    backend.directory(frontend.address).write(options.run_dir)
    state.write(options.run_dir)
    try:
        on_ready(state)
        await stop.wait()
    finally:
        (options.run_dir / STATE_NAME).unlink(missing_ok=True)
        WorkerDirectory.forget(options.run_dir)
        await frontend.stop()
        await backend.close()
        leftovers.forget(options.run_dir)
        os.close(lock)


def serve_until_stopped(options: UpOptions,
                        on_ready: Callable[[ClusterState], None] = lambda s: None) -> None:
    """``run_cluster`` in this process until SIGINT or SIGTERM."""
    async def main() -> None:
        await run_cluster(options, asyncio.Event(), on_ready, stop_on_signals=True)
    asyncio.run(main())


def spawn_detached(options: UpOptions, timeout_s: float = 600.0) -> ClusterState:
    """Run ``orchard up`` (foreground) in a background process; return once it serves."""
    run_dir = options.run_dir
    make_private(run_dir)  # the log below is created for the owner only
    _refuse_if_running(run_dir)
    argv = [sys.executable, "-m", "cluster.cli", "up", "--run-dir", str(run_dir),
            "--workers", str(options.workers),
            "--cpus-per-worker", str(options.placement.cpus_per_worker),
            "--workers-per-node", str(options.placement.workers_per_node)]
    if options.address:
        argv += ["--address", options.address]
    log_path = run_dir / LOG_NAME
    with log_path.open("ab") as out:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = ClusterState.read(run_dir)
        if state is not None and state.pid == child.pid:
            return state
        if child.poll() is not None:
            raise RuntimeError(f"the cluster process exited with status {child.returncode} "
                               f"before it was ready; see {log_path}:\n{_tail(log_path)}")
        time.sleep(0.25)
    child.terminate()
    raise RuntimeError(f"the cluster was not ready after {timeout_s:.0f} s; see {log_path}")


def stop_detached(run_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> ClusterState | None:
    """SIGTERM the run directory's cluster process and wait until it is gone; then stop what
    a killed cluster process left (``cluster.backend.leftovers``). ``None``: no cluster
    process was recorded, only what a killed one left was stopped."""
    state = ClusterState.read(run_dir)
    if state is None:
        if _clean_leftovers(run_dir):
            return None
        raise ValueError(f"no cluster runs from {run_dir} (no {STATE_NAME}); "
                         "start one with `orchard up --detach`")
    if not _alive(state.pid):
        (Path(run_dir) / STATE_NAME).unlink(missing_ok=True)
        _clean_leftovers(run_dir)
        return state
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(state.pid):
        os.kill(state.pid, signal.SIGKILL)
        (Path(run_dir) / STATE_NAME).unlink(missing_ok=True)
    _clean_leftovers(run_dir)
    return state


def _clean_leftovers(run_dir: Path) -> list[leftovers.Process]:
    stopped = leftovers.clean(run_dir)
    if stopped:
        log.warning("stopped %d process(es) that a killed cluster of %s left running: %s",
                    len(stopped), run_dir,
                    ", ".join(f"{p.pid} ({p.command[:40]})" for p in stopped))
    return stopped


def _refuse_if_running(run_dir: Path) -> None:
    state = ClusterState.read(run_dir)
    if state is not None and state.pid != os.getpid() and _alive(state.pid):
        raise ValueError(f"a cluster already runs from {run_dir} (pid {state.pid}, frontend "
                         f"{state.frontend}); stop it with `orchard down --run-dir {run_dir}`")


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
