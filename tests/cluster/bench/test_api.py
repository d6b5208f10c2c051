"""``orchard bench api`` runs end to end and reports every path (figures are not asserted)."""
import json

import pytest

from cluster.cli import main
from tests.support.forged_models import tiny_model


@pytest.mark.slow
def test_bench_api_json(capsys):
    assert main(["bench", "api", "--requests", "3", "--warmup", "1", "--prompt-words", "5",
                 "--model", str(tiny_model()), "--json", "--steps"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["path"] for p in report["paths"]] == ["generate", "http_chat", "batch",
                                                     "job_single"]
    for path in report["paths"]:
        assert path["requests"] == 3
        assert path["wall_p50_ms"] > 0 and path["worker_p50_ms"] > 0
        assert path["overhead_p50_ms"] <= path["overhead_p99_ms"]
    assert [t["path"] for t in report["ttft"]] == ["grpc", "http"]
    assert all(t["requests"] == 10 and 0 < t["ttft_p50_ms"] <= t["ttft_p99_ms"]
               for t in report["ttft"])
    # every request of the two paths found in the frontend's traces, each step measured
    assert [(s["path"], s["requests"]) for s in report["steps"]] == [("generate", 3),
                                                                     ("job_single", 3)]
    assert all(s["edge_p50_ms"] > 0 and s["to_engine_p50_ms"] > 0 for s in report["steps"])


def test_bench_api_steps_need_the_traces_of_a_cluster_it_starts(capsys):
    assert main(["bench", "api", "--steps", "--telemetry", "none"]) == 2
    assert "--steps reads the traces of the cluster the bench starts" in capsys.readouterr().err


def test_bench_api_refuses_half_a_remote_target(capsys):
    assert main(["bench", "api", "--address", "127.0.0.1:1"]) == 2
    assert "--address and --api-key go together" in capsys.readouterr().err
