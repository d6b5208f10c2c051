"""The processes a cluster process starts die with it (``cluster.backend.watchdog``).

The fast tests run a stand-in cluster process (``FAKE_CLUSTER``: the watchdog, a tree of
``sleep``s and one orphaned ``sleep``, as Ray's agents are once the raylet is gone) in a
session of its own, so that nothing outside what the test started is ever signalled. The slow
one runs ``orchard up`` itself, kills it with SIGKILL and finds nothing it started.
"""
from __future__ import annotations

from tests.support.paths import REPO

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.backend import leftovers
from cluster.config import write_default_config
from tests.support.forged_models import tiny_model

ROOT = REPO
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
GONE_WITHIN_S = 60.0  # bounded waits: the watchdog acts at once, SIGKILL follows in 2 s

FAKE_CLUSTER = """
import json, os, signal, subprocess, sys
from cluster.backend import watchdog

guard = watchdog.start()

def clean_stop(*_):
    guard.close()
    print("stopped cleanly", flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, clean_stop)
tree = subprocess.Popen(["bash", "-c", "sleep 301 & sleep 302 & wait"])
subprocess.run(["bash", "-c", "sleep 303 & exit 0"], check=True)  # an orphan, as agents are
print(json.dumps({"pid": os.getpid(), "group": os.getpgrp(),
                  "watchdog": guard.process.pid}), flush=True)
while True:
    signal.pause()
"""


def read_line(process: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The next line of ``process``'s stdout, failing at once if it ends or stays silent."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout_s), f"no output within {timeout_s:g} s"
    line = process.stdout.readline()
    assert line, f"the process ended (status {process.poll()}) without a line"
    return line


def alive(snapshot: list[leftovers.Process]) -> list[leftovers.Process]:
    """Those of ``snapshot`` still running (same pid and start time: never a reused pid)."""
    now = {(p.pid, p.started) for p in leftovers.processes()}
    return [p for p in snapshot if (p.pid, p.started) in now and leftovers.is_running(p.pid)]


def wait_gone(snapshot: list[leftovers.Process], within_s: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    while (left := alive(snapshot)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"still running after {within_s:g} s: {[p.command for p in left]}"


def started_in(session: int) -> list[leftovers.Process]:
    """Every process of this test's session ``session`` (and of groups made inside it)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,sess="], capture_output=True, text=True,
                         check=True).stdout
    pids = {int(pid) for pid, sess in (line.split() for line in out.splitlines())
            if int(sess) == session}
    return [p for p in leftovers.processes() if p.pid in pids]


@pytest.fixture
def fake_cluster(tmp_path):
    script = tmp_path / "fake_cluster.py"
    script.write_text(FAKE_CLUSTER)
    started: list[subprocess.Popen] = []

    def start(shell: str) -> tuple[subprocess.Popen, dict]:
        process = subprocess.Popen(["bash", "-c", shell.format(cluster=f"{sys.executable} "
                                                                       f"{script}")],
                                   cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
        started.append(process)
        return process, json.loads(read_line(process))

    yield start
    for process in started:  # whatever a failed test left: only this test's sessions
        leftovers.stop([p.pid for p in alive(started_in(process.pid))], grace_s=1.0)
        process.kill()
        process.wait()
        process.stdout.close()


def test_a_killed_cluster_process_takes_its_processes_but_not_its_pipeline(fake_cluster):
    # bash leads the group, starts a pipeline neighbour, then becomes the cluster process
    shell, info = fake_cluster("sleep 300 & exec {cluster}")
    assert info["pid"] == info["group"] == shell.pid
    everything = started_in(shell.pid)
    neighbour = [p for p in everything if p.command == "sleep 300"]
    ours = [p for p in everything if p.command.startswith("sleep 30") and p not in neighbour]
    assert sorted(p.command for p in ours) == ["sleep 301", "sleep 302", "sleep 303"]
    os.kill(shell.pid, signal.SIGKILL)
    shell.wait()
    wait_gone([p for p in everything if p not in neighbour])
    assert alive(neighbour) == neighbour  # in the group before the cluster: not the cluster's


def test_a_signal_to_the_callers_group_reaches_the_cluster_process(fake_cluster):
    # bash stays, so the cluster process leaves bash's group for its own; the watchdog stays
    shell, info = fake_cluster("{cluster}; exit 3")
    assert info["group"] == info["pid"] != shell.pid
    everything = started_in(shell.pid)
    groups = {p.pid: p.group for p in everything}
    assert groups[info["watchdog"]] == shell.pid
    os.killpg(shell.pid, signal.SIGTERM)  # bash and the watchdog: not the cluster's group
    assert read_line(shell) == "stopped cleanly\n"  # the watchdog passed SIGTERM on
    wait_gone(everything)


def test_a_clean_stop_closes_the_watchdog_at_once(fake_cluster):
    shell, info = fake_cluster("exec {cluster}")
    everything = started_in(shell.pid)
    shell.send_signal(signal.SIGTERM)  # the cluster process itself: Watchdog.close
    assert read_line(shell) == "stopped cleanly\n"
    assert shell.wait(30) == 0
    wait_gone(everything)


@pytest.mark.slow
def test_kill_9_of_orchard_up_leaves_nothing_it_started(tmp_path):
    run_dir = tmp_path / "run"
    write_default_config(run_dir, model_dir=str(tiny_model()))
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", "--run-dir", str(run_dir),
                           "--workers", "1"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=log, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (line := read_line(up, deadline - time.monotonic())).startswith(
                "orchard: cluster up"):
            pass  # Ray's workers' output, passed on by the driver
        info = json.loads((run_dir / "frontend.json").read_text())
        grpc_port = info["address"].rpartition(":")[2]
        http_port = info["http_address"].rpartition(":")[2]
        assert line.startswith(
            f"orchard: cluster up (pid {up.pid}): gRPC {info['address']} (port {grpc_port}), "
            f"HTTP API {info['http_address']} (port {http_port}), 1 worker(s), Ray "), line
        everything = started_in(up.pid)
        commands = [p.command for p in everything]
        assert any("DashboardAgent" in c for c in commands), commands  # what used to stay
        assert any("cluster.backend.watchdog" in c for c in commands), commands
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        wait_gone(everything)
        assert alive(started_in(up.pid)) == []  # nothing started after the snapshot either
    finally:
        leftovers.stop([p.pid for p in alive(started_in(up.pid))], grace_s=1.0)
        up.kill()
        up.wait()
        up.stdout.close()
        log.close()
