"""``orchard bench batch`` end to end on a small file: every figure measured, none made up."""
import json
import os

import pytest

from cluster.bench.batch import write_file
from cluster.cli import main


def test_the_bench_file_is_short_chats_of_about_880_bytes(tmp_path):
    path = write_file(tmp_path / "b.jsonl", 100)
    lines = path.read_text().splitlines()
    assert len(lines) == 100 and 850 < path.stat().st_size / 100 < 910
    first = json.loads(lines[0])
    assert first["custom_id"] == "req-0" and first["body"]["max_tokens"] == 1


@pytest.mark.slow
def test_bench_batch_json(capsys):
    from tests.support.forged_models import tiny_model  # fast enough for results inside a short window

    assert main(["bench", "batch", "--requests", "300", "--window", "3", "--json",
                 "--model", str(tiny_model())]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["requests"] == 300
    assert 0 < figures["accept_s"] < 60
    # the frontend's CPU time, read in clock ticks from /proc: a quick acceptance may take none
    ticks = figures["accept_cpu_s"] * os.sysconf("SC_CLK_TCK")
    assert ticks >= 0 and abs(ticks - round(ticks)) < 1e-6
    assert 850 < figures["store_bytes_per_request"] < 2500  # the line once, plus row overhead
    assert figures["dispatch_per_s"] > 0 and figures["split_dispatch_per_s"] > 0
    assert 0 <= figures["cached_share"] <= 1
