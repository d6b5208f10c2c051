"""What a killed ``orchard up`` leaves running is found and stopped, and nothing else is."""
from __future__ import annotations

from tests.support.paths import REPO

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from cluster.backend import leftovers
from cluster.daemon import STATE_NAME, ClusterState
from cluster.config import write_default_config
from tests.support.forged_models import tiny_model

ROOT = REPO


def _alive(process: leftovers.Process) -> bool:
    return any((p.pid, p.started, p.command) == (process.pid, process.started, process.command)
               for p in leftovers.processes())


@pytest.fixture
def orphan_tree():
    """A parent with a grandchild that outlives it, as Ray's agents outlive a killed driver."""
    parent = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"])
    deadline = time.monotonic() + 5
    while len(leftovers.descendants(parent.pid, leftovers.processes())) < 2:
        assert time.monotonic() < deadline, "the sleeps did not start"
        time.sleep(0.05)
    yield parent
    for p in leftovers.descendants(parent.pid, leftovers.processes()):
        os.kill(p.pid, signal.SIGKILL)
    parent.kill()
    parent.wait()


def test_recorded_processes_still_running_are_stopped(tmp_path, orphan_tree):
    recorded = leftovers.record(tmp_path, root=orphan_tree.pid)
    assert sorted(p.command for p in recorded) == ["sleep 300", "sleep 300"]
    orphan_tree.kill()  # the parent dies; its children keep running
    orphan_tree.wait()
    assert all(_alive(p) for p in recorded)
    stopped = leftovers.clean(tmp_path, grace_s=2.0)
    assert sorted(p.pid for p in stopped) == sorted(p.pid for p in recorded)
    assert not any(_alive(p) for p in recorded)
    assert not (tmp_path / leftovers.RECORD_NAME).exists()
    assert leftovers.clean(tmp_path) == []


def test_a_reused_pid_is_never_stopped(tmp_path, orphan_tree):
    recorded = leftovers.record(tmp_path, root=orphan_tree.pid)
    other = [replace(p, started="Thu Jan  1 00:00:00 1970") for p in recorded]
    (tmp_path / leftovers.RECORD_NAME).write_text(json.dumps([asdict(p) for p in other]))
    assert leftovers.clean(tmp_path) == []
    assert all(_alive(p) for p in recorded)


def test_a_damaged_record_names_itself(tmp_path):
    (tmp_path / leftovers.RECORD_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=leftovers.RECORD_NAME):
        leftovers.clean(tmp_path)


def kill_watchdog(recorded: list[leftovers.Process]) -> None:
    """SIGKILL the cluster's watchdog, so that a kill -9 of the cluster leaves its Ray agents
    running, as it would without one: what the record is the fallback for."""
    watchdog = [p for p in recorded if "cluster.backend.watchdog" in p.command]
    assert len(watchdog) == 1, [p.command for p in recorded]
    os.kill(watchdog[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(watchdog[0]):
        assert time.monotonic() < deadline, "the watchdog outlived SIGKILL for 30 s"
        time.sleep(0.1)


def stop_what_is_left(state: ClusterState, recorded: list[leftovers.Process]) -> None:
    """After a failed test: the test's cluster process and what it recorded, if still there."""
    mine = {p.pid for p in recorded if _alive(p)}
    mine |= {p.pid for p in leftovers.processes()
             if p.pid == state.pid and "cluster.cli up" in p.command}
    leftovers.stop(sorted(mine), grace_s=1.0)


def orchard(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_down_stops_what_a_killed_cluster_left_without_its_state_file(tmp_path):
    run_dir = tmp_path / "run"
    write_default_config(run_dir, model_dir=str(tiny_model()))
    up = orchard("up", "--run-dir", str(run_dir), "--workers", "1", "--detach", timeout=600)
    assert up.returncode == 0, up.stderr + (run_dir / "cluster.log").read_text()[-3000:]
    state = ClusterState.read(run_dir)
    recorded = [leftovers.Process(**p) for p in
                json.loads((run_dir / leftovers.RECORD_NAME).read_text())]
    try:
        kill_watchdog(recorded)
        os.kill(state.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(p.pid == state.pid for p in leftovers.processes()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # the GCS and raylet go down with their driver; the agents stay
        left = [p for p in recorded if _alive(p)]
        assert any("Agent" in p.command for p in left), [p.command for p in left]
        (run_dir / STATE_NAME).unlink(missing_ok=True)
        down = orchard("down", "--run-dir", str(run_dir), timeout=120)
        assert down.returncode == 0, down.stderr
        assert "stopped what a killed one left running" in down.stdout
        assert [p.command for p in recorded if _alive(p)] == []
    finally:
        stop_what_is_left(state, recorded)


@pytest.mark.slow
def test_up_in_the_run_directory_of_a_killed_cluster_stops_what_it_left(tmp_path):
    run_dir = tmp_path / "run"
    write_default_config(run_dir, model_dir=str(tiny_model()))
    up = orchard("up", "--run-dir", str(run_dir), "--workers", "1", "--detach", timeout=600)
    assert up.returncode == 0, up.stderr
    state = ClusterState.read(run_dir)
    recorded = [leftovers.Process(**p) for p in
                json.loads((run_dir / leftovers.RECORD_NAME).read_text())]
    try:
        kill_watchdog(recorded)
        os.kill(state.pid, signal.SIGKILL)
        time.sleep(3)
        assert [p for p in recorded if _alive(p)], "kill -9 left nothing running this time"
        again = orchard("up", "--run-dir", str(run_dir), "--workers", "1", "--detach",
                        timeout=600)
        try:
            assert again.returncode == 0, again.stderr
            assert [p.command for p in recorded if _alive(p)] == []
        finally:
            down = orchard("down", "--run-dir", str(run_dir), timeout=120)
    finally:
        stop_what_is_left(state, recorded)
    assert down.returncode == 0, down.stderr
    assert not (run_dir / leftovers.RECORD_NAME).exists()
