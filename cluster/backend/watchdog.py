"""The watchdog: the Ray processes a cluster process started die with it, however it dies
(``kill -9`` included), on Linux and macOS alike.

Why a watchdog, and not a parent-death signal alone: on Linux Ray starts the GCS, the
raylet and its Python daemons with ``PR_SET_PDEATHSIG``, so they die with the ``orchard up``
process; but the raylet's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are
forked by the raylet's C++ code, which orchard cannot reach, with no such signal. They do
notice that the raylet is gone (its pipe closes), and call ``sys.exit`` from a thread, which
leaves the process running for good. A ``prctl`` in orchard could only cover orchard's own
children, and macOS has no ``PR_SET_PDEATHSIG`` at all. So orchard does on both systems what
Ray's own reaper does on macOS (``ray/_private/ray_process_reaper.py``):

    cluster process (leads process group G) ── pipe, write end ──┐
      ├── gcs_server, raylet, dashboard, ... (group G)             │ EOF when the cluster
      │     └── raylet: ray::DashboardAgent, ray::RuntimeEnvAgent  │ process is gone,
      │           (group G), workers (groups of their own; they    │ however it died
      │           exit when the raylet does)                       │
      └── watchdog (the caller's group) ◄─ pipe, read end ────────┘

- ``start`` (in the cluster process, before Ray starts) makes the cluster process lead a
  process group of its own (``os.setpgrp()`` when it does not already: what Ray's reaper
  needs too), so that every process Ray starts inherits group G;
- the watchdog blocks in ``read`` on a pipe whose write end only the cluster process holds
  (non-inheritable, so no Ray process keeps it open): the kernel closes it when that process
  exits or is killed. No polling, no timer;
- at end of file it stops every process of group G except those that were in it before Ray
  started (when ``orchard up`` already led its group, its own pipeline, e.g. ``| tee``):
  SIGTERM, then SIGKILL after ``GRACE_S`` (``leftovers.stop``);
- it stays in the group it was started in: when the cluster process left its caller's group
  (``orchard up`` run by a script), Ctrl-C, SIGTERM or SIGHUP to that group reach the
  watchdog, which passes them on to the cluster process; when both share a group, the
  watchdog ignores them (the cluster process gets them itself, and the watchdog must outlive
  it to clean up).

A clean stop closes the pipe too (``Watchdog.close``), so whatever Ray left after
``ray.shutdown`` goes the same way. ``cluster.backend.leftovers`` stays the fallback for a
watchdog that was itself killed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
from dataclasses import dataclass

from cluster.backend import leftovers

log = logging.getLogger(__name__)

GRACE_S = 2.0           # SIGKILL after this: the agents have nothing to save once orphaned
CLOSE_TIMEOUT_S = 30.0  # a clean stop waits this long for the watchdog to finish
READY_TIMEOUT_S = 30.0  # the watchdog starts in ~0.1 s (a Python process, no Ray import)
READY = b"ready\n"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(slots=True)
class Watchdog:
    """The cluster process's side: the pipe's write end and the watchdog process."""
    process: subprocess.Popen
    pipe: int

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """The cluster stopped: let the watchdog stop what is left of it, and wait for it."""
        if self.pipe >= 0:
            os.close(self.pipe)
            self.pipe = -1
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:  # it goes on by itself; the stop must not hang
            log.warning("the watchdog (pid %d) is still stopping what the cluster left after "
                        "%g s", self.process.pid, timeout_s)


def start() -> Watchdog:
    """Lead a process group of our own and start the watchdog over it (before Ray starts)."""
    me = os.getpid()
    if os.getpgrp() == me:  # already leading: keep what is in the group now (our pipeline)
        keep = [(p.pid, p.started) for p in leftovers.processes() if p.group == me]
    else:
        keep = [(p.pid, p.started) for p in leftovers.processes() if p.pid == me]
    read_end, write_end = os.pipe()  # both non-inheritable: Ray's processes never hold them
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.backend.watchdog", "--cluster", str(me),
             "--keep", json.dumps(keep)],
            stdin=read_end, stdout=subprocess.PIPE)  # stderr: the cluster's, for its word
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    guard = Watchdog(process, write_end)
    try:
        _wait_ready(process, READY_TIMEOUT_S)
    except BaseException:
        process.kill()
        guard.close()
        raise
    if os.getpgrp() != me:
        os.setpgrp()  # once the watchdog listens for signals: it stays in the caller's group
    return guard


def _wait_ready(process: subprocess.Popen, timeout_s: float) -> None:
    """Until the watchdog says it handles signals (a signal before that would kill it)."""
    with process.stdout, selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s) or process.stdout.readline() != READY:
            raise RuntimeError(f"the watchdog (pid {process.pid}) did not start within "
                               f"{timeout_s:g} s (status {process.poll()})")


def watch(cluster: int, keep: set[tuple[int, str]], grace_s: float = GRACE_S
          ) -> list[leftovers.Process]:
    """In the watchdog: wait for the pipe on stdin to close, then stop group ``cluster``'s
    processes but those in ``keep`` (pid, start time); returns what was stopped."""
    forward = os.getpgrp() != cluster
    for sig in FORWARDED:
        signal.signal(sig, (lambda number, _frame: _pass_on(cluster, number)) if forward
                      else signal.SIG_IGN)
    os.write(sys.stdout.fileno(), READY)  # the cluster process goes on (``start``)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # and stops reading: nothing more comes this way
    os.close(devnull)
    while os.read(sys.stdin.fileno(), 4096):
        pass  # the cluster process never writes: this returns at end of file only
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)  # nothing to pass on to any more
    me = os.getpid()
    left = [p for p in leftovers.processes()
            if p.group == cluster and me not in (p.pid, p.parent)  # not this one, nor its ps
            and (p.pid, p.started) not in keep and leftovers.is_running(p.pid)]
    leftovers.stop([p.pid for p in left], grace_s)
    return left


def _pass_on(cluster: int, number: int) -> None:
    try:
        os.kill(cluster, number)
    except ProcessLookupError:
        pass  # gone: the pipe is closing too


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.backend.watchdog",
                                     description="Started by a cluster process; see the "
                                                 "module's documentation.")
    parser.add_argument("--cluster", type=int, required=True,
                        help="the cluster process, the leader of the group to stop")
    parser.add_argument("--keep", default="[]",
                        help="JSON [[pid, start time], ...] of the group's members to spare")
    args = parser.parse_args(argv)
    stopped = watch(args.cluster, {(pid, started) for pid, started in json.loads(args.keep)})
    if stopped:
        print(f"orchard watchdog: the cluster process {args.cluster} is gone; stopped "
              f"{len(stopped)} process(es) it left: "
              + ", ".join(f"{p.pid} ({p.command[:40]})" for p in stopped),
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
