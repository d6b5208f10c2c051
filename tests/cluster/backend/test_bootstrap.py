"""``orchard up --address`` to a head that does not answer fails fast, naming the address.

A real multi-node Ray cluster on one Linux box: a head and two worker nodes, each in its own
network namespace (``infra/netns.py``), one orchard worker per worker node. A job runs, one
worker node's Ray processes are killed mid-job, and every result still arrives.

Needs root and ``ip netns``; where namespaces are impossible the test is skipped with the
reason (here and in CI it runs).
"""
from __future__ import annotations

import concurrent.futures
import socket
import time
import pytest
from cluster.backend.bootstrap import join  # noqa: E402
import json
import sys
from tests.support.forged_models import tiny_model
from tests.support.netns_hosts import INFRA, netns_cluster


pytest.importorskip("ray")

def _join_within(address: str, timeout_s: float, limit_s: float) -> tuple[str, float]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    started = time.monotonic()
    future = pool.submit(join, address, timeout_s)
    try:
        future.result(timeout=limit_s)
    except ValueError as exc:
        return str(exc), time.monotonic() - started
    finally:
        pool.shutdown(wait=False)
    raise AssertionError("join returned: it should have failed")


class TestJoin:
    def test_a_closed_port_fails_at_once_naming_the_address(self):
        with socket.socket() as probe:  # a port nobody listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        message, took_s = _join_within(f"127.0.0.1:{port}", 30.0, limit_s=10)
        assert message.startswith(f"cannot reach the Ray head at 127.0.0.1:{port}: ")
        assert "Connection refused" in message and took_s < 5

    def test_a_silent_listener_fails_within_the_timeout(self):
        with socket.socket() as silent:  # accepts connections, never says a word
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            port = silent.getsockname()[1]
            message, took_s = _join_within(f"127.0.0.1:{port}", 2.0, limit_s=15)
        assert message == (f"cannot reach the Ray head at 127.0.0.1:{port}: a connection opens but "
                           "no gRPC server answered within 2 s; is that the Ray head's GCS port "
                           "(6379 by default)?")
        assert took_s < 5


pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def nodes():
    with netns_cluster(workers=2, ray=True) as cluster:
        yield cluster


class TestMultinode:
    def test_killing_a_worker_node_mid_job_loses_no_result(self, nodes, tmp_path):
        victim = nodes.nodes[1]
        done = nodes.run_in(nodes.head, [
            sys.executable, str(INFRA / "netns_job.py"), "--address", nodes.ray_address,
            "--model", str(tiny_model()), "--run-dir", str(tmp_path / "run"),
            "--kill-netns", victim.netns, "--kill-address", victim.address,
            "--requests", "24", "--max-tokens", "400"],  # long enough to be running at the kill
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
