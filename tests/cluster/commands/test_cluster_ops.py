"""``orchard up/down/scale/drain/frontends/workers`` (``cluster.commands.cluster_ops``): what
they print and refuse without a cluster. The cluster they start is tested in
``tests/cluster/test_daemon.py``."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.commands.cluster_ops import _print_workers, worker_dict
from cluster.config import write_default_config
from cluster.daemon import ClusterState, UpOptions
from proto.orchard.v1 import orchard_pb2 as pb
from tests.support.orchard_process import orchard


def _worker(**disk) -> pb.Worker:
    w = pb.Worker(worker_id="w1", node="node-abcdef0123456", state="ready", running=2,
                  queued_tokens=300, cache_bytes=3 * 2**20, cache_capacity_bytes=8 * 2**20,
                  cache_blocks=12, hit_ratio=0.123456, requests_served=40)
    if disk:
        w.disk.CopyFrom(pb.DiskTier(**disk))
    return w


class TestWhatTheCommandsRefuse:
    def test_bad_arguments_are_refused_with_the_fix(self, tmp_path):
        with pytest.raises(ValueError, match="--workers"):
            UpOptions(tmp_path, workers=0)
        down = orchard("down", "--run-dir", str(tmp_path))
        assert down.returncode == 2 and "no cluster runs" in down.stderr
        up = orchard("up", "--run-dir", str(tmp_path), "--workers", "0", "--detach")
        assert up.returncode == 2 and "--workers must be >= 1" in up.stderr
        workers = orchard("workers", "--run-dir", str(tmp_path))
        assert workers.returncode == 2 and "is the cluster up" in workers.stderr

    def test_scale_to_no_workers_is_refused_before_any_frontend_is_asked(self, tmp_path,
                                                                         capsys):
        assert main(["scale", "--workers", "0", "--run-dir", str(tmp_path)]) == 2
        assert capsys.readouterr().err == "orchard: error: --workers must be >= 1, got 0\n"
        assert main(["scale", "--workers", "-3", "--run-dir", str(tmp_path)]) == 2
        assert "got -3" in capsys.readouterr().err

    def test_frontends_without_a_job_store_says_to_pass_the_run_dir(self, tmp_path, capsys):
        write_default_config(tmp_path)
        assert main(["frontends", "--run-dir", str(tmp_path)]) == 2
        assert capsys.readouterr().err == (
            f"orchard: error: {tmp_path}/jobs.sqlite3: no job store there; pass the cluster's "
            "--run-dir\n")


class TestWhatUpPrints:
    def test_up_prints_both_addresses_with_their_ports_and_how_to_pin_them(self, tmp_path):
        from cluster.commands.cluster_ops import up_lines
        from cluster.config import Config, HttpConfig

        state = ClusterState(4242, "10.0.0.5:50051", "127.0.0.1:6379", 2, 0.0,
                             "https://10.0.0.5:40124")
        picked = Config(tmp_path, {}, frozenset(), host="10.0.0.5", port=50051)
        assert up_lines(state, picked, "Ctrl-C to stop") == [
            "orchard: cluster up (pid 4242): gRPC 10.0.0.5:50051 (port 50051), HTTP API "
            "https://10.0.0.5:40124 (port 40124), 2 worker(s), Ray 127.0.0.1:6379; Ctrl-C to stop",
            f"orchard: [http] port = 0 in {tmp_path}/orchard.toml: a free port, new at every "
            "start; set a fixed one there for clients on other machines"]
        pinned = Config(tmp_path, {}, frozenset(), port=50051, http=HttpConfig(port=40124))
        assert up_lines(state, pinned, "stop it with `orchard down`") == [
            "orchard: cluster up (pid 4242): gRPC 10.0.0.5:50051 (port 50051), HTTP API "
            "https://10.0.0.5:40124 (port 40124), 2 worker(s), Ray 127.0.0.1:6379; stop it with "
            "`orchard down`"]
        off = ClusterState(4242, "[::1]:40123", "127.0.0.1:6379", 1, 0.0)
        assert up_lines(off, Config(tmp_path, {}, frozenset()), "Ctrl-C to stop") == [
            "orchard: cluster up (pid 4242): gRPC [::1]:40123 (port 40123), HTTP API off "
            "([http] enabled = false), 1 worker(s), Ray 127.0.0.1:6379; Ctrl-C to stop",
            f"orchard: [frontend] port = 0 in {tmp_path}/orchard.toml: a free port, new at every "
            "start; set a fixed one there for clients on other machines"]
        both = Config(tmp_path, {}, frozenset())
        assert up_lines(state, both, "")[1].startswith(
            "orchard: [frontend] port and [http] port = 0 in ")
        scraped = ClusterState(4242, "10.0.0.5:50051", "127.0.0.1:6379", 2, 0.0,
                               "https://10.0.0.5:40124", "http://127.0.0.1:9464")
        assert up_lines(scraped, pinned, "")[1:] == [
            "orchard: Prometheus metrics at http://127.0.0.1:9464/metrics (no key, this machine "
            "only); also on the HTTP port with an admin key"]


class TestTheWorkerListing:
    def test_a_worker_without_a_disk_tier_has_no_disk_figures(self):
        assert worker_dict(_worker()) == {
            "worker_id": "w1", "node": "node-abcdef0123456", "state": "ready", "running": 2,
            "queued_tokens": 300, "cache_bytes": 3 * 2**20, "cache_capacity_bytes": 8 * 2**20,
            "cache_blocks": 12, "hit_ratio": 0.1235, "requests_served": 40}

    def test_a_disk_tier_adds_its_figures_and_unknown_free_space_is_none(self):
        listed = worker_dict(_worker(blocks=5, bytes=2**20, capacity_bytes=4 * 2**20,
                                     corrupt=1, torn=2, outdated=3, evictions=7))
        assert {k: v for k, v in listed.items() if k.startswith("disk_")} == {
            "disk_bytes": 2**20, "disk_capacity_bytes": 4 * 2**20, "disk_blocks": 5,
            "disk_free_bytes": None, "disk_corrupt": 1, "disk_torn": 2, "disk_outdated": 3,
            "disk_full": False, "disk_evictions": 7}

    def test_the_table_has_one_line_per_worker_with_its_disk_tier(self, capsys):
        _print_workers([_worker(), _worker(blocks=5, bytes=2**20, capacity_bytes=4 * 2**20,
                                           free_bytes=3 * 2**30, torn=2, evictions=7,
                                           full=True)], as_json=False)
        header, plain, tiered = capsys.readouterr().out.splitlines()
        assert header.split() == ["worker", "node", "state", "running", "queued", "cache",
                                  "MiB", "blocks", "hit", "served", "disk", "tier"]
        assert plain.split() == ["w1", "node-abcdef0", "ready", "2", "300", "3.00", "12",
                                 "12.3%", "40", "none"]
        assert tiered.endswith("   1.00 of 4 MiB, 5 blocks, 3.0 GiB free, corrupt 0, torn 2, "
                               "evicted 7, FULL: writes stopped")

    def test_json_lists_the_same_dicts(self, capsys):
        _print_workers([_worker()], as_json=True)
        assert json.loads(capsys.readouterr().out) == [worker_dict(_worker())]
