"""A real multi-node Ray cluster on one Linux box: a head and two worker nodes, each in its own
network namespace (``infra/netns.py``), one orchard worker per worker node. A job runs, one
worker node's Ray processes are killed mid-job, and every result still arrives.

Needs root and ``ip netns``; where namespaces are impossible the test is skipped with the
reason (here and in CI it runs).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.forged_models import tiny_model

pytestmark = pytest.mark.slow

INFRA = Path(__file__).resolve().parents[1] / "infra"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"infra_{name}", INFRA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


netns = _load("netns")


@pytest.fixture(scope="module")
def nodes():
    reason = netns.probe()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    cluster = netns.NetnsCluster(workers=2, python=sys.executable)
    try:
        cluster.create()
        cluster.start_ray()
        yield cluster
    finally:
        cluster.destroy()


def test_killing_a_worker_node_mid_job_loses_no_result(nodes, tmp_path):
    victim = nodes.nodes[1]
    done = nodes.run_in(nodes.head, [
        sys.executable, str(INFRA / "netns_job.py"), "--address", nodes.ray_address,
        "--model", str(tiny_model()), "--run-dir", str(tmp_path / "run"),
        "--kill-netns", victim.netns, "--kill-address", victim.address,
        "--requests", "24", "--max-tokens", "48"],
        capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    # one worker on each worker node, none on the head (it offers no orchard_node slot)
    assert sorted(report["placed"].values()) == sorted(n.address for n in nodes.nodes[1:])
    assert report["killed_pids"] > 0 and report["victim_running"] > 0
    assert report["done_before_kill"] < report["total"] == 24
    assert report["results"] == 24 and report["ok"] == 24, report["errors"]
    assert report["retried"] >= 1
    victim_worker = next(w for w, node in report["placed"].items() if node == victim.address)
    assert report["workers_after"][victim_worker] == "dead"
    survivor = next(w for w, node in report["placed"].items() if node != victim.address)
    assert report["workers_after"][survivor] == "ready"
