"""``orchard demo`` (``cluster.commands.demo``): the summary it computes and prints from a job's
results, its refusal of a missing batch file, and (slow) the demo end to end: a local cluster
of 2 workers serves the demo batch from ``examples/`` through the public API, prints its
summary and stops (tiny forged model)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.commands.demo import Summary, _print, summarize
from cluster.config import write_default_config
from cluster.daemon import STATE_NAME
from proto.orchard.v1 import orchard_pb2 as pb
from tests.support.forged_models import tiny_model
from tests.support.paths import REPO as ROOT


def _result(worker: str, prompt: int, cached: int, ttft_s: float, tpot_s: float,
            attempts: int = 1, ok: bool = True) -> pb.Result:
    return pb.Result(ok=ok, worker_id=worker, ttft_s=ttft_s, tpot_s=tpot_s, attempts=attempts,
                     usage=pb.Usage(prompt_tokens=prompt, cached_tokens=cached,
                                    computed_tokens=prompt - cached))


class TestTheSummary:
    def test_it_sums_the_successful_results_and_counts_the_rest(self):
        results = [_result("w1", 100, 0, 0.4, 0.02), _result("w0", 100, 64, 0.1, 0.01, attempts=2),
                   _result("w1", 50, 48, 0.2, 0.03), _result("w0", 999, 999, 9.0, 9.0, ok=False)]
        assert summarize(results, 12.5) == Summary(
            requests=4, failed=1, retried=1, prompt_tokens=250, cached_tokens=112,
            computed_tokens=138, ttft_p50_s=0.2, tpot_p50_s=0.02, wall_s=12.5,
            per_worker={"w0": 1, "w1": 2})
        assert summarize(results, 12.5).hit_ratio == 112 / 250

    def test_a_job_that_all_failed_has_zero_figures_not_an_error(self):
        s = summarize([_result("w0", 10, 0, 1.0, 1.0, ok=False)], 1.0)
        assert (s.requests, s.failed, s.prompt_tokens, s.ttft_p50_s, s.tpot_p50_s,
                s.per_worker, s.hit_ratio) == (1, 1, 0, 0.0, 0.0, {}, 0.0)

    def test_what_it_prints_with_the_answers_checked(self, capsys):
        s = Summary(requests=24, failed=0, retried=1, prompt_tokens=1000, cached_tokens=250,
                    computed_tokens=750, ttft_p50_s=0.0123, tpot_p50_s=0.004, wall_s=3.21,
                    per_worker={"w0": 10, "w1": 14},
                    answers=(("Capital of France?", "Paris", " Paris.\n"),
                             ("Days in a week?", "7", "seven")))
        _print(s, Path("examples/demo_batch.jsonl"))
        assert capsys.readouterr().out.splitlines() == [
            "", "orchard demo: demo_batch.jsonl",
            "  requests        24 (0 failed, 1 retried)",
            "  prompt tokens   1000",
            "  cached tokens   250  (read from the workers' prefix stores)",
            "  computed tokens 750  (prefilled)",
            "  hit ratio       25.0%",
            "  TTFT median     12.3 ms",
            "  TPOT median     4.0 ms",
            "  wall time       3.2 s",
            "  per worker      w0: 10, w1: 14",
            "", "orchard demo: questions with checkable answers",
            "  Capital of France?", "    Paris.  [ok]",
            "  Days in a week?", "    seven  [expected '7']"]


class TestWhatItRefuses:
    def test_a_missing_batch_file_is_named_before_any_cluster_starts(self, tmp_path, capsys):
        missing = tmp_path / "nope.jsonl"
        assert main(["demo", "--batch", str(missing), "--run-dir", str(tmp_path)]) == 2
        assert capsys.readouterr().err == (
            f"orchard: error: {missing} does not exist: pass --batch FILE.jsonl\n")
        assert not (tmp_path / STATE_NAME).exists()


class TestClusterDemo:
    @pytest.mark.slow
    def test_demo_serves_the_batch_with_prefix_hits_and_stops(self, tmp_path):
        write_default_config(tmp_path, model_dir=str(tiny_model()))
        done = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--run-dir", str(tmp_path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        out = done.stdout
        assert re.search(r"requests\s+24 \(0 failed", out), out
        hit = float(re.search(r"hit ratio\s+([\d.]+)%", out).group(1))
        assert hit > 20.0, "conversations sharing system prompts must hit the prefix stores"
        cached = int(re.search(r"cached tokens\s+(\d+)", out).group(1))
        computed = int(re.search(r"computed tokens\s+(\d+)", out).group(1))
        prompt = int(re.search(r"prompt tokens\s+(\d+)", out).group(1))
        assert cached + computed == prompt
        served = {w: int(n) for w, n in re.findall(r"(w\d+): (\d+)", out.split("per worker")[1])}
        assert sum(served.values()) == 24 and set(served) <= {"w0", "w1"}
        assert "cluster stopped" in out and not (tmp_path / STATE_NAME).exists()
