"""What a killed ``orchard up`` leaves behind, and cleaning it up.

When the cluster process dies by ``kill -9``, Ray's GCS, raylet and workers die with it, but the
raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are re-parented to init and
keep running. The watchdog (``cluster.backend.watchdog``) stops them at once; this record is
the fallback for when the watchdog was killed too. ``orchard up`` records the processes of its
embedded Ray session in ``RUN/ray-processes.json`` once Ray is up (every descendant of the
cluster process, with its start time), and removes the record when it stops cleanly. A record
left behind means the predecessor died: ``orchard up`` in that run directory, and ``orchard
down`` (even without ``cluster.json``), stop the recorded processes that still run. A process
counts as the one recorded only if its pid, start time and command all match, so a reused pid
is never hit.

Processes are listed with ``ps`` (Linux and macOS alike).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RECORD_NAME = "ray-processes.json"
TERM_GRACE_S = 5.0  # the agents take seconds to act on SIGTERM; SIGKILL after this


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    parent: int
    started: str   # as ps prints it (lstart): with the pid, what makes a process unique
    command: str
    group: int = 0  # its process group (0 in records written before groups were listed)


def processes() -> list[Process]:
    """Every process on the machine (``ps -A``; ``-ww``: whole commands, as ps cuts them to 80
    columns without a terminal, and a record written without one must match from one)."""
    out = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,pgid=,lstart=,command="],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout
    found = []
    for line in out.splitlines():
        fields = line.split(None, 8)  # pid, ppid, pgid, lstart's five words, the command
        if len(fields) == 9:
            found.append(Process(int(fields[0]), int(fields[1]), " ".join(fields[3:8]),
                                 fields[8], int(fields[2])))
    return found


def descendants(root: int, table: list[Process]) -> list[Process]:
    children: dict[int, list[Process]] = {}
    for process in table:
        children.setdefault(process.parent, []).append(process)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child.pid)
    return found


def record(run_dir: Path, root: int | None = None) -> list[Process]:
    """Write down the processes this cluster process started (call once Ray is up)."""
    mine = descendants(os.getpid() if root is None else root, processes())
    path = run_dir / RECORD_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(p) for p in mine]))
    tmp.replace(path)
    return mine


def forget(run_dir: Path) -> None:
    """The cluster stopped cleanly: nothing of it is left."""
    (run_dir / RECORD_NAME).unlink(missing_ok=True)


def clean(run_dir: Path, grace_s: float = TERM_GRACE_S) -> list[Process]:
    """Stop what a dead predecessor in ``run_dir`` left running; returns what was stopped."""
    path = run_dir / RECORD_NAME
    try:
        recorded = [Process(**entry) for entry in json.loads(path.read_text())]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is damaged ({exc}); stop its processes by hand and remove "
                         "it") from None
    alive = {(p.pid, p.started, p.command) for p in processes()}
    left = [p for p in recorded if (p.pid, p.started, p.command) in alive]
    stop([p.pid for p in left], grace_s)
    path.unlink(missing_ok=True)
    return left


def stop(pids: list[int], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM ``pids``, and SIGKILL those still running after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while (pids := [pid for pid in pids if is_running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids:
            return


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting for init to reap it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                           text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")
