"""``orchard replay`` (``cluster.commands.replay``): what it refuses before any cluster starts
and the table it prints beside the simulator's figures. The replay itself, on a cluster, is
``cluster.bench.replay``'s."""
from __future__ import annotations

from cluster.cli import main
from cluster.commands.replay import _print

CLUSTER = {"requests": 150, "workers": 2, "wall_s": 61.27, "per_worker": {"w0": 70, "w1": 80},
           "hit_ratio": 0.5, "ttft_p50_s": 0.2, "ttft_p99_s": 0.8}


class TestWhatItRefuses:
    def test_replay_refuses_a_scale_that_breaks_the_clusters_blocks_before_starting_it(self, capsys):
        from cluster.cli import main

        # 512 / 512 = 1-token trace blocks against the engine's 16-token blocks
        assert main(["replay", "--requests", "2", "--scale", "512"]) == 2
        assert ("--scale 512 makes 1-token trace blocks, not a multiple of the cluster's "
                "16-token blocks") in capsys.readouterr().err

    def test_no_workers_is_refused(self, capsys):
        assert main(["replay", "--requests", "2", "--workers", "0"]) == 2
        assert capsys.readouterr().err == "orchard: error: --workers must be >= 1, got 0\n"


class TestTheTable:
    def test_the_cluster_alone(self, capsys):
        _print({"cluster": CLUSTER})
        assert capsys.readouterr().out.splitlines() == [
            "150 requests on 2 workers in 61.3 s; per worker {'w0': 70, 'w1': 80}",
            "               cluster",
            "hit ratio       0.5000",
            "TTFT p50        0.2000",
            "TTFT p99        0.8000"]

    def test_beside_the_simulator_the_hit_ratio_differs_by_points_and_ttft_by_share(self, capsys):
        _print({"cluster": CLUSTER,
                "simulator": {"hit_ratio": 0.515, "ttft_p50_s": 0.25, "ttft_p99_s": 0.6}})
        assert capsys.readouterr().out.splitlines()[1:] == [
            "               cluster  simulator   difference",
            "hit ratio       0.5000     0.5150      +0.0150",
            "TTFT p50        0.2000     0.2500       +25.0%",
            "TTFT p99        0.8000     0.6000       -25.0%",
            "bar: hit ratio within 0.02, TTFT p50 within 25%"]

    def test_a_zero_cluster_ttft_is_no_division(self, capsys):
        _print({"cluster": {**CLUSTER, "ttft_p50_s": 0.0},
                "simulator": {"hit_ratio": 0.5, "ttft_p50_s": 0.25, "ttft_p99_s": 0.8}})
        assert capsys.readouterr().out.splitlines()[3].endswith("+0.0%")
